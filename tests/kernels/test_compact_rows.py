"""Compaction's row moves and position fix, and the verify step's tree positions
(vllm_ddtree/ops/compaction.py): the torch paths against a plain Python oracle, and the Triton kernels of
vllm_ddtree/kernels/compact_rows.py against those torch twins, bit for bit.

Paths come as DDTree's trees give them (increasing nodes: parents first), with a
request whose rows end the batch, one that accepts nothing, and rows past every
request (padding). Tensors: hidden states of several widths and dtypes (some
sharing a launch), 1-D token ids, a strided view. The kernels run on CUDA, or on
the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.test_kv_move import tree_order_walk
from tests.triton_utils import DEVICE, needs_cuda, needs_kernel
from vllm_ddtree.ops.compaction import compact_rows, restore_chain_positions
from vllm_ddtree.ops.step_trees import tree_positions

PAD_ROWS = 3


def batch(num_reqs: int, budget: int, max_depth: int, seed: int):
    """(accepted nodes, row starts, sent nodes per request, number of rows)."""
    rng = random.Random(seed)
    walk = tree_order_walk(num_reqs, budget, max_depth, rng)
    walk.accepted_nodes[0, 1:] = -1  # request 0 accepts nothing
    num_scheduled = torch.tensor([rng.randint(0, budget) for _ in range(num_reqs)])
    for r in range(num_reqs):  # a path only uses nodes that were sent
        k = int((walk.accepted_nodes[r, 1:] >= 0).sum())
        if k:
            num_scheduled[r] = max(int(num_scheduled[r]), int(walk.accepted_nodes[r, k]))
    row_start = torch.cat([torch.zeros(1, dtype=torch.int64),
                           (num_scheduled + 1).cumsum(0)[:-1]])
    num_rows = int((num_scheduled + 1).sum()) + PAD_ROWS
    return walk.accepted_nodes, row_start, num_scheduled, num_rows


def oracle_rows(t: torch.Tensor, accepted, row_start) -> torch.Tensor:
    want = t.clone()
    for r in range(accepted.shape[0]):
        for d in range(1, accepted.shape[1]):
            node = int(accepted[r, d])
            if node >= 0:
                want[int(row_start[r]) + d] = t[int(row_start[r]) + node]
    return want


def make_tensors(num_rows: int, gen: torch.Generator) -> list[torch.Tensor]:
    wide = torch.randn(num_rows, 40, generator=gen)
    return [
        torch.randn(num_rows, 24, generator=gen).to(torch.bfloat16),  # hidden states
        torch.randn(num_rows, 24, generator=gen).to(torch.bfloat16),  # aux: same launch
        torch.randn(num_rows, 3000, generator=gen).to(torch.bfloat16),  # rows > one block
        torch.randint(0, 50_000, (num_rows,), generator=gen, dtype=torch.int32),  # token ids
        wide[:, :16],  # a strided view (contiguous rows)
    ]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("budget,max_depth", [(1, 3), (7, 7), (16, 15), (63, 15)])
def test_torch_rows_and_positions_match_the_oracle(budget, max_depth):
    gen = torch.Generator().manual_seed(budget)
    accepted, row_start, num_scheduled, num_rows = batch(5, budget, max_depth, budget)
    tensors = make_tensors(num_rows, gen)
    want = [oracle_rows(t, accepted, row_start) for t in tensors]
    compact_rows(tensors, accepted, row_start, use_triton=False)
    for got, expected in zip(tensors, want, strict=True):
        assert torch.equal(bits(got.cpu()), bits(expected))

    # Positions as the verify step set them: root + depth of each sent node.
    depths = torch.randint(1, max_depth + 1, (num_rows,), generator=gen)
    roots = torch.randint(0, 10_000, (5,), generator=gen)
    positions = torch.full((num_rows,), -5, dtype=torch.int64)
    expected = positions.clone()
    for r in range(5):
        s = int(row_start[r])
        positions[s] = expected[s] = roots[r]
        for i in range(1, int(num_scheduled[r]) + 1):
            positions[s + i] = roots[r] + depths[s + i]
            expected[s + i] = roots[r] + i
    restore_chain_positions(positions, row_start, num_scheduled, budget + 1, use_triton=False)
    assert torch.equal(positions, expected)


@needs_kernel
@pytest.mark.parametrize("budget,max_depth", [(1, 3), (7, 7), (16, 15), (17, 15), (63, 15)])
def test_kernels_match_the_torch_twins(budget, max_depth):
    gen = torch.Generator().manual_seed(100 + budget)
    for seed in range(3):
        accepted, row_start, num_scheduled, num_rows = batch(4, budget, max_depth, seed)
        tensors = [t.to(DEVICE) for t in make_tensors(num_rows, gen)]
        expected = [t.clone() for t in tensors]
        compact_rows(expected, accepted.to(DEVICE), row_start.to(DEVICE), use_triton=False)
        compact_rows(tensors, accepted.to(DEVICE), row_start.to(DEVICE), use_triton=True)
        for got, want in zip(tensors, expected, strict=True):
            assert torch.equal(bits(got.cpu()), bits(want.cpu()))

        positions = torch.randint(0, 10_000, (num_rows,), generator=gen).to(DEVICE)
        want_positions = positions.clone()
        args = (row_start.to(DEVICE), num_scheduled.to(DEVICE), budget + 1)
        restore_chain_positions(want_positions, *args, use_triton=False)
        restore_chain_positions(positions, *args, use_triton=True)
        assert torch.equal(positions.cpu(), want_positions.cpu())


@needs_kernel
def test_bad_shapes_are_refused():
    accepted = torch.tensor([[0, 2, 3]], device=DEVICE)
    with pytest.raises(ValueError, match="row_start"):
        compact_rows([torch.zeros(4, 2, device=DEVICE)], accepted,
                     torch.tensor([0, 1], device=DEVICE), use_triton=True)
    with pytest.raises(ValueError, match="num_scheduled"):
        restore_chain_positions(torch.zeros(4, dtype=torch.int64, device=DEVICE),
                                torch.tensor([0], device=DEVICE),
                                torch.tensor([1, 2], device=DEVICE), 3, use_triton=True)


@needs_cuda
def test_no_host_sync_and_graph_replay():
    """Captured once, the launches replay new paths and positions correctly, and
    nothing makes the host wait."""
    gen = torch.Generator().manual_seed(3)
    accepted, row_start, num_scheduled, num_rows = batch(4, 16, 15, 0)
    tensors = [t.to(DEVICE) for t in make_tensors(num_rows, gen)]
    positions = torch.randint(0, 10_000, (num_rows,), generator=gen).to(DEVICE)
    static = [accepted.to(DEVICE), row_start.to(DEVICE), num_scheduled.to(DEVICE)]
    compact_rows(tensors, static[0], static[1])  # compile outside the checks
    restore_chain_positions(positions, static[1], static[2], 17)
    torch.cuda.set_sync_debug_mode("error")
    try:
        compact_rows(tensors, static[0], static[1])
        restore_chain_positions(positions, static[1], static[2], 17)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compact_rows(tensors, static[0], static[1])
        restore_chain_positions(positions, static[1], static[2], 17)
    new = batch(4, 16, 15, 1)
    new_accepted = new[0].clone()
    for r in range(4):  # keep the captured row starts: cut paths to each request's rows
        limit = int(num_scheduled[r])
        new_accepted[r, 1:][new_accepted[r, 1:] > limit] = -1
        cut = (new_accepted[r, 1:] < 0).nonzero()
        if len(cut):
            new_accepted[r, 1 + int(cut[0]):] = -1
    static[0].copy_(new_accepted)
    expected = [t.clone() for t in tensors]
    compact_rows(expected, static[0], static[1], use_triton=False)
    want_positions = positions.clone()
    restore_chain_positions(want_positions, static[1], static[2], 17, use_triton=False)
    graph.replay()
    for got, want in zip(tensors, expected, strict=True):
        assert torch.equal(bits(got), bits(want))
    assert torch.equal(positions, want_positions)


def verify_batch(seed: int, width: int):
    """A verify step's query offsets (a prefill request in front, so tree rows end
    their requests' rows), sent nodes, node depths and vLLM's chain positions."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = 4
    num_scheduled = torch.randint(0, width, (num_reqs,), generator=gen)
    num_scheduled[1] = 0  # a request without drafts
    extra = torch.randint(0, 5, (num_reqs,), generator=gen)  # rows before the tree rows
    query_lens = num_scheduled + 1 + extra
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)])
    depths = torch.randint(1, width, (num_reqs, width), generator=gen)
    depths[:, 0] = 0
    num_rows = int(query_start_loc[-1]) + PAD_ROWS
    positions = torch.randint(0, 1000, (num_rows,), generator=gen)
    return query_start_loc.to(torch.int32), num_scheduled, depths, positions


@pytest.mark.parametrize("width", [2, 5, 17, 65])
def test_tree_positions_match_the_oracle(width):
    query_start_loc, num_scheduled, depths, positions = verify_batch(width, width)
    expected = positions.clone()
    want_start = []
    for r in range(num_scheduled.shape[0]):
        start = int(query_start_loc[r + 1]) - int(num_scheduled[r]) - 1
        want_start.append(start)
        for i in range(1, int(num_scheduled[r]) + 1):
            expected[start + i] = positions[start + i] - i + depths[r, i]
    row_start = tree_positions(positions, query_start_loc, num_scheduled, depths)
    assert row_start.tolist() == want_start
    assert torch.equal(positions, expected)
    # ...and compaction's restore puts them back in chain order: root + i.
    restore_chain_positions(positions, row_start, num_scheduled, width, use_triton=False)
    for r, start in enumerate(want_start):
        n = int(num_scheduled[r])
        assert positions[start : start + n + 1].tolist() == [
            int(positions[start]) + i for i in range(n + 1)]
