"""Tests for vllm_ddtree/attention/cpu_mla.py (CPU_MLA) and the page size of 16 that
attention/cpu.py declares so that a DFlash drafter's CPU_ATTN layers can share an
engine with it. No engine: vLLM's kernels run on hand-made caches, the builder runs
on vLLM's own build over a hand-made batch. Engines: tests/engine/test_mla.py.

Tree rows are checked against an independent oracle (tests/ops/test_mla_attention.py:
plain MLA of each node over its prefix plus its root-to-node branch alone); rows
outside the trees against the twin in causal form, which vLLM's one-query decode
kernel must reproduce once the builder has listed each row as its own request.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from tests.ops.test_attention_reference import padded_tree_mask, random_tree_parents
from tests.ops.test_mla_attention import (
    DSV3,
    expanded_branch_oracle,
    make_latent_batch,
    project,
)
from tests.runner.test_common import fake_runner
from vllm_ddtree.attention import cpu, cpu_mla, register_backends
from vllm_ddtree.attention.state import TreeAttentionInfo, publishing
from vllm_ddtree.ops.compaction import move_slots
from vllm_ddtree.ops.mla_attention import mla_tree_attention
from vllm_ddtree.runner.common import check_tree_backends

PAGE = 16  # CPU_MLA's only page size
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


# ----------------------------------------------------------------------------------
# Page size 16: the drafter's CPU_ATTN next to CPU_MLA
# ----------------------------------------------------------------------------------


def test_drafter_and_mla_target_share_a_page_of_16_only_through_ddtree():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.worker.utils import select_common_block_size

    with pytest.raises(ValueError, match="No common block size for 16"):
        select_common_block_size(16, [CPUMLABackend, CPUAttentionBackend])
    backends = [cpu_mla.DDTreeCPUMLABackend, cpu.DDTreeCPUAttentionBackend]
    assert select_common_block_size(16, backends) == 16
    # A dense engine keeps vLLM's page (128 on the CPU) and its kernel.
    assert select_common_block_size(128, [cpu.DDTreeCPUAttentionBackend]) == 128


def test_page_of_16_only_where_vec16_runs_it(monkeypatch):
    from vllm.platforms import CpuArchEnum, current_platform
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.kv_cache_interface import KVQuantMode

    sizes = cpu.DDTreeCPUAttentionBackend.get_supported_kernel_block_sizes
    fp8 = SimpleNamespace(kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    monkeypatch.setattr(current_platform, "get_cpu_architecture", lambda: CpuArchEnum.X86)
    assert sizes() == [16, MultipleOf(32)]
    assert sizes(fp8) == [MultipleOf(32)]  # vec16 has no fp8 cache
    monkeypatch.setattr(current_platform, "get_cpu_architecture", lambda: CpuArchEnum.ARM)
    assert sizes() == [MultipleOf(32)]  # NEON needs multiples of 32


@pytest.mark.parametrize("amx", [False, True])
def test_a_page_of_16_takes_vec16_in_every_dtype_amx_included(monkeypatch, amx):
    """vLLM chooses the kernel per page size: bf16 on AMX needs multiples of 32, so a
    page of 16 falls back to vec16, whose cache layout the tree path reads."""
    from vllm.platforms import CpuArchEnum, current_platform
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(current_platform, "get_cpu_architecture", lambda: CpuArchEnum.X86)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert cpu_attn._get_attn_isa(dtype, 16, 128, "auto") == "vec16"
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 128, "auto") == ("amx" if amx else "vec")


@pytest.mark.skipif(not torch.cpu._is_avx2_supported(), reason="x86 vec16 kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 512])
def test_vllm_vec16_kernel_runs_pages_of_16(dtype, head_dim):
    """The kernel behind the declared 16: causal paged attention (GQA 4:2) at page 16
    against SDPA, in every dtype CPU_ATTN takes."""
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, requests = 4, 2, [(3, 37), (1, 20), (5, 5)]  # (queries, seq_len)
    pages = max(-(-s // PAGE) for _, s in requests)
    kv_cache = torch.zeros(len(requests) * pages, kv_heads, PAGE, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv_cache.view(-1, kv_heads, 2 * PAGE, head_dim).chunk(2, dim=2)
    block_table = torch.arange(kv_cache.shape[0], dtype=torch.int32).view(len(requests), -1)
    keys = [torch.randn(s, kv_heads, head_dim, generator=gen).to(dtype) for _, s in requests]
    values = [torch.randn(s, kv_heads, head_dim, generator=gen).to(dtype) for _, s in requests]
    for r, (_, seq_len) in enumerate(requests):
        positions = torch.arange(seq_len)
        slots = block_table[r].long()[positions // PAGE] * PAGE + positions % PAGE
        ops.cpu_attn_reshape_and_cache(keys[r], values[r], key_cache, value_cache, slots,
                                       "vec16")
    starts = torch.tensor([0] + [q for q, _ in requests]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in requests], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), heads, head_dim, generator=gen).to(dtype)
    out = torch.zeros_like(query)
    scale = head_dim**-0.5
    schedule = ops.cpu_attn_get_scheduler_metadata(
        len(requests), heads, kv_heads, head_dim, seq_lens, dtype, starts, True, -1,
        "vec16", False)
    ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, out, starts, seq_lens,
                                    scale, True, None, -1, block_table, 0.0, schedule, None)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    for r, (num_queries, seq_len) in enumerate(requests):
        rows = slice(int(starts[r]), int(starts[r + 1]))
        key, value = (t[r].float().repeat_interleave(2, dim=1).transpose(0, 1)
                      for t in (keys, values))
        visible = torch.ones(num_queries, seq_len, dtype=torch.bool).tril(seq_len - num_queries)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[rows].float().transpose(0, 1), key, value, attn_mask=visible, scale=scale)
        torch.testing.assert_close(out[rows].float(), expected.transpose(0, 1),
                                   atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------
# The builder: verify rows are variable-length decodes, each row its own request
# ----------------------------------------------------------------------------------


def mla_builder(budget: int, parallel_drafting: bool = False):
    """vLLM's MLA build over DDTree's builder class, with the attributes its decode
    and prefill paths read (the real __init__ needs a loaded model), and its reorder
    threshold from vLLM's own rule for the speculative config."""
    builder = object.__new__(cpu_mla.DDTreeCPUMLAMetadataBuilder)
    spec = SimpleNamespace(num_speculative_tokens=budget, parallel_drafting=parallel_drafting)
    builder.vllm_config = SimpleNamespace(
        speculative_config=spec, use_v2_model_runner=False,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    builder._init_reorder_batch_threshold(1, True, False)
    builder.metadata_cls = cpu_mla.DDTreeCPUMLAMetadata
    builder.device = torch.device("cpu")
    builder.use_pcp = False
    builder.non_causal_multi_token_decode = False
    builder.dcp_world_size = builder.cp_kv_cache_interleave_size = 1
    builder.dcp_local_block_size = builder.dcp_virtual_block_size = 1
    builder.dcp_manager = None
    builder.page_size = PAGE
    builder.chunked_prefill_workspace_size = 4096
    builder.chunked_prefill_workspace = torch.empty(4096, 576)
    builder.model_config = SimpleNamespace(dtype=torch.float32, get_head_size=lambda: 576)
    builder.q_data_type = torch.float32
    builder._prefill_backend = SimpleNamespace(prepare_metadata=lambda metadata: None)
    return builder


def common_metadata(query_lens: list[int], seq_lens: list[int]):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    blocks = -(-max(seq_lens) // PAGE)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq,
        num_reqs=len(query_lens), num_actual_tokens=int(starts[-1]),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.arange(len(query_lens) * blocks,
                                        dtype=torch.int32).view(-1, blocks),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq,
    )


def causal_tree_info(query_lens: list[int], tree_rows: list[int]) -> TreeAttentionInfo:
    """The last ``tree_rows[r]`` rows of each request verify a causal tree (0: none)."""
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    width = max(max(tree_rows), 1)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return TreeAttentionInfo(
        tree_mask=causal.expand(len(query_lens), width, width).contiguous(),
        row_start=starts[1:] - torch.tensor(tree_rows), num_rows=torch.tensor(tree_rows),
        tree_reqs=[r for r, n in enumerate(tree_rows) if n],
        all_rows_are_tree_rows=tree_rows == query_lens,
    )


@pytest.mark.parametrize("budget", [1, 7, 17])
def test_verify_rows_go_to_forward_mqa_as_variable_length_decodes(budget):
    builder = mla_builder(budget)
    assert builder.reorder_batch_threshold == budget + 1  # vLLM's batch reorder
    # vLLM's order: decodes (trees, a decode without drafts), then a prompt.
    width = budget + 1
    query_lens = [width, 1, width, 40]
    seq_lens = [30, 18, 50, 40]
    info = causal_tree_info(query_lens, [width, 0, width, 0])
    with publishing(info):
        metadata = builder.build(0, common_metadata(query_lens, seq_lens))
    assert isinstance(metadata, cpu_mla.DDTreeCPUMLAMetadata) and metadata.tree is info
    assert (metadata.num_decodes, metadata.num_prefills) == (3, 1)
    assert metadata.num_decode_tokens == 2 * width + 1
    decode = metadata.decode
    # Each decode row is a one-query request over the keys up to its own position.
    expected = [*range(30 - width + 1, 31), 18, *range(50 - width + 1, 51)]
    assert decode.seq_lens.tolist() == expected
    owner = [0] * width + [1] + [2] * width
    assert torch.equal(decode.block_table, decode.request_block_table[owner])
    assert decode.request_seq_lens.tolist() == [30, 18, 50]
    assert metadata.prefill is not None
    plain = builder.build(0, common_metadata(query_lens, seq_lens))
    assert plain.tree is None  # nothing published: the drafter's builds, prefill steps


def test_tree_rows_counted_as_prefill_fail_clearly():
    """A reorder threshold below the verify width would send tree rows to the causal
    prefill path; the builder refuses rather than verify a chain."""
    builder = mla_builder(budget=3)
    query_lens, seq_lens = [4, 9], [20, 30]  # the second tree is wider than 1 + 3
    with publishing(causal_tree_info(query_lens, [4, 9])), pytest.raises(
            RuntimeError, match="only the first 4 rows as decodes"):
        builder.build(0, common_metadata(query_lens, seq_lens))


def test_expanded_rows_of_single_row_requests_are_vllms_own():
    block_table = torch.arange(12, dtype=torch.int32).view(3, 4)
    seq_lens = torch.tensor([5, 9, 2], dtype=torch.int32)
    rows = cpu_mla.expand_decode_rows(block_table, seq_lens,
                                      torch.tensor([0, 1, 2, 3], dtype=torch.int32), 3)
    assert torch.equal(rows[0], block_table) and torch.equal(rows[1], seq_lens)


# ----------------------------------------------------------------------------------
# The impl: tree rows against the oracle, other rows through vLLM's kernel
# ----------------------------------------------------------------------------------


def mla_impl() -> cpu_mla.DDTreeCPUMLAImpl:
    impl = object.__new__(cpu_mla.DDTreeCPUMLAImpl)
    impl.num_heads, impl.kv_lora_rank, impl.scale = DSV3.num_heads, DSV3.kv_lora_rank, DSV3.scale
    impl.kv_cache_dtype = "auto"
    return impl


def verify_step(trees: list[list[int] | None], query_lens: list[int], prefix_lens: list[int],
                dtype: torch.dtype, seed: int):
    """A decode batch through the builder and the impl: request r verifies tree
    ``trees[r]`` (parents; None: no tree, its rows causal). Returns the batch, the
    impl's latent output and the tree info."""
    # Unused cache slots hold NaN: neither vLLM's kernel nor the twin may read one.
    batch = make_latent_batch(query_lens, prefix_lens, DSV3, dtype, seed, page_size=PAGE)
    width = max(query_lens)
    parents = [t if t is not None else list(range(-1, n - 1)) for t, n in zip(trees, query_lens)]
    mask = padded_tree_mask(parents, width, seed)
    num_rows = [n if t is not None else 0 for t, n in zip(trees, query_lens)]
    starts = batch.query_start_loc.to(torch.int64)
    info = TreeAttentionInfo(
        tree_mask=mask, row_start=starts[1:] - torch.tensor(num_rows),
        num_rows=torch.tensor(num_rows), tree_reqs=[r for r, t in enumerate(trees) if t],
        all_rows_are_tree_rows=all(t is not None for t in trees))
    builder = mla_builder(budget=width - 1)
    common = common_metadata(query_lens, [p + n for p, n in zip(prefix_lens, query_lens)])
    common.block_table_tensor = batch.block_table
    with publishing(info):
        metadata = builder.build(0, common)
    num_tokens = metadata.num_decode_tokens
    assert num_tokens == sum(query_lens) and metadata.prefill is None
    q = (batch.q_absorbed[:num_tokens], batch.q_pe[:num_tokens])
    out, lse = mla_impl().forward_mqa(q, batch.kv_cache, metadata, layer=None)
    assert lse is None and out.shape == (num_tokens, DSV3.num_heads, DSV3.kv_lora_rank)
    return batch, out, info


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [1, 8, 31])
def test_every_branch_of_every_tree_matches_plain_mla(monkeypatch, dtype, budget):
    """A step of tree rows alone: vLLM's kernel never runs; every node equals plain
    MLA over its prefix plus its branch alone."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    calls = []
    monkeypatch.setattr(CPUMLAImpl, "forward_mqa", lambda *a: calls.append(1))
    rng = random.Random(budget)
    trees = [random_tree_parents(budget + 1, 7, rng) for _ in range(3)]
    query_lens = [budget + 1] * 3
    batch, out, _ = verify_step(trees, query_lens, [0, 21, 70], dtype, seed=budget)
    assert calls == []
    values, tol = project(batch, out), TOLERANCES[dtype]
    for r, parents in enumerate(trees):
        for node in range(len(parents)):
            expected, _ = expanded_branch_oracle(batch, r, parents, node)
            row = int(batch.query_start_loc[r]) + node
            torch.testing.assert_close(values[row], expected, atol=tol, rtol=tol)


def test_rows_outside_the_trees_take_vllms_kernel_causally():
    """Trees next to a decode without drafts and a short prompt counted as a decode:
    vLLM's one-query kernel runs every row (each listed as its own request) and the
    tree rows are then overwritten."""
    rng = random.Random(5)
    trees = [random_tree_parents(6, 7, rng), None, random_tree_parents(4, 7, rng), None]
    query_lens, prefix_lens = [6, 1, 4, 3], [21, 40, 17, 0]  # vLLM's order: prompt last
    batch, out, info = verify_step(trees, query_lens, prefix_lens, torch.float32, seed=5)
    causal, _ = mla_tree_attention(
        batch.q_absorbed, batch.q_pe, batch.kv_cache, batch.block_table, batch.seq_lens,
        batch.query_start_loc, None, DSV3.scale)
    tree_rows = set(info.rows.tolist())
    plain_rows = [i for i in range(out.shape[0]) if i not in tree_rows]
    assert plain_rows == [6, 11, 12, 13]
    torch.testing.assert_close(out[plain_rows], causal[plain_rows], atol=2e-5, rtol=2e-5)
    values = project(batch, out)
    for r, parents in enumerate(trees):
        for node in range(len(parents or [])):
            expected, _ = expanded_branch_oracle(batch, r, parents, node)
            row = int(batch.query_start_loc[r]) + node
            torch.testing.assert_close(values[row], expected, atol=2e-5, rtol=2e-5)


def test_a_step_without_a_tree_is_vllms_decode(monkeypatch):
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    metadata = SimpleNamespace(tree=None)
    monkeypatch.setattr(CPUMLAImpl, "forward_mqa", lambda self, q, cache, md, layer: "vllm")
    assert mla_impl().forward_mqa(None, None, metadata, None) == "vllm"


# ----------------------------------------------------------------------------------
# Compaction, registration, the start-up check
# ----------------------------------------------------------------------------------


def test_kv_moves_carry_whole_latent_rows_in_padded_pages():
    """Accepted nodes move into chain order (overlapping moves), in every layer; one
    cache is a view into wider pages, as a shared KV-cache group may pad them."""
    gen = torch.Generator().manual_seed(3)
    contiguous = torch.randn(6, PAGE, 576, generator=gen)
    padded = torch.randn(6, PAGE + 2, 576, generator=gen)[:, :PAGE]
    # Request 0 (root slot 17): path [0, 2, 3], so 19 -> 18 and 20 -> 19; request 1
    # (root slot 50): node 5 -> 51, and a padding move that repeats it.
    src = torch.tensor([[17, 19, 20], [50, 55, 55]])
    dst = torch.tensor([[17, 18, 19], [50, 51, 51]])
    expected = contiguous.clone()
    move_slots(expected.view(-1, 576), src.flatten(), dst.flatten())  # compaction's twin
    reference = padded.clone()  # the padded view cannot be flattened: slot by slot
    for s, d in zip(src.flatten().tolist(), dst.flatten().tolist(), strict=True):
        reference[d // PAGE, d % PAGE] = padded[s // PAGE, s % PAGE]
    cpu_mla.DDTreeCPUMLABackend.move_kv_slots_layers([contiguous, padded], src, dst)
    assert torch.equal(contiguous, expected)
    assert torch.equal(padded, reference)


def test_register_backends_for_cpu_points_cpu_mla_at_ddtree():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as Enum

    try:
        register_backends("cpu")
        backend = resolve_obj_by_qualname(Enum.CPU_MLA.get_path())
        assert backend is cpu_mla.DDTreeCPUMLABackend and backend.get_name() == "CPU_MLA"
        assert backend.get_impl_cls() is cpu_mla.DDTreeCPUMLAImpl
        assert resolve_obj_by_qualname(Enum.CPU_ATTN.get_path()) is cpu.DDTreeCPUAttentionBackend
    finally:
        for enum in (Enum.CPU_ATTN, Enum.CPU_MLA):
            enum.clear_override()


class CudaMLABackend:
    """An MLA backend DDTree lacks (a stand-in for vLLM's CUDA ones)."""

    @staticmethod
    def get_name() -> str:
        return "FLASHMLA"

    @staticmethod
    def is_mla() -> bool:
        return True


def test_start_up_accepts_cpu_mla_and_names_the_mla_backends_not_done():
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    check_tree_backends(fake_runner({"model.layers.0.self_attn.attn":
                                     cpu_mla.DDTreeCPUMLABackend}))
    for backend in (CudaMLABackend, CPUMLABackend):
        runner = fake_runner({"model.layers.0.self_attn.attn": backend})
        with pytest.raises(NotImplementedError) as error:
            check_tree_backends(runner)
        message = str(error.value)
        assert f"uses {backend.get_name()}, which has none" in message
        for name in ("CPU_MLA", "AMX_MLA", "FLASH_ATTN_MLA", "TRITON_MLA", "FLASHMLA"):
            assert name in message
