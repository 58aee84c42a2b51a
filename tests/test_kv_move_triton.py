"""vllm_ddtree/attention/kv_move_triton.py against its torch twin, cuda.move_kv_slots.

Moves come from real compaction plans: sorted accepted paths (as DDTree's depth-major
trees give), padding rows with slot -1 and a padding request, over several separately
allocated layers in vLLM's CUDA cache layout, odd head counts and row widths, and every
cache dtype width. Every bit must match the twin, untouched slots included. Run on the
CPU through Triton's interpreter with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.test_compaction import setup
from tests.triton_utils import DEVICE, needs_cuda, needs_kernel
from vllm_ddtree.attention import cuda
from vllm_ddtree.attention.kv_move_triton import move_kv_slots_triton, triton_can_move
from vllm_ddtree.compaction import block_slot_moves, plan_compaction, plan_slots
from vllm_ddtree.verify import WalkResult

pytestmark = [pytest.mark.gpu, needs_kernel]


def depth_major_walk(num_reqs: int, budget: int, max_depth: int, rng: random.Random) -> WalkResult:
    """Accepted paths as a depth-major tree gives them: increasing node indices."""
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
        walk = depth_major_walk(num_reqs + 1, budget, max_depth, rng)
        walk.accepted_nodes[-1, 1:] = -1  # the padding request accepts nothing
        walk.num_accepted[-1] = 0
        plan = plan_compaction(walk, starts)
        src, dst = plan_slots(slot_mapping, plan)
        src, dst = src.view(num_reqs + 1, -1), dst.view(num_reqs + 1, -1)
        num_blocks = int(slot_mapping.max()) // page + 2
        caches = make_caches(3, num_blocks, heads, page, 2 * head_dim, dtype, gen)
        expected = [c.cpu().clone() for c in caches]
        moves = block_slot_moves(src.flatten(), dst.flatten(), page)
        for cache in expected:
            cuda.move_kv_slots(cache, moves)
        assert triton_can_move(caches)
        move_kv_slots_triton(caches, src.to(DEVICE), dst.to(DEVICE))
        for got, want in zip(caches, expected, strict=True):
            assert torch.equal(bits(got), bits(want))


def test_dispatch_takes_the_kernel_for_alike_caches_only():
    gen = torch.Generator().manual_seed(0)
    caches = make_caches(2, 4, 2, 4, 8, torch.bfloat16, gen)
    assert triton_can_move(caches)
    assert not triton_can_move([caches[0], caches[1][:, :, :2]])  # another shape
    assert not triton_can_move([caches[0], caches[1].float()])  # another dtype
    src = torch.tensor([[0, 2, 3]], device=DEVICE)
    dst = torch.tensor([[0, 1, 2]], device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        move_kv_slots_triton([caches[0], caches[1].float()], src, dst)
    with pytest.raises(ValueError, match=r"\[num_reqs, width\]"):
        move_kv_slots_triton(caches, src.flatten(), dst.flatten())


@needs_cuda
def test_no_host_sync_and_graph_replay():
    """One launch, no host sync, and a captured launch replays new moves correctly."""
    gen = torch.Generator().manual_seed(7)
    caches = make_caches(4, 40, 8, 16, 256, torch.bfloat16, gen)
    src = torch.tensor([[0, 5, 9, 0], [32, 40, 41, 44]], device=DEVICE)
    dst = torch.tensor([[0, 1, 2, 0], [32, 33, 34, 35]], device=DEVICE)
    move_kv_slots_triton(caches, src, dst)  # compile outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        move_kv_slots_triton(caches, src, dst)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_src, static_dst = src.clone(), dst.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        move_kv_slots_triton(caches, static_src, static_dst)
    static_src.copy_(torch.tensor([[0, 3, 4, 0], [32, 34, 37, 38]]))
    static_dst.copy_(torch.tensor([[0, 1, 2, 0], [32, 33, 34, 35]]))
    expected = [c.clone() for c in caches]
    moves = block_slot_moves(static_src.flatten(), static_dst.flatten(), 16)
    for cache in expected:
        cuda.move_kv_slots(cache, moves)
    graph.replay()
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(bits(got), bits(want))


def test_caches_reused_at_the_same_addresses_with_another_dtype():
    """Layer offsets count elements: caches of another element size at the same
    addresses (freed memory handed out again) must not reuse cached offsets."""
    gen = torch.Generator().manual_seed(11)
    shape, spacing = (4, 2, 4, 8), 4096  # bytes between layers: room for any dtype here
    buffer = torch.zeros(3 * spacing, dtype=torch.uint8, device=DEVICE)
    src = torch.tensor([[0, 2, 3], [8, 10, 8]], device=DEVICE)
    dst = torch.tensor([[0, 1, 2], [8, 9, 8]], device=DEVICE)
    for dtype in (torch.bfloat16, torch.float32):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        caches = [buffer[i * spacing : i * spacing + nbytes].view(dtype).view(shape)
                  for i in (1, 0, 2)]  # the first layer in the middle: offsets of both signs
        for cache in caches:
            cache.copy_(torch.randn(shape, generator=gen).to(dtype))
        expected = [c.cpu().clone() for c in caches]
        moves = block_slot_moves(src.flatten().cpu(), dst.flatten().cpu(), shape[2])
        for cache in expected:
            cuda.move_kv_slots(cache, moves)
        move_kv_slots_triton(caches, src, dst)
        for got, want in zip(caches, expected, strict=True):
            assert torch.equal(bits(got), bits(want))
