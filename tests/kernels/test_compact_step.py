"""vllm_ddtree/kernels/compact_step.py (the whole compaction in one launch) against its
torch twins: cuda.move_kv_slots layer by layer after the compaction plan, compact_rows
and restore_chain_positions on their torch paths, bit for bit, untouched memory
included.

Paths come as DDTree's trees give them (increasing nodes), with a request that accepts
nothing, a padding request, padding rows of slot -1 and rows past every request; the
states span more than one block per row; caches of every dtype width, odd head counts;
with and without KV caches (layouts the launch does not move leave them to their own
path). Runs on CUDA, or on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_compact_rows import batch, bits
from tests.kernels.test_kv_move import make_caches, twin
from tests.triton_utils import DEVICE, needs_cuda, needs_kernel
from vllm_ddtree.kernels.compact_step import compact_step_triton, rows_alike
from vllm_ddtree.ops.compaction import compact_rows, restore_chain_positions

pytestmark = [pytest.mark.gpu, needs_kernel]


def step_inputs(budget: int, max_depth: int, seed: int, hidden: int, gen: torch.Generator):
    """A verify step: paths, row starts, sent nodes, a slot mapping with padding rows,
    hidden + two aux states, token ids and positions (longer than the step's rows, as
    vLLM's persistent buffers are)."""
    accepted, row_start, num_scheduled, num_rows = batch(4, budget, max_depth, seed)
    slots = torch.randperm(num_rows * 3, generator=gen)[:num_rows]
    slots[-2:] = -1  # padding rows
    states = [torch.randn(num_rows, hidden, generator=gen).to(torch.bfloat16) for _ in range(3)]
    ids = torch.randint(0, 50_000, (num_rows + 5,), generator=gen, dtype=torch.int32)
    positions = torch.randint(0, 10_000, (num_rows + 5,), generator=gen)
    return accepted, row_start, num_scheduled, slots, states, ids, positions


def expected_after(caches, slots, states, ids, positions, accepted, row_start, num_scheduled,
                   width):
    kv = twin(caches, slots, accepted, row_start) if caches else []
    rows = [t.cpu().clone() for t in (*states, ids)]
    compact_rows(rows, accepted, row_start, use_triton=False)
    pos = positions.cpu().clone()
    restore_chain_positions(pos, row_start, num_scheduled, width, use_triton=False)
    return kv, rows, pos


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("budget,max_depth,heads,head_dim,page,hidden", [
    (1, 3, 1, 4, 4, 8),
    (7, 7, 2, 8, 4, 24),
    (16, 15, 3, 12, 16, 3000),  # odd heads; state rows longer than one block
    (63, 15, 2, 8, 8, 40),
])
def test_one_launch_matches_the_twins(dtype, budget, max_depth, heads, head_dim, page, hidden):
    gen = torch.Generator().manual_seed(budget * 7 + hidden)
    width = budget + 1
    for seed in range(3):
        accepted, row_start, num_scheduled, slots, states, ids, positions = step_inputs(
            budget, max_depth, seed, hidden, gen)
        num_blocks = int(slots.max()) // page + 2
        caches = make_caches(3, num_blocks, heads, page, 2 * head_dim, dtype, gen)
        want_kv, want_rows, want_pos = expected_after(
            caches, slots, states, ids, positions, accepted, row_start, num_scheduled, width)
        on = [t.to(DEVICE) for t in (*states, ids, positions)]
        compact_step_triton(caches, slots.to(DEVICE), on[:3], on[3], on[4],
                            accepted.to(DEVICE), row_start.to(DEVICE),
                            num_scheduled.to(DEVICE), width)
        for got, want in zip(caches, want_kv, strict=True):
            assert torch.equal(bits(got.cpu()), bits(want))
        for got, want in zip(on[:4], want_rows, strict=True):
            assert torch.equal(bits(got.cpu()), bits(want))
        assert torch.equal(on[4].cpu(), want_pos)


def test_without_caches_the_rest_still_moves():
    gen = torch.Generator().manual_seed(5)
    accepted, row_start, num_scheduled, _, states, ids, positions = step_inputs(16, 15, 1, 24, gen)
    _, want_rows, want_pos = expected_after(
        None, None, states, ids, positions, accepted, row_start, num_scheduled, 17)
    on = [t.to(DEVICE) for t in (*states, ids, positions)]
    compact_step_triton(None, None, on[:3], on[3], on[4], accepted.to(DEVICE),
                        row_start.to(DEVICE), num_scheduled.to(DEVICE), 17)
    for got, want in zip(on[:4], want_rows, strict=True):
        assert torch.equal(bits(got.cpu()), bits(want))
    assert torch.equal(on[4].cpu(), want_pos)


def test_layouts_it_does_not_take_are_refused():
    gen = torch.Generator().manual_seed(2)
    states = [torch.randn(6, 8, generator=gen).to(DEVICE) for _ in range(2)]
    wide = torch.randn(6, 16, generator=gen).to(DEVICE)
    assert rows_alike(states)
    assert not rows_alike([states[0], wide])  # another row length
    assert not rows_alike([states[0], wide[:, ::2]])  # strided columns
    assert not rows_alike([states[0], states[1].bfloat16()])  # another dtype
    ids = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    positions = torch.zeros(6, dtype=torch.int64, device=DEVICE)
    accepted = torch.tensor([[0, 2, 3]], device=DEVICE)
    one = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="alike"):
        compact_step_triton(None, None, [states[0], wide], ids, positions, accepted, one,
                            torch.tensor([3], device=DEVICE), 4)
    with pytest.raises(ValueError, match="num_reqs"):
        compact_step_triton(None, None, states, ids, positions, accepted, one,
                            torch.tensor([3, 3], device=DEVICE), 4)
    caches = make_caches(2, 4, 2, 4, 8, torch.bfloat16, gen)
    with pytest.raises(ValueError, match="slot mapping"):
        compact_step_triton([caches[0], caches[1].float()], torch.arange(6, device=DEVICE),
                            states, ids, positions, accepted, one,
                            torch.tensor([3], device=DEVICE), 4)


