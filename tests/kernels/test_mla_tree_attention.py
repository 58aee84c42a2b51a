"""The MLA tree kernel against its torch twin (ops/mla_attention.py) and against plain
MLA per branch: the prefix attended by the kernel, or through the twin's prefix pass (a
backend's kernel on the GPU) and resumed by the kernel over the tree keys; and the tree
keys alone."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_tree_attention import BF16  # float16 under the interpreter
from tests.ops.test_attention_reference import padded_tree_mask
from tests.ops.test_mla_attention import (
    DSV3,
    ODD,
    TOLERANCES,
    assert_matches_expanded_oracle,
    make_latent_batch,
    random_trees,
)
from tests.triton_utils import DEVICE, needs_kernel
from vllm_ddtree.kernels.mla_tree_attention import mla_tree_attention_triton
from vllm_ddtree.tensors import pack_tree_mask

pytestmark = [pytest.mark.gpu, needs_kernel]


def to_device(batch):
    for name in ("q_absorbed", "q_pe", "kv_cache", "block_table", "seq_lens",
                 "query_start_loc"):
        setattr(batch, name, getattr(batch, name).to(DEVICE))
    return batch


def run_kernel(batch, mask, prefix: str, max_seq_len: int | None = None, **tiling):
    """prefix: "given" (the twin's prefix pass, resumed), "computed" (attended by the
    kernel) or "none" (the tree keys alone); ``max_seq_len`` lets the kernel split long
    prefixes."""
    prefix_out = prefix_lse = None
    if prefix == "given":
        prefix_out, prefix_lse = batch.run(None, keys="prefix")
    out, lse = mla_tree_attention_triton(
        batch.q_absorbed, batch.q_pe, batch.kv_cache, batch.block_table, batch.seq_lens,
        batch.query_start_loc, mask, batch.dims.scale, "tree" if prefix == "none" else "all",
        prefix_out, prefix_lse, max_seq_len, **tiling)
    return out.cpu(), lse.cpu()


@pytest.mark.parametrize("prefix", ["given", "computed"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("budget", [1, 8, 17, 31])
def test_every_branch_equals_plain_mla(budget, packed, prefix):
    """Prefix 0 (no prefix keys: LSE +inf), a page-crossing prefix and odd widths; a
    mask wider than the requests with garbage padding; two padding rows."""
    trees = random_trees([budget, 3, budget], 15, seed=budget)
    query_lens = [len(t) for t in trees]
    batch = to_device(make_latent_batch(query_lens, [21, 0, 40], ODD, torch.float32,
                                        budget, page_size=16, strided=True))
    mask = padded_tree_mask(trees, max(query_lens) + 3, budget).to(DEVICE)
    out, lse = run_kernel(batch, pack_tree_mask(mask) if packed else mask, prefix)
    for name in ("q_absorbed", "q_pe", "kv_cache"):
        setattr(batch, name, getattr(batch, name).cpu())
    assert_matches_expanded_oracle(batch, trees, out, lse)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_tree_keys_alone_and_the_kimi_latent(dtype):
    """DeepSeek-V3 / Kimi widths (512 + 64), more heads than a head block, budget 16:
    the tree pass alone equals the twin's ``keys="tree"`` and, resumed from the
    prefix, its one pass over both."""
    dims = type(DSV3)(num_heads=20, kv_lora_rank=512, rope_dim=64, nope_dim=128,
                      v_dim=128)
    trees = random_trees([16, 16], 7, seed=5)
    query_lens = [len(t) for t in trees]
    batch = to_device(make_latent_batch(query_lens, [64, 7], dims, dtype, 5, page_size=64))
    mask = pack_tree_mask(padded_tree_mask(trees, max(query_lens), 5)).to(DEVICE)
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    for prefix, keys in [("none", "tree"), ("given", "all"), ("computed", "all")]:
        out, lse = run_kernel(batch, mask, prefix)
        want_out, want_lse = batch.run(mask, keys=keys)
        torch.testing.assert_close(out.float(), want_out.float().cpu(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse, want_lse.cpu(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_seq_len,tiling", [
    (None, {}), (1024, {}), (8192, {}), (8192, {"block_n": 16, "waves": 2})])
def test_split_prefixes_merge_to_one_pass(max_seq_len, tiling):
    """A long prefix cut into KV splits (none without a bound, some, more than the
    prefix has tiles: empty splits), the tree keys in the last split, merged by LSE;
    narrower key tiles and fewer splits than the default alike."""
    from vllm_ddtree.kernels.mla_tree_attention import choose_mla_splits

    trees = random_trees([17, 5, 8], 15, seed=11)
    query_lens = [len(t) for t in trees]
    batch = to_device(make_latent_batch(query_lens, [700, 0, 1], ODD, torch.float32, 11,
                                        page_size=16, strided=True))
    mask = padded_tree_mask(trees, max(query_lens), 11).to(DEVICE)
    splits = choose_mla_splits(batch.q_pe.shape[0], max_seq_len, DEVICE, **tiling)
    assert (splits > 1) == (max_seq_len is not None)
    if tiling:
        assert splits < choose_mla_splits(batch.q_pe.shape[0], max_seq_len, DEVICE)
    out, lse = run_kernel(batch, mask, "computed", max_seq_len, **tiling)
    for name in ("q_absorbed", "q_pe", "kv_cache"):
        setattr(batch, name, getattr(batch, name).cpu())
    assert_matches_expanded_oracle(batch, trees, out, lse)


def test_no_mask_is_a_chain():
    batch = to_device(make_latent_batch([4, 2], [5, 3], ODD, torch.float32, 3))
    want_out, want_lse = batch.run(None)
    for prefix in ("given", "computed"):
        out, lse = run_kernel(batch, None, prefix)
        torch.testing.assert_close(out, want_out.cpu(), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, want_lse.cpu(), atol=2e-5, rtol=2e-5)


def test_tiles_narrower_than_an_mma_are_refused():
    batch = to_device(make_latent_batch([2], [3], ODD, torch.float32, 3))
    with pytest.raises(ValueError, match="block_n=8"):
        run_kernel(batch, None, "computed", block_n=8)
    with pytest.raises(ValueError, match="waves=0"):
        run_kernel(batch, None, "computed", waves=0)


def test_mismatched_prefix_arguments_are_refused():
    batch = to_device(make_latent_batch([2], [3], ODD, torch.float32, 1))
    out, _ = batch.run(None, keys="prefix")
    with pytest.raises(ValueError, match="both"):
        mla_tree_attention_triton(batch.q_absorbed, batch.q_pe, batch.kv_cache,
                                  batch.block_table, batch.seq_lens, batch.query_start_loc,
                                  None, 1.0, prefix_out=out)
    with pytest.raises(ValueError, match="keys"):
        mla_tree_attention_triton(batch.q_absorbed, batch.q_pe, batch.kv_cache,
                                  batch.block_table, batch.seq_lens, batch.query_start_loc,
                                  None, 1.0, "tree", out, torch.zeros(ODD.num_heads, 4))


def test_dot_widths_reach_the_smallest_mma():
    """sm90 refuses a tl.dot reducing over fewer than 16 columns (the interpreter does
    not): the rope part of a tiny test model, 8 wide, pads to 16."""
    from vllm_ddtree.kernels.mla_tree_attention import dot_width

    assert [dot_width(n) for n in (1, 8, 16, 17, 64, 512)] == [16, 16, 16, 32, 64, 512]
