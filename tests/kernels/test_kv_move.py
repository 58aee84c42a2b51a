"""vllm_ddtree/kernels/kv_move.py against its torch twin: the compaction plan
(plan_rows, plan_slots) and cuda.move_kv_slots layer by layer.

Moves come from accepted paths as DDTree's trees give them (increasing
nodes), with padding rows of slot -1 and a padding request, over several separately
allocated layers in vLLM's CUDA cache layout, odd head counts and row widths, and every
cache dtype width. Every bit must match the twin, untouched slots included. Run on the
CPU through Triton's interpreter with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.ops.test_compaction import setup
from tests.triton_utils import DEVICE, needs_cuda, needs_kernel
from vllm_ddtree.attention import cuda
from vllm_ddtree.kernels import kv_move as kv_move_triton
from vllm_ddtree.kernels.kv_move import compact_kv_triton, triton_can_move
from vllm_ddtree.ops.compaction import block_slot_moves, plan_rows, plan_slots
from vllm_ddtree.tensors import WalkResult

pytestmark = [pytest.mark.gpu, needs_kernel]


def tree_order_walk(num_reqs: int, budget: int, max_depth: int, rng: random.Random) -> WalkResult:
    """Accepted paths as a DDTree tree gives them (parents first): increasing node indices."""
    rows, counts = [], []
    for _ in range(num_reqs):
        k = rng.randint(0, min(budget, max_depth))
        nodes = sorted(rng.sample(range(1, budget + 1), k))
        rows.append([0] + nodes + [-1] * (max_depth - k))
        counts.append(k)
    zeros = torch.zeros(num_reqs, dtype=torch.int64)
    out = torch.full((num_reqs, budget + 1), -1, dtype=torch.int64)
    return WalkResult(torch.tensor(rows), torch.tensor(counts), zeros, out)


def make_caches(num_layers, num_blocks, heads, page, row, dtype, gen):
    """Separately allocated caches, with gaps between them, like vLLM's per-layer tensors."""
    caches, gaps = [], []
    for _ in range(num_layers):
        gaps.append(torch.empty(int(torch.randint(1, 999, (1,), generator=gen)), device=DEVICE))
        data = torch.randn(num_blocks, heads, page, row, generator=gen)
        caches.append(data.to(dtype).to(DEVICE))
    return caches


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn])
@pytest.mark.parametrize("budget,max_depth,heads,head_dim,page", [
    (1, 3, 1, 4, 4),
    (7, 7, 2, 8, 4),
    (16, 15, 3, 12, 16),  # odd heads and rows: padded tiles
    (63, 15, 2, 8, 8),
])
def test_kernel_matches_the_layer_by_layer_twin(dtype, budget, max_depth, heads, head_dim, page):
    rng = random.Random(budget * 31 + heads)
    gen = torch.Generator().manual_seed(budget + head_dim)
    for _ in range(3):
        num_reqs = rng.randint(1, 4)
        starts, slot_mapping, _ = setup(num_reqs, budget, pad_rows=3, block_size=page, gen=gen)
        walk = tree_order_walk(num_reqs + 1, budget, max_depth, rng)
        walk.accepted_nodes[-1, 1:] = -1  # the padding request accepts nothing
        walk.num_accepted[-1] = 0
        row_start = starts[:-1]
        src, dst = plan_slots(slot_mapping, plan_rows(walk.accepted_nodes, row_start))
        num_blocks = int(slot_mapping.max()) // page + 2
        caches = make_caches(3, num_blocks, heads, page, 2 * head_dim, dtype, gen)
        expected = [c.cpu().clone() for c in caches]
        moves = block_slot_moves(src, dst, page)
        for cache in expected:
            cuda.move_kv_slots(cache, moves)
        assert triton_can_move(caches)
        compact_kv_triton(caches, slot_mapping.to(DEVICE), walk.accepted_nodes.to(DEVICE),
                          row_start.to(DEVICE))
        for got, want in zip(caches, expected, strict=True):
            assert torch.equal(bits(got), bits(want))


def test_dispatch_takes_the_kernel_for_alike_caches_only():
    gen = torch.Generator().manual_seed(0)
    caches = make_caches(2, 4, 2, 4, 8, torch.bfloat16, gen)
    assert triton_can_move(caches)
    assert not triton_can_move([caches[0], caches[1][:, :, :2]])  # another shape
    assert not triton_can_move([caches[0], caches[1].float()])  # another dtype
    slots = torch.arange(8, device=DEVICE)
    accepted = torch.tensor([[0, 2, 3]], device=DEVICE)
    start = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        compact_kv_triton([caches[0], caches[1].float()], slots, accepted, start)
    with pytest.raises(ValueError, match=r"\[num_reqs, max_depth \+ 1\]"):
        compact_kv_triton(caches, slots, accepted.flatten(), start)