@needs_cuda
def test_no_host_sync_and_graph_replay():
    """One launch, no host sync; captured, it replays new paths correctly."""
    gen = torch.Generator().manual_seed(9)
    accepted, row_start, num_scheduled, slots, states, ids, positions = step_inputs(16, 15, 0, 64,
                                                                                    gen)
    caches = make_caches(4, int(slots.max()) // 16 + 2, 8, 16, 256, torch.bfloat16, gen)
    on = [t.to(DEVICE) for t in (*states, ids, positions)]
    static = [accepted.to(DEVICE), row_start.to(DEVICE), num_scheduled.to(DEVICE)]
    slots = slots.to(DEVICE)

    def launch():
        compact_step_triton(caches, slots, on[:3], on[3], on[4], *static, 17)

    launch()  # compile outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        launch()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    new = batch(4, 16, 15, 1)[0]
    for r in range(4):  # paths inside each request's captured rows
        limit = int(num_scheduled[r])
        row = new[r, 1:]
        cut = ((row > limit) | (row < 0)).nonzero()
        if len(cut):
            row[int(cut[0]):] = -1
    static[0].copy_(new)
    want_kv, want_rows, want_pos = expected_after(
        caches, slots.cpu(), on[:3], on[3], on[4], new, row_start, num_scheduled, 17)
    graph.replay()
    for got, want in zip(caches, want_kv, strict=True):
        assert torch.equal(bits(got.cpu()), bits(want))
    for got, want in zip(on[:4], want_rows, strict=True):
        assert torch.equal(bits(got.cpu()), bits(want))
    assert torch.equal(on[4].cpu(), want_pos)
