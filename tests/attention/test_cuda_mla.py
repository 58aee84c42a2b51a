"""Tests for vllm_ddtree/attention/cuda_mla.py (TRITON_MLA): its decode rows through the
MLA tree kernel (on the CPU under Triton's interpreter), its registration and the
start-up message for the CUDA MLA backends without a tree path. Tree rows are checked
against plain MLA of each node over its prefix and branch alone
(tests/ops/test_mla_attention.py), the other decode rows against the twin in causal
form. The backend in an engine needs the GPU (tests/gpu/)."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_cpu_mla import CudaMLABackend
from tests.ops.test_attention_reference import padded_tree_mask
from tests.ops.test_mla_attention import (
    ODD,
    expanded_branch_oracle,
    make_latent_batch,
    project,
    random_trees,
)
from tests.runner.test_common import fake_runner
from tests.triton_utils import DEVICE, needs_kernel
from vllm_ddtree.attention.state import TreeAttentionInfo
from vllm_ddtree.runner.common import check_tree_backends
from vllm_ddtree.tensors import pack_tree_mask


def tree_info(query_lens: list[int], trees: dict[int, list[int]], seed: int,
              all_tree_rows: bool) -> TreeAttentionInfo:
    """The step's tree: requests in ``trees`` carry one (their rows all tree rows)."""
    width = max(query_lens)
    mask = padded_tree_mask([trees.get(r, [-1]) for r in range(len(query_lens))], width,
                            seed)
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    info = TreeAttentionInfo(
        tree_mask=mask, row_start=starts[:-1],
        num_rows=torch.tensor([len(trees[r]) if r in trees else 0
                               for r in range(len(query_lens))]),
        tree_reqs=sorted(trees), all_rows_are_tree_rows=all_tree_rows)
    info.prepare_for(DEVICE)
    if DEVICE.type != "cuda":  # the CPU indexes tree rows always; the kernel needs none
        info.rows = info.rows.to(DEVICE)
    return info


@needs_kernel
@pytest.mark.gpu
@pytest.mark.parametrize("max_len", [None, 2048])
@pytest.mark.parametrize("all_tree_rows", [True, False])
def test_tree_rows_are_plain_mla_per_branch_and_other_rows_causal(all_tree_rows, max_len):
    from vllm_ddtree.attention.cuda_mla import decode_rows_attention

    trees_list = random_trees([16, 7, 4], 15, seed=3)
    if all_tree_rows:
        trees = dict(enumerate(trees_list))
    else:  # request 1 decodes 3 rows without a tree (a short prompt counted as a decode)
        trees = {0: trees_list[0], 2: trees_list[2]}
        trees_list[1] = [-1, 0, 1]
    query_lens = [len(t) for t in trees_list]
    batch = make_latent_batch(query_lens, [20, 300, 1], ODD, torch.float32, 3)
    info = tree_info(query_lens, trees, 3, all_tree_rows)
    out = decode_rows_attention(
        batch.q_absorbed.to(DEVICE), batch.q_pe.to(DEVICE), batch.kv_cache.to(DEVICE),
        batch.block_table.to(DEVICE), batch.seq_lens.to(DEVICE),
        batch.query_start_loc.to(DEVICE), info, ODD.scale, max_len).cpu()
    values = project(batch, out)
    causal_out, _ = batch.run(None)
    for r, parents in enumerate(trees_list):
        first = int(batch.query_start_loc[r])
        for node in range(len(parents)):
            if r in trees:
                want, _ = expanded_branch_oracle(batch, r, parents, node)
                torch.testing.assert_close(values[first + node], want, atol=2e-5, rtol=2e-5)
            else:
                torch.testing.assert_close(out[first + node], causal_out[first + node],
                                           atol=2e-5, rtol=2e-5)


