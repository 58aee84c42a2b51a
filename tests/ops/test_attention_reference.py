"""Tests for vllm_ddtree/ops/attention_reference.py.

The oracle is independent of the code under test: for every tree node it runs plain
attention (``F.scaled_dot_product_attention``) over the request's contiguous prefix plus
that node's root-to-node branch alone. Trees are random and built here, so no other
project module is involved. Unused cache slots hold NaN: reading one poisons the output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from vllm_ddtree.ops.attention_reference import (
    tree_attention_reference,
    write_kv_to_cache,
)
from vllm_ddtree.tensors import pack_tree_mask, unpack_tree_mask

BUDGETS = [1, 3, 7, 8, 15, 16, 17, 31, 63]
BLOCK_SIZES = [4, 8, 16]  # drafter block sizes: they only bound tree depth here
HEAD_LAYOUTS = [(8, 2), (4, 4)]  # (num_heads, num_kv_heads): GQA and MHA
HEAD_DIM = 16
PAGE_SIZE = 16  # KV-cache block size, unrelated to the drafter block size
SCALE = 0.37
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def random_tree_parents(
    num_nodes: int, max_depth: int, rng: random.Random
) -> list[int]:
    """parents[0] = -1 (root); node i's parent is uniform among earlier nodes that
    are shallower than ``max_depth``, so the tree depth never exceeds it."""
    parents, depths = [-1], [0]
    for node in range(1, num_nodes):
        parent = rng.choice([j for j in range(node) if depths[j] < max_depth])
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return parents


def root_to_node(parents: list[int], node: int) -> list[int]:
    """Node indices on the branch from the root down to ``node``, both included."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def ancestor_matrix(parents: list[int]) -> torch.Tensor:  # [n, n] bool
    """[i, j] is True iff node j is an ancestor of node i or i itself."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for node in range(n):
        mask[node, root_to_node(parents, node)] = True
    return mask


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens + padding, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, page_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    # Per request, contiguous: [seq_len, num_kv_heads, head_dim] each.
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prefix_lens: list[int]


def make_paged_batch(
    query_lens: list[int],
    prefix_lens: list[int],
    heads: tuple[int, int],
    dtype: torch.dtype,
    seed: int,
    page_size: int = PAGE_SIZE,
    flash_layout: bool = False,
) -> PagedBatch:
    """Random K/V, written through shuffled non-contiguous blocks into NaN caches.

    ``flash_layout`` allocates vLLM's per-layer ``[num_blocks, num_kv_heads, page_size,
    2 * head_dim]`` tensor and splits it as the FlashAttention backend does, so the
    caches are strided views.
    """
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    seq_lens = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    pages = [-(-s // page_size) for s in seq_lens]
    num_blocks = sum(pages) + 3  # spare blocks stay NaN
    physical = torch.randperm(num_blocks, generator=gen)
    max_pages = max(pages) + 2
    # Columns past a request's pages point at real (foreign or spare) blocks.
    block_table = torch.randint(
        0, num_blocks, (len(seq_lens), max_pages), generator=gen
    )
    first = 0
    for r, count in enumerate(pages):
        block_table[r, :count] = physical[first : first + count]
        first += count
    if flash_layout:
        shape = (num_blocks, num_kv_heads, page_size, 2 * HEAD_DIM)
        kv_cache = torch.full(shape, float("nan"), dtype=dtype)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_DIM, dim=-1)
        assert not key_cache.is_contiguous()
    else:
        shape = (num_blocks, page_size, num_kv_heads, HEAD_DIM)
        key_cache = torch.full(shape, float("nan"), dtype=dtype)
        value_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys, values = [], []
    for r, seq_len in enumerate(seq_lens):
        k, v = torch.randn(2, seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        positions = torch.arange(seq_len)
        slots = (
            block_table[r, positions // page_size] * page_size + positions % page_size
        )
        write_kv_to_cache(k, v, key_cache, value_cache, slots)
        keys.append(k)
        values.append(v)
    total = sum(query_lens)
    query = torch.randn(total + 2, num_heads, HEAD_DIM, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    return PagedBatch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=query_start_loc,
        keys=keys,
        values=values,
        prefix_lens=prefix_lens,
    )


def padded_tree_mask(
    trees: list[list[int]], width: int, seed: int
) -> torch.Tensor:  # [num_reqs, width, width] bool
    """Ancestor matrices, padded to ``width`` with random garbage (to be ignored)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(len(trees), width, width, generator=gen) < 0.5
    for r, parents in enumerate(trees):
        n = len(parents)
        mask[r, :n, :n] = ancestor_matrix(parents)
    return mask


