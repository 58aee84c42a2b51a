"""Compaction's KV moves for every layer of a cache group in one launch.

After the walk, each request's accepted nodes move from their verify slots to
chain slots (vllm_ddtree/compaction.py). Done layer by layer in torch that is
a gather and a scatter per layer, 72 launches for a 36-layer model, every
step; here it is one launch for all layers.

Torch twin: ``cuda.move_kv_slots`` applied to each layer (the CPU path and the
test oracle). The caches are vLLM's CUDA layout, ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` per layer, separately allocated but alike in
shape, strides and dtype; the kernel addresses layer i as the first layer's
pointer plus a fixed element offset, computed once per set of caches.

Ordering: one program per (layer, request) makes that request's moves in
depth order. The move into depth d reads the node accepted at depth d, whose
index is >= d, and later moves read nodes deeper still, so no move reads a
slot an earlier move of the same request wrote: in order, each move reads the
value from before the step, as the twin's gather-then-scatter does. Requests
own disjoint slots; identity moves rewrite a root slot with its own value.
Elements move as raw bits, so any 1-, 2- or 4-byte cache dtype (fp8 too) moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vllm_ddtree.sync import to_device
from vllm_ddtree.triton_device import triton_can_run

__all__ = ["move_kv_slots_triton", "triton_can_move"]

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # element size -> raw view
_offsets_cache: dict[tuple, torch.Tensor] = {}  # (device, element size, pointers) -> offsets


def triton_can_move(kv_caches: Sequence[torch.Tensor]) -> bool:
    """Whether the caches fit the kernel: alike, on CUDA, rows contiguous, and each
    an exact number of elements away from the first."""
    first = kv_caches[0]
    size = first.element_size()
    return (
        triton_can_run(first)
        and first.dim() == 4
        and first.stride(3) == 1
        and size in _RAW
        and all(
            c.shape == first.shape
            and c.stride() == first.stride()
            and c.dtype == first.dtype
            and c.device == first.device
            and (c.data_ptr() - first.data_ptr()) % size == 0
            for c in kv_caches
        )
    )


def move_kv_slots_triton(
    kv_caches: Sequence[torch.Tensor],  # per layer [num_blocks, num_kv_heads, block_size, 2 * head_size]
    src_slots: torch.Tensor,  # [num_reqs, width] int64, flat slot (block * block_size + offset)
    dst_slots: torch.Tensor,  # [num_reqs, width] int64; moves of a request in depth order
) -> None:
    """cache[dst] = old cache[src] for K and V of every head of every layer, in place."""
    if not triton_can_move(kv_caches):
        raise ValueError(
            "move_kv_slots_triton needs CUDA caches of one shape, stride and 1/2/4-byte "
            "dtype with contiguous rows"
        )
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 2:
        raise ValueError(
            f"src_slots and dst_slots must both be [num_reqs, width], got "
            f"{tuple(src_slots.shape)} and {tuple(dst_slots.shape)}"
        )
    num_reqs, width = src_slots.shape
    if num_reqs == 0 or width == 0:
        return
    first = kv_caches[0]
    _, num_kv_heads, page_size, row = first.shape
    raw = first.view(_RAW[first.element_size()])
    move_kv_slots_kernel[(len(kv_caches), num_reqs)](
        raw,
        _layer_offsets(kv_caches),
        src_slots.contiguous(),
        dst_slots.contiguous(),
        width,
        first.stride(0),
        first.stride(1),
        first.stride(2),
        PAGE_SIZE=page_size,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )


def _layer_offsets(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:  # [num_layers] int64
    """Element offset of each layer's cache from the first, on the caches' device.
    vLLM never moves a cache once allocated, so each set is computed once."""
    pointers = tuple(c.data_ptr() for c in kv_caches)
    size = kv_caches[0].element_size()
    key = (kv_caches[0].device, size, pointers)  # offsets count elements of this size
    offsets = _offsets_cache.get(key)
    if offsets is None:
        host = torch.tensor([(p - pointers[0]) // size for p in pointers], dtype=torch.int64)
        offsets = _offsets_cache[key] = to_device(host, kv_caches[0].device)
    return offsets


# ----------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["width"])
def move_kv_slots_kernel(
    cache_ptr,  # first layer's [num_blocks, num_kv_heads, PAGE_SIZE, ROW] as raw ints
    layer_offset_ptr,  # [num_layers] int64, elements from the first layer's cache
    src_slot_ptr,  # [num_reqs, width] int64
    dst_slot_ptr,  # [num_reqs, width] int64
    width,
    stride_block,
    stride_head,
    stride_slot,
    PAGE_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    ROW: tl.constexpr,  # 2 * head_size: K then V
    ROW_PAD: tl.constexpr,
):
    layer = tl.program_id(0)
    req = tl.program_id(1)
    cache = cache_ptr + tl.load(layer_offset_ptr + layer)
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, ROW_PAD)
    offs = heads[:, None].to(tl.int64) * stride_head + cols[None, :]  # one slot, every head
    ok = (heads < NUM_KV_HEADS)[:, None] & (cols < ROW)[None, :]
    for j in range(width):  # depth order: see the module docstring
        src = tl.load(src_slot_ptr + req.to(tl.int64) * width + j)
        dst = tl.load(dst_slot_ptr + req.to(tl.int64) * width + j)
        if src != dst:
            src_at = (src // PAGE_SIZE) * stride_block + (src % PAGE_SIZE) * stride_slot
            dst_at = (dst // PAGE_SIZE) * stride_block + (dst % PAGE_SIZE) * stride_slot
            values = tl.load(cache + src_at + offs, mask=ok)
            tl.store(cache + dst_at + offs, values, mask=ok)