def test_the_check_is_remembered_per_list_of_caches():
    """The runner passes one list of caches every step: checked once, then remembered
    for that list object only."""
    gen = torch.Generator().manual_seed(1)
    caches = make_caches(2, 4, 2, 4, 8, torch.bfloat16, gen)
    assert triton_can_move(caches)
    caches.append(caches[0].float())  # callers must not do this; shows the memo is used
    assert triton_can_move(caches)
    assert not triton_can_move(list(caches))  # another list: checked afresh


def twin(caches, slot_mapping, accepted, row_start):
    """The torch path: the plan, then cuda.move_kv_slots layer by layer (on copies)."""
    src, dst = plan_slots(slot_mapping.cpu(), plan_rows(accepted.cpu(), row_start.cpu()))
    moves = block_slot_moves(src, dst, caches[0].shape[2])
    expected = [c.cpu().clone() for c in caches]
    for cache in expected:
        cuda.move_kv_slots(cache, moves)
    return expected


# Two requests of four verify rows (roots at rows 0 and 4) and their slots.
SLOTS = [0, 5, 9, 11, 32, 40, 41, 44]


@needs_cuda
def test_no_host_sync_and_graph_replay():
    """One launch, no host sync, and a captured launch replays new paths correctly."""
    gen = torch.Generator().manual_seed(7)
    caches = make_caches(4, 40, 8, 16, 256, torch.bfloat16, gen)
    slot_mapping = torch.tensor(SLOTS, device=DEVICE)
    row_start = torch.tensor([0, 4], device=DEVICE)
    accepted = torch.tensor([[0, 2, 3, -1], [0, 1, 3, -1]], device=DEVICE)
    compact_kv_triton(caches, slot_mapping, accepted, row_start)  # compile outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        compact_kv_triton(caches, slot_mapping, accepted, row_start)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = accepted.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compact_kv_triton(caches, slot_mapping, static, row_start)
    static.copy_(torch.tensor([[0, 1, 2, 3], [0, 3, -1, -1]]))
    expected = twin(caches, slot_mapping, static, row_start)
    graph.replay()
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(bits(got), bits(want))


def test_caches_reused_at_the_same_addresses_with_another_dtype():
    """Layer offsets count elements: caches of another element size at the same
    addresses (freed memory handed out again) must not reuse cached offsets."""
    gen = torch.Generator().manual_seed(11)
    shape, spacing = (12, 2, 4, 8), 4096 * 4  # bytes between layers: room for any dtype here
    buffer = torch.zeros(3 * spacing, dtype=torch.uint8, device=DEVICE)
    slot_mapping = torch.tensor(SLOTS, device=DEVICE)
    row_start = torch.tensor([0, 4], device=DEVICE)
    accepted = torch.tensor([[0, 2, 3, -1], [0, 2, -1, -1]], device=DEVICE)
    for dtype in (torch.bfloat16, torch.float32):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        caches = [buffer[i * spacing : i * spacing + nbytes].view(dtype).view(shape)
                  for i in (1, 0, 2)]  # the first layer in the middle: offsets of both signs
        for cache in caches:
            cache.copy_(torch.randn(shape, generator=gen).to(dtype))
        expected = twin(caches, slot_mapping, accepted, row_start)
        compact_kv_triton(caches, slot_mapping, accepted, row_start)
        for got, want in zip(caches, expected, strict=True):
            assert torch.equal(bits(got), bits(want))


def test_element_offsets_are_remembered_and_never_dropped(monkeypatch):
    """A launch captured in a CUDA graph reads its offsets tensor at every replay, so a
    remembered entry is never dropped; past the cache's size offsets are made anew."""
    monkeypatch.setattr(kv_move_triton, "_offsets_cache", {})
    monkeypatch.setattr(kv_move_triton, "_OFFSETS_CACHE_SIZE", 2)
    base = torch.zeros(64, dtype=torch.float32)
    sets = [[base[0:4], base[8 * i + 8 : 8 * i + 12]] for i in range(3)]
    first = [kv_move_triton.element_offsets(s) for s in sets]
    assert [f.tolist() for f in first] == [[0, 8], [0, 16], [0, 24]]
    again = [kv_move_triton.element_offsets(s) for s in sets]
    assert again[0] is first[0] and again[1] is first[1]  # remembered
    assert again[2] is not first[2] and again[2].tolist() == [0, 24]  # past the size: anew
