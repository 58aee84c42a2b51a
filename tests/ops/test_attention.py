"""Tests for vllm_ddtree/ops/attention.py (the CPU backend's batched verify
rows) against the per-request torch reference and the per-branch causal oracle of
test_attention_reference. Caches hold NaN wherever no request owns a slot, and block
tables point at foreign blocks past each request's pages: padded key positions must
never leak into a row."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tests.ops.test_attention_reference import (
    assert_matches_branch_oracle,
    make_paged_batch,
    padded_tree_mask,
    random_tree_parents,
    run_reference,
)
from vllm_ddtree.ops.attention import (
    plan_tree_attention_torch,
    run_tree_attention_torch,
    tree_attention_torch,
)
from vllm_ddtree.tensors import pack_tree_mask

SCALE = 0.37
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def run_batched(batch, tree_mask, **kwargs) -> torch.Tensor:
    return tree_attention_torch(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.seq_lens, batch.query_start_loc, tree_mask, SCALE, **kwargs,
    )


def random_case(budgets, prefix_lens, heads, dtype=torch.float32, seed=0, **options):
    rng = random.Random(seed)
    trees = [random_tree_parents(b + 1, 15, rng) for b in budgets]
    batch = make_paged_batch([len(t) for t in trees], prefix_lens, heads, dtype, seed,
                             **options)
    return trees, batch, padded_tree_mask(trees, max(len(t) for t in trees) + 3, seed)


@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (6, 3)])
@pytest.mark.parametrize("budget", [1, 7, 16, 63])
def test_matches_reference_and_branch_oracle(budget: int, heads):
    # Mixed widths (a plain decode row among trees), an empty prefix, a long one.
    budgets = [budget, 0, max(1, budget // 2), budget]
    trees, batch, mask = random_case(budgets, [0, 40, 5, 300], heads, seed=budget)
    out = run_batched(batch, mask)
    torch.testing.assert_close(out, run_reference(batch, mask), atol=1e-5, rtol=1e-5)
    assert_matches_branch_oracle(batch, trees, out)
    total = int(batch.query_start_loc[-1])
    assert out[total:].eq(0).all()  # padding rows


def test_chunks_give_the_same_rows():
    """Requests split into chunks (a score budget of one request at a time, then
    two) give exactly the rows of one chunk."""
    _, batch, mask = random_case([16, 3, 16, 9, 1], [17, 90, 0, 33, 200], (8, 2), seed=5)
    whole = run_batched(batch, mask)
    for max_scores in (1, 8 * 17 * 230 * 2):
        torch.testing.assert_close(run_batched(batch, mask, max_scores=max_scores), whole,
                                   atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_mask_causal_rows_and_strided_caches(dtype: torch.dtype):
    _, batch, mask = random_case([15, 4], [21, 64], (8, 2), dtype, seed=7,
                                 flash_layout=True, page_size=8)
    expected = run_reference(batch, mask)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(run_batched(batch, pack_tree_mask(mask)), expected,
                               atol=tol, rtol=tol)
    torch.testing.assert_close(run_batched(batch, None), run_reference(batch, None),
                               atol=tol, rtol=tol)


def test_no_requests_and_requests_without_rows():
    _, batch, mask = random_case([4, 2], [10, 3], (4, 4), seed=9)
    batch.query_start_loc[2] = batch.query_start_loc[1]  # request 1 sends no rows
    out = run_batched(batch, mask)
    torch.testing.assert_close(out, run_reference(batch, mask), atol=1e-5, rtol=1e-5)
    empty = tree_attention_torch(batch.query, batch.key_cache, batch.value_cache,
                                 batch.block_table[:0], batch.seq_lens[:0],
                                 batch.query_start_loc[:1], None, SCALE)
    assert empty.eq(0).all()


def test_one_plan_serves_every_layer():
    """A step's plan (made from its metadata alone) runs each layer's own queries and
    caches: every output equals that layer's reference."""
    _, first, mask = random_case([16, 5], [30, 7], (8, 2), seed=11)
    gen = torch.Generator().manual_seed(12)

    def fresh(t: torch.Tensor) -> torch.Tensor:  # new values, NaN where no request owns
        return torch.where(t.isnan(), t, torch.randn(t.shape, generator=gen))

    second = dataclasses.replace(first, query=torch.randn(first.query.shape, generator=gen),
                                 key_cache=fresh(first.key_cache),
                                 value_cache=fresh(first.value_cache))
    plan = plan_tree_attention_torch(first.block_table, first.seq_lens,
                                     first.query_start_loc, mask, 8, first.key_cache.shape[1])
    for batch in (first, second):
        out = run_tree_attention_torch(plan, batch.query, batch.key_cache,
                                       batch.value_cache, SCALE)
        torch.testing.assert_close(out, run_reference(batch, mask), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------
# The CPU backend around it: vLLM's kernel runs only for rows outside the trees
# ----------------------------------------------------------------------------------


def cpu_backend_step(query_lens: list[int], tree_rows: list[int], monkeypatch):
    """One layer of DDTreeCPUAttentionImpl over requests with ``query_lens`` rows, of
    which the last ``tree_rows[r]`` verify a causal tree (0: no tree). vLLM's kernel is
    a stub that writes 7.0 and counts its calls. Returns (output, calls, reference of
    the tree rows, flat tree rows)."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_ddtree.attention.cpu import DDTreeCPUAttentionImpl, split_kv_cache
    from vllm_ddtree.attention.state import TreeAttentionInfo
    from vllm_ddtree.ops.attention_reference import tree_attention_reference

    calls = []

    def parent_forward(self, layer, query, key, value, kv_cache, metadata, output, *a):
        calls.append(metadata.num_actual_tokens)
        return output.fill_(7.0)

    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", parent_forward)
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, page, prefix = 4, 2, 8, 4, 9
    num_reqs = len(query_lens)
    seq_lens = torch.tensor([prefix + n for n in query_lens], dtype=torch.int32)
    pages = -(-int(seq_lens.max()) // page)
    block_table = torch.arange(num_reqs * pages, dtype=torch.int32).view(num_reqs, pages)
    kv_cache = torch.randn(num_reqs * pages, kv_heads, page, 2 * head_dim, generator=gen)
    total = sum(query_lens)
    query = torch.randn(total, heads, head_dim, generator=gen)
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    width = max(max(tree_rows), 1)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    tree = TreeAttentionInfo(
        tree_mask=causal.expand(num_reqs, width, width).contiguous(),
        row_start=starts[1:] - torch.tensor(tree_rows),
        num_rows=torch.tensor(tree_rows),
        tree_reqs=[r for r, n in enumerate(tree_rows) if n],
        all_rows_are_tree_rows=tree_rows == query_lens,
    )
    tree.prepare_for(torch.device("cpu"))
    impl = object.__new__(DDTreeCPUAttentionImpl)
    impl.num_heads, impl.head_size, impl.scale = heads, head_dim, 0.3
    metadata = SimpleNamespace(tree=tree, num_actual_tokens=total, block_table=block_table,
                               seq_lens=seq_lens)
    output = torch.zeros(total, heads * head_dim)
    impl.forward(SimpleNamespace(isa="vec"), query, None, None, kv_cache, metadata, output)
    # The tree rows of each request alone, as the reference sees them.
    reqs = tree.tree_reqs
    rows = tree.rows
    key_cache, value_cache = split_kv_cache(kv_cache)
    tree_seq = seq_lens[reqs] - torch.tensor(query_lens)[reqs] + torch.tensor(tree_rows)[reqs]
    reference = tree_attention_reference(
        query[rows], key_cache, value_cache, block_table[reqs], tree_seq.to(torch.int32),
        tree.rows_query_start_loc, tree.tree_mask[reqs], 0.3,
    )
    return output.view(total, heads, head_dim), calls, reference, rows


def test_cpu_backend_skips_vllms_kernel_when_every_row_is_a_tree_row(monkeypatch):
    output, calls, reference, rows = cpu_backend_step([5, 3], [5, 3], monkeypatch)
    assert calls == []  # the tree pass writes every row
    torch.testing.assert_close(output[rows], reference, atol=1e-5, rtol=1e-5)


def test_cpu_backend_runs_vllms_kernel_for_rows_outside_the_trees(monkeypatch):
    # A prefill chunk of 6 rows next to a tree of 4 rows: only the tree's are redone.
    output, calls, reference, rows = cpu_backend_step([6, 4], [0, 4], monkeypatch)
    assert calls == [10]
    assert output[:6].eq(7.0).all()
    torch.testing.assert_close(output[rows], reference, atol=1e-5, rtol=1e-5)