def read_from_cache(
    cache: torch.Tensor, block_table_row: torch.Tensor, positions: list[int]
) -> torch.Tensor:  # [len(positions), num_kv_heads, head_dim]
    """Independent paged read: slot arithmetic on the flattened cache."""
    page_size = cache.shape[1]
    slots = [
        int(block_table_row[p // page_size]) * page_size + p % page_size
        for p in positions
    ]
    return cache.flatten(0, 1)[slots]


def branch_oracle(
    batch: PagedBatch, r: int, parents: list[int], node: int
) -> torch.Tensor:  # [num_heads, head_dim] float32
    """Causal attention over prefix + root-to-node branch; the node is the last token,
    so it attends to every token of that sequence."""
    prefix_len = batch.prefix_lens[r]
    branch = [prefix_len + j for j in root_to_node(parents, node)]
    table = batch.block_table[r]
    key = torch.cat(
        [batch.keys[r][:prefix_len], read_from_cache(batch.key_cache, table, branch)]
    )
    value = torch.cat(
        [
            batch.values[r][:prefix_len],
            read_from_cache(batch.value_cache, table, branch),
        ]
    )
    q = batch.query[int(batch.query_start_loc[r]) + node]  # [num_heads, head_dim]
    out = F.scaled_dot_product_attention(
        q.float()[:, None],  # [num_heads, 1, head_dim]
        key.float().transpose(0, 1),  # [num_kv_heads, seq, head_dim]
        value.float().transpose(0, 1),
        scale=SCALE,
        enable_gqa=True,
    )
    return out[:, 0]


def causal_oracle(batch: PagedBatch, r: int, num_queries: int) -> torch.Tensor:
    """Bottom-right causal attention of the last ``num_queries`` tokens."""
    seq_len = batch.prefix_lens[r] + num_queries
    first = int(batch.query_start_loc[r])
    q = batch.query[first : first + num_queries].float().transpose(0, 1)
    rows = torch.arange(num_queries)[:, None] + batch.prefix_lens[r]
    mask = torch.arange(seq_len)[None, :] <= rows  # [num_queries, seq_len]
    out = F.scaled_dot_product_attention(
        q,
        batch.keys[r].float().transpose(0, 1),
        batch.values[r].float().transpose(0, 1),
        attn_mask=mask,
        scale=SCALE,
        enable_gqa=True,
    )
    return out.transpose(0, 1)  # [num_queries, num_heads, head_dim]


def run_reference(batch: PagedBatch, tree_mask: torch.Tensor | None) -> torch.Tensor:
    return tree_attention_reference(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        tree_mask,
        SCALE,
    )


def assert_matches_branch_oracle(
    batch: PagedBatch, trees: list[list[int]], out: torch.Tensor
) -> None:
    """Every node's output row equals its branch oracle; padding rows stay zero."""
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    tol = TOLERANCES[out.dtype]
    for r, parents in enumerate(trees):
        first = int(batch.query_start_loc[r])
        for node in range(len(parents)):
            expected = branch_oracle(batch, r, parents, node)
            torch.testing.assert_close(
                out[first + node].float(), expected, atol=tol, rtol=tol
            )
    num_queries = sum(len(parents) for parents in trees)
    assert torch.all(out[num_queries:] == 0), "padding query rows must stay zero"


def check_random_trees(
    budgets: list[int],
    prefix_lens: list[int],
    block_size: int,
    heads: tuple[int, int],
    dtype: torch.dtype,
    seed: int,
    **batch_options,
) -> None:
    """Random trees of depth <= block_size - 1, one per request, against the oracle."""
    rng = random.Random(seed)
    trees = [random_tree_parents(b + 1, block_size - 1, rng) for b in budgets]
    query_lens = [len(t) for t in trees]
    batch = make_paged_batch(
        query_lens, prefix_lens, heads, dtype, seed, **batch_options
    )
    # The mask is wider than the widest request: its padding must be ignored.
    tree_mask = padded_tree_mask(trees, max(query_lens) + 3, seed)
    assert_matches_branch_oracle(batch, trees, run_reference(batch, tree_mask))


@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("budget", BUDGETS)
def test_every_branch_matches_causal_oracle(budget: int, block_size: int, heads):
    # Prefix 0 exercises a request whose only context is its own tree.
    seed = budget * 31 + block_size
    check_random_trees([budget] * 3, [0, 5, 37], block_size, heads, torch.float32, seed)


@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_bfloat16_matches_float32_oracle(budget: int, heads):
    check_random_trees([budget] * 2, [0, 23], 8, heads, torch.bfloat16, seed=budget)


@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
def test_mixed_budgets_pad_the_mask(heads):
    # Budget 0 is a plain decode row (root only); the widest request sizes the mask.
    budgets = [16, 0, 7, 63, 1, 17]
    check_random_trees(budgets, [3, 0, 50, 0, 16, 9], 16, heads, torch.float32, 7)


@pytest.mark.parametrize("page_size", [1, 3, 5, 32])
def test_page_sizes(page_size: int):
    check_random_trees(
        [8, 15], [11, 30], 8, (8, 2), torch.float32, page_size, page_size=page_size
    )


@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
def test_no_tree_mask_is_causal(heads):
    # Decode rows (1 query), a prefill chunk with no prefix, a request with no query
    # this step, and a longer chunk.
    query_lens, prefix_lens = [1, 5, 0, 17, 3], [0, 0, 4, 2, 30]
    batch = make_paged_batch(query_lens, prefix_lens, heads, torch.float32, seed=11)
    out = run_reference(batch, None)
    for r, n in enumerate(query_lens):
        first = int(batch.query_start_loc[r])
        if n == 0:
            continue
        torch.testing.assert_close(
            out[first : first + n], causal_oracle(batch, r, n), atol=1e-5, rtol=1e-5
        )


def test_chain_tree_equals_causal():
    query_lens = [4, 9]
    batch = make_paged_batch(query_lens, [6, 0], (8, 2), torch.float32, seed=5)
    chains = [list(range(-1, n - 1)) for n in query_lens]
    torch.testing.assert_close(
        run_reference(batch, padded_tree_mask(chains, 9, 1)), run_reference(batch, None)
    )


def test_packed_mask_input_matches_bool():
    rng = random.Random(2)
    trees = [random_tree_parents(b + 1, 15, rng) for b in (40, 3)]
    batch = make_paged_batch([41, 4], [7, 19], (4, 4), torch.float32, seed=2)
    mask = padded_tree_mask(trees, 41, 2)
    torch.testing.assert_close(
        run_reference(batch, pack_tree_mask(mask)), run_reference(batch, mask)
    )


@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
def test_flash_attention_strided_cache_views(heads):
    # write_kv_to_cache and the reference must both go through the strided views.
    check_random_trees(
        [16, 7], [0, 12], 4, heads, torch.float32, seed=4, flash_layout=True
    )


@pytest.mark.parametrize("max_q", [1, 2, 8, 17, 31, 32, 33, 64, 65, 100])
def test_pack_unpack_round_trip(max_q: int):
    gen = torch.Generator().manual_seed(max_q)
    mask = torch.rand(3, max_q, max_q, generator=gen) < 0.5
    packed = pack_tree_mask(mask)
    assert packed.dtype == torch.int32
    assert packed.shape == (3, max_q, -(-max_q // 32))
    assert torch.equal(unpack_tree_mask(packed), mask)


def test_pack_bit_order():
    # Column j is bit j % 32 of word j // 32; bit 31 is the int32 sign bit.
    for column in [0, 1, 5, 30, 31, 32, 33, 63, 64]:
        mask = torch.zeros(1, 1, 65, dtype=torch.bool)
        mask[0, 0, column] = True
        words = pack_tree_mask(mask)[0, 0].tolist()
        expected = [0, 0, 0]
        bit = 1 << (column % 32)
        expected[column // 32] = bit - 2**32 if bit == 2**31 else bit
        assert words == expected, column


def test_write_kv_to_cache_skips_negative_slots():
    key_cache = torch.zeros(3, 4, 2, HEAD_DIM)
    value_cache = torch.zeros(3, 4, 2, HEAD_DIM)
    key, value = torch.randn(2, 5, 2, HEAD_DIM)  # 5 tokens, the last one is padding
    write_kv_to_cache(key, value, key_cache, value_cache, torch.tensor([9, -1, 0, 6]))
    written = {(2, 1): 0, (0, 0): 2, (1, 2): 3}  # (block, offset) -> token
    for (block, offset), token in written.items():
        assert torch.equal(key_cache[block, offset], key[token])
        assert torch.equal(value_cache[block, offset], value[token])
    assert int((key_cache != 0).any(dim=(-1, -2)).sum()) == len(written)


def test_mask_sized_by_block_size_is_rejected():
    # The SGLang bug: a mask sized by the drafter block size (8) for budget 16,
    # which sends 17 verify queries.
    batch = make_paged_batch([17], [4], (8, 2), torch.float32, seed=0)
    with pytest.raises(ValueError, match="budget \\+ 1"):
        run_reference(batch, torch.ones(1, 8, 8, dtype=torch.bool).tril())


def test_mask_without_self_attention_is_rejected():
    batch = make_paged_batch([3], [4], (8, 2), torch.float32, seed=0)
    mask = torch.ones(1, 3, 3, dtype=torch.bool).tril()
    mask[0, 2, 2] = False
    with pytest.raises(ValueError, match="diagonal"):
        run_reference(batch, mask)
