"""Compaction's KV moves for every layer of a cache group in one launch.

After the walk, each request's accepted nodes move from their verify slots to
chain slots (ops/compaction.py): the node accepted at depth d moves
from slot ``slot_mapping[row_start + node_d]`` to ``slot_mapping[row_start + d]``.
Done layer by layer in torch that is a plan of some twenty small operations,
then a gather and a scatter per layer, 72 launches for a 36-layer model, every
step; here the kernel reads the accepted nodes and the slot mapping itself, in
one launch for all layers.

Torch twin: ``compaction.plan_rows`` and ``compaction.plan_slots``, then
``cuda.move_kv_slots`` applied to each layer (the CPU path and the test oracle). The caches are vLLM's CUDA
layout, ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` per layer,
separately allocated but alike in shape, strides and dtype; the kernel
addresses layer i as the first layer's pointer plus a fixed element offset,
computed once per set of caches.

Moves the twin turns into identity moves are skipped: past the accepted path
(node -1), rows past the slot mapping, and slots of -1 (padding).

Ordering: one program per (layer, request) makes that request's moves in
depth order. The move into depth d reads the node accepted at depth d, whose
index is >= d, and later moves read nodes deeper still, so no move reads a
slot an earlier move of the same request wrote: in order, each move reads the
value from before the step, as the twin's gather-then-scatter does. Requests
own disjoint slots. Elements move as raw bits, so any 1-, 2- or 4-byte cache
dtype (fp8 too) moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.device import triton_can_run
from vllm_ddtree.sync import to_device

__all__ = ["RAW_DTYPES", "compact_kv_triton", "element_offsets", "move_request_kv",
           "triton_can_move"]

RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # element size -> raw view
_offsets_cache: dict[tuple, torch.Tensor] = {}  # (device, element size, pointers) -> offsets
_OFFSETS_CACHE_SIZE = 256  # sets of tensors remembered (KV caches never move; others may)
# id(list) -> (the list, triton_can_move's answer): the runner passes the same
# list of caches every step; the entry keeps the list alive, so its id stays its own.
_can_move_memo: dict[int, tuple[Sequence[torch.Tensor], bool]] = {}


def triton_can_move(kv_caches: Sequence[torch.Tensor]) -> bool:
    """Whether the caches fit the kernel: alike, on CUDA, rows contiguous, and each
    an exact number of elements away from the first. Remembered per list object
    (a list of caches passed again is not re-checked: callers must not mutate it)."""
    memo = _can_move_memo.get(id(kv_caches))
    if memo is not None and memo[0] is kv_caches:
        return memo[1]
    answer = _check_can_move(kv_caches)
    if isinstance(kv_caches, list):
        _can_move_memo[id(kv_caches)] = (kv_caches, answer)
    return answer


def _check_can_move(kv_caches: Sequence[torch.Tensor]) -> bool:
    first = kv_caches[0]
    size = first.element_size()
    return (
        triton_can_run(first)
        and first.dim() == 4
        and first.stride(3) == 1
        and size in RAW_DTYPES
        and all(
            c.shape == first.shape
            and c.stride() == first.stride()
            and c.dtype == first.dtype
            and c.device == first.device
            and (c.data_ptr() - first.data_ptr()) % size == 0
            for c in kv_caches
        )
    )


def compact_kv_triton(
    kv_caches: Sequence[torch.Tensor],  # per layer [num_blocks, num_kv_heads, block_size, 2 * head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] flat slot of each verify row, -1 = padding
    accepted_nodes: torch.Tensor,  # [num_reqs, max_depth + 1] int64, -1 past the path
    row_start: torch.Tensor,  # [num_reqs] int64, flat row of each root
) -> None:
    """cache[slot of row_start + d] = old cache[slot of row_start + node_d] for K and V of
    every head of every layer, in place, for each depth d >= 1 on the accepted path."""
    if not triton_can_move(kv_caches):
        raise ValueError(
            "compact_kv_triton needs CUDA caches of one shape, stride and 1/2/4-byte "
            "dtype with contiguous rows"
        )
    if accepted_nodes.dim() != 2 or row_start.shape != accepted_nodes.shape[:1]:
        raise ValueError(
            f"accepted_nodes must be [num_reqs, max_depth + 1] and row_start [num_reqs], got "
            f"{tuple(accepted_nodes.shape)} and {tuple(row_start.shape)}"
        )
    num_reqs, width = accepted_nodes.shape
    if num_reqs == 0 or width < 2:
        return
    first = kv_caches[0]
    _, num_kv_heads, page_size, row = first.shape
    raw = first.view(RAW_DTYPES[first.element_size()])
    compact_kv_kernel[(len(kv_caches), num_reqs)](
        raw,
        element_offsets(kv_caches),
        slot_mapping,
        accepted_nodes.contiguous(),
        row_start.contiguous(),
        slot_mapping.shape[0],
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


def element_offsets(tensors: Sequence[torch.Tensor]) -> torch.Tensor:  # [num_tensors] int64
    """Element offset of each tensor's storage from the first's, on their device, so a
    kernel reaches tensor i as the first's pointer plus offset i. Tensors of one
    dtype; remembered per set of addresses (vLLM never moves a KV cache; hidden
    states come from a few addresses), up to _OFFSETS_CACHE_SIZE sets; later sets
    are made anew each call. Entries are never dropped: a launch captured in a CUDA
    graph (the V2 runner's step graphs) reads its offsets from them at every replay."""
    pointers = tuple(t.data_ptr() for t in tensors)
    size = tensors[0].element_size()
    key = (tensors[0].device, size, pointers)  # offsets count elements of this size
    offsets = _offsets_cache.get(key)
    if offsets is None:
        if any((p - pointers[0]) % size for p in pointers):
            raise ValueError("tensors must lie a whole number of elements apart")
        if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
            # A graph would copy from a host buffer freed after the capture.
            raise RuntimeError("element offsets of tensors met for the first time while "
                               "a CUDA graph is captured")
        host = torch.tensor([(p - pointers[0]) // size for p in pointers], dtype=torch.int64)
        offsets = to_device(host, tensors[0].device)
        if len(_offsets_cache) < _OFFSETS_CACHE_SIZE:  # never evicted: graphs may read them
            _offsets_cache[key] = offsets
    return offsets


# ----------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_tokens", "width"])
def compact_kv_kernel(
    cache_ptr,  # first layer's [num_blocks, num_kv_heads, PAGE_SIZE, ROW] as raw ints
    layer_offset_ptr,  # [num_layers] int64, elements from the first layer's cache
    slot_ptr,  # [num_tokens] flat slot of each row, -1 = padding
    accepted_ptr,  # [num_reqs, width] int64, node accepted at each depth, -1 past the path
    row_start_ptr,  # [num_reqs] int64
    num_tokens,
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
    req = tl.program_id(1).to(tl.int64)
    move_request_kv(cache_ptr + tl.load(layer_offset_ptr + layer), slot_ptr,
                    accepted_ptr + req * width, tl.load(row_start_ptr + req), num_tokens, width,
                    stride_block, stride_head, stride_slot, PAGE_SIZE, NUM_KV_HEADS, HEADS_PAD,
                    ROW, ROW_PAD)


@triton.jit
def move_request_kv(
    cache,  # one layer's cache as raw ints
    slot_ptr,  # [num_tokens] flat slot of each row, -1 = padding
    path,  # [width] int64, the request's node accepted at each depth, -1 past the path
    start,  # int64, the request's root row
    num_tokens,
    width,
    stride_block,
    stride_head,
    stride_slot,
    PAGE_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    """One request's KV moves in one layer, in depth order (module docstring); also
    called by compact_step_triton's one-launch kernel."""
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, ROW_PAD)
    offs = heads[:, None].to(tl.int64) * stride_head + cols[None, :]  # one slot, every head
    ok = (heads < NUM_KV_HEADS)[:, None] & (cols < ROW)[None, :]
    for d in range(1, width):  # depth order: see the module docstring
        node = tl.load(path + d)
        src_row = start + node
        dst_row = start + d
        if (node >= 0) & (src_row < num_tokens) & (dst_row < num_tokens):
            src = tl.load(slot_ptr + src_row).to(tl.int64)
            dst = tl.load(slot_ptr + dst_row).to(tl.int64)
            if (src >= 0) & (dst >= 0) & (src != dst):
                src_at = (src // PAGE_SIZE) * stride_block + (src % PAGE_SIZE) * stride_slot
                dst_at = (dst // PAGE_SIZE) * stride_block + (dst % PAGE_SIZE) * stride_slot
                values = tl.load(cache + src_at + offs, mask=ok)
                tl.store(cache + dst_at + offs, values, mask=ok)
