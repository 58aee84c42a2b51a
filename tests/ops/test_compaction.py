"""Compaction: accepted KV entries land at rows query_start + 0..k, nothing else changes."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_ddtree.ops.compaction import (
    apply_kv_moves,
    block_slot_moves,
    move_slots,
    plan_compaction,
    plan_slots,
)
from vllm_ddtree.ops.tree import build_ddtree
from vllm_ddtree.ops.walk import walk_tree
from vllm_ddtree.tensors import WalkResult


def random_walk(num_reqs: int, budget: int, max_depth: int, rng: random.Random) -> WalkResult:
    """Accepted paths of random length over distinct random nodes (any order, overlapping)."""
    rows, counts = [], []
    for _ in range(num_reqs):
        k = rng.randint(0, min(budget, max_depth))
        nodes = rng.sample(range(1, budget + 1), k)
        if rng.random() < 0.5:
            nodes.sort()  # DDTree trees (parents first) give increasing paths
        rows.append([0] + nodes + [-1] * (max_depth - k))
        counts.append(k)
    accepted = torch.tensor(rows, dtype=torch.int64)
    zeros = torch.zeros(num_reqs, dtype=torch.int64)
    out = torch.full((num_reqs, budget + 1), -1, dtype=torch.int64)  # only its width is used
    return WalkResult(accepted, torch.tensor(counts), zeros, out)


def setup(num_reqs: int, budget: int, pad_rows: int, block_size: int, gen: torch.Generator):
    """query_start_loc with a trailing padding request, a -1-padded slot mapping, and a
    fresh [2, num_blocks, block_size, heads, head_dim] KV cache."""
    n = budget + 1
    real = num_reqs * n
    starts = list(range(0, real + 1, n)) + [real + pad_rows]  # last request is padding
    num_blocks = (real + pad_rows) // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:real]
    slot_mapping = torch.cat([slots, torch.full((pad_rows,), -1)])
    kv = torch.randn(2, num_blocks, block_size, 2, 3, generator=gen)
    return torch.tensor(starts), slot_mapping, kv


def expected_cache(cache: torch.Tensor, slot_mapping, starts, walk: WalkResult) -> torch.Tensor:
    flat_old = cache.reshape(-1, *cache.shape[2:])
    want = flat_old.clone()
    for r in range(walk.accepted_nodes.shape[0]):
        for d in range(1, walk.num_accepted[r].item() + 1):
            node = walk.accepted_nodes[r, d].item()
            dst, src = slot_mapping[starts[r] + d], slot_mapping[starts[r] + node]
            want[dst] = flat_old[src]
    return want.view_as(cache)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("budget,max_depth", [(1, 3), (1, 7), (3, 7), (7, 7), (8, 7), (16, 15), (17, 15), (63, 15)])
def test_apply_kv_moves_compacts_accepted_path(budget: int, max_depth: int, block_size: int):
    rng, gen = random.Random(budget * max_depth), torch.Generator().manual_seed(budget + max_depth)
    for _ in range(5):
        num_reqs = rng.randint(1, 5)
        starts, slot_mapping, kv = setup(num_reqs, budget, pad_rows=5, block_size=block_size, gen=gen)
        walk = random_walk(num_reqs, budget, max_depth, rng)
        # The padding request: no accepted nodes, rows past the real tokens / slot -1.
        pad = random_walk(1, budget, max_depth, rng)
        walk = WalkResult(*(torch.cat([a, b]) for a, b in zip(vars(walk).values(), vars(pad).values())))
        walk.num_accepted[-1] = 0
        walk.accepted_nodes[-1, 1:] = -1
        want_k = expected_cache(kv[0], slot_mapping, starts, walk)
        want_v = expected_cache(kv[1], slot_mapping, starts, walk)
        plan = plan_compaction(walk, starts)
        # A row that receives a real move is no other entry's destination (scatter order
        # among duplicates is unspecified on GPU, so this cannot rest on the CPU result).
        dst = plan.dst_rows.flatten()
        moved = dst[plan.src_rows.flatten() != dst]
        assert (torch.bincount(dst)[moved] == 1).all()
        key_cache, value_cache = kv[0], kv[1]  # views into one allocation, as in vLLM
        apply_kv_moves(key_cache, value_cache, slot_mapping, plan)
        assert torch.equal(kv[0], want_k) and torch.equal(kv[1], want_v)


def test_plan_rows_and_identity_padding():
    walk = WalkResult(
        accepted_nodes=torch.tensor([[0, 2, 3, -1, -1], [0, -1, -1, -1, -1]]),
        num_accepted=torch.tensor([2, 0]),
        bonus_tokens=torch.zeros(2, dtype=torch.int64),
        output_tokens=torch.full((2, 4), -1),  # budget 3 < max_depth 4
    )
    plan = plan_compaction(walk, torch.tensor([0, 4, 8]))
    assert plan.src_rows.tolist() == [[0, 2, 3, 0, 0], [4, 4, 4, 4, 4]]  # past the path: root
    assert plan.dst_rows.tolist() == [[0, 1, 2, 0, 0], [4, 4, 4, 4, 4]]
    assert torch.equal(plan.hidden_rows, plan.src_rows)
    with pytest.raises(ValueError, match="query_start_loc"):
        plan_compaction(walk, torch.tensor([0, 4]))


def test_move_slots_other_layouts_and_all_padding():
    gen = torch.Generator().manual_seed(0)
    latent = torch.randn(6, 4, 5, generator=gen)  # MLA-style [num_blocks, block_size, dim]
    flat = latent.view(-1, 5)
    old = flat.clone()
    move_slots(flat, torch.tensor([7, 9, 3, 3]), torch.tensor([8, 7, 9, 3]))  # overlapping
    want = old.clone()
    want[8], want[7], want[9] = old[7], old[9], old[3]
    assert torch.equal(flat, want)

    fp8 = torch.randn(8, 3, generator=gen).to(torch.float8_e4m3fn)
    old8 = fp8.view(torch.uint8).clone()
    move_slots(fp8, torch.tensor([1, 2]), torch.tensor([2, 1]))  # swap
    assert torch.equal(fp8.view(torch.uint8)[[1, 2]], old8[[2, 1]])

    # Every row padding: nothing may move (the safe slot falls back to slot 0, identity).
    walk = random_walk(3, 7, 7, random.Random(1))
    src, dst = plan_slots(torch.full((24,), -1), plan_compaction(walk, torch.tensor([0, 8, 16, 24])))
    assert torch.equal(src, dst)


def test_end_to_end_with_real_tree_walk_and_hidden_gather():
    gen = torch.Generator().manual_seed(5)
    num_reqs, depth, vocab, budget = 4, 7, 6, 15
    tree = build_ddtree(torch.randn(num_reqs, depth, vocab, generator=gen).log_softmax(-1),
                        torch.randint(0, vocab, (num_reqs,), generator=gen), budget, topk_cap=2)
    # Every node's target is its first child's token: walks go as deep as the tree.
    target = torch.randint(0, vocab, (num_reqs, budget + 1), generator=gen)
    for r in range(num_reqs):
        for i in range(tree.num_nodes[r].item(), 0, -1):
            target[r, tree.parents[r, i]] = tree.tokens[r, i]
    walk = walk_tree(tree, target, depth)
    assert walk.num_accepted.min() >= 1
    starts, slot_mapping, kv = setup(num_reqs, budget, pad_rows=0, block_size=8, gen=gen)
    starts = starts[:-1]  # no padding request here
    want = expected_cache(kv[0], slot_mapping, starts, walk)
    plan = plan_compaction(walk, starts)
    apply_kv_moves(kv[0], kv[1], slot_mapping, plan)
    assert torch.equal(kv[0], want)

    hidden = torch.randn(num_reqs * (budget + 1), 3, generator=gen)
    path_hidden = hidden[plan.hidden_rows]  # [num_reqs, depth + 1, 3], root first
    for r in range(num_reqs):
        for d in range(walk.num_accepted[r].item() + 1):
            row = starts[r] + walk.accepted_nodes[r, d]
            assert torch.equal(path_hidden[r, d], hidden[row])


def test_block_slot_moves_split_flat_slots():
    moves = block_slot_moves(torch.tensor([0, 5, 17]), torch.tensor([3, 4, 16]), 4)
    assert moves.src_block.tolist() == [0, 1, 4] and moves.src_offset.tolist() == [0, 1, 1]
    assert moves.dst_block.tolist() == [0, 1, 4] and moves.dst_offset.tolist() == [3, 0, 0]


def test_cpu_backend_moves_k_and_v_in_its_layout():
    """CPU_ATTN keeps K transposed ([head_dim, page]) and V plain per (block, head)."""
    from vllm_ddtree.attention.cpu import DDTreeCPUAttentionBackend, split_kv_cache

    gen = torch.Generator().manual_seed(3)
    num_blocks, heads, page, head_dim = 5, 2, 4, 8
    kv_cache = torch.randn(num_blocks, heads, page, 2 * head_dim, generator=gen)
    before = [c.clone() for c in split_kv_cache(kv_cache)]  # [nb, page, heads, d] each
    src, dst = torch.tensor([2, 3, 9, 0]), torch.tensor([1, 2, 8, 0])  # overlapping + identity
    DDTreeCPUAttentionBackend.move_kv_slots(kv_cache, block_slot_moves(src, dst, page))
    for cache, old in zip(split_kv_cache(kv_cache), before, strict=True):
        expected = old.reshape(num_blocks * page, heads, head_dim).clone()
        move_slots(expected, src, dst)
        assert torch.equal(cache.reshape(num_blocks * page, heads, head_dim), expected)