def test_cuda_mla_backends_are_registered_for_ddtree_engines():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as Enum

    from vllm_ddtree.attention import register_backends
    from vllm_ddtree.attention.cuda_mla import DDTreeTritonMLABackend

    register_backends("cuda")  # what a DDTree runner on CUDA does before building
    try:
        assert Enum.TRITON_MLA.get_class() is DDTreeTritonMLABackend
        # FlashAttention's bindings exist on CUDA builds only: the path, not the class.
        assert Enum.FLASH_ATTN_MLA.get_path() == (
            "vllm_ddtree.attention.cuda_flash_mla.DDTreeFlashAttnMLABackend")
        check_tree_backends(fake_runner({"model.layers.0.self_attn.attn":
                                         DDTreeTritonMLABackend}))
    finally:
        for enum in (Enum.FLASH_ATTN, Enum.TRITON_ATTN, Enum.TRITON_MLA, Enum.FLASH_ATTN_MLA):
            enum.clear_override()


def fake_flash_attn(batch):
    """FlashAttention 3's MLA call (q = rope part, k = k_pe, v = kv_c, q_v = absorbed
    no-rope part) computed by the twin over ``seqused_k`` keys of each request, non-causal
    only; returns (out, LSE [heads, rows]) as FlashAttention does."""
    from vllm_ddtree.ops.mla_attention import mla_tree_attention

    def call(*, q, k, v, q_v, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal,
             return_softmax_lse, **_):
        assert not causal and return_softmax_lse
        assert k.shape[-1] == ODD.rope_dim and v.shape[-1] == ODD.kv_lora_rank
        cache = torch.cat([v[..., 0, :], k[..., 0, :]], dim=-1)
        # The twin's prefix pass over seq_lens - rows keys: seqused_k exactly.
        seq_lens = seqused_k + cu_seqlens_q.diff()
        return mla_tree_attention(q_v, q, cache, block_table, seq_lens, cu_seqlens_q, None,
                                  softmax_scale, keys="prefix")

    return call


@needs_kernel
@pytest.mark.gpu
def test_flash_prefix_rows_resume_flash_attention_over_the_trees():
    from vllm_ddtree.attention.cuda_mla import flash_prefix_rows

    trees = random_trees([16, 5, 9], 15, seed=8)
    query_lens = [len(t) for t in trees]
    batch = make_latent_batch(query_lens, [40, 0, 17], ODD, torch.float32, 8)
    mask = pack_tree_mask(padded_tree_mask(trees, max(query_lens), 8))
    out = flash_prefix_rows(
        fake_flash_attn(batch), *(t.to(DEVICE) for t in (
            batch.q_absorbed, batch.q_pe, batch.kv_cache, batch.block_table,
            batch.seq_lens, batch.query_start_loc, mask)),
        ODD.scale, max_query_len=max(query_lens), max_seq_len=100, num_splits=0,
        scheduler_metadata=None).cpu()
    values = project(batch, out)
    for r, parents in enumerate(trees):
        first = int(batch.query_start_loc[r])
        for node in range(len(parents)):
            want, _ = expanded_branch_oracle(batch, r, parents, node)
            torch.testing.assert_close(values[first + node], want, atol=2e-5, rtol=2e-5)


def test_mla_backends_without_trees_name_the_one_to_pick():
    runner = fake_runner({"model.layers.0.self_attn.attn": CudaMLABackend})
    with pytest.raises(NotImplementedError, match="--attention-backend TRITON_MLA"):
        check_tree_backends(runner)


def test_capture_builds_give_tree_rows_no_negative_prefix():
    """vLLM captures decode graphs with seq_lens of 1; with a tree published, the MLA
    builders raise each to its query rows (the shared buffer the replays read)."""
    from types import SimpleNamespace

    from vllm_ddtree.attention.cuda_mla import MLACaptureMixin

    seq_lens = torch.tensor([1, 1, 40], dtype=torch.int32)
    metadata = SimpleNamespace(tree=object(), decode=SimpleNamespace(seq_lens=seq_lens),
                               query_start_loc=torch.tensor([0, 17, 34, 51, 51],
                                                            dtype=torch.int32))

    class Parent:
        def build_for_cudagraph_capture(self, _):
            return metadata

    class Builder(MLACaptureMixin, Parent):
        pass

    Builder().build_for_cudagraph_capture(None)
    assert seq_lens.tolist() == [17, 17, 40]
    metadata.tree = None  # no tree published: the parent's lengths as they are
    seq_lens[:] = 1
    Builder().build_for_cudagraph_capture(None)
    assert seq_lens.tolist() == [1, 1, 1]
