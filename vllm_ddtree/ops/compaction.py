"""Post-walk compaction: make a DDTree step look like a chain step with k accepted drafts.

Request r's verify rows are query_start + i for tree node i (the root at i = 0). The node
accepted at depth d already sits at RoPE position start + d, so compaction only moves its
KV entry from row query_start + node_d to row query_start + d (1 <= d <= k) and gathers the
accepted hidden states in path order. No re-rotation is needed.

Why identity moves never collide with real ones: real destinations of request r are rows
query_start + 1 .. query_start + k with k <= min(budget, max_depth), all inside r's own
rows. Entries past the path (d > k) are identity moves on row query_start, the root: it
never moves, is never a destination, and lies inside r's rows even when r was sent fewer
nodes than other requests of the batch. Rows of different requests are disjoint, and
slot_mapping is injective on real rows, so every slot that is written twice receives its
own unchanged value both times.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_ddtree.tensors import CompactionPlan, SlotMoves, WalkResult


def plan_compaction(
    walk: WalkResult,
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
) -> CompactionPlan:
    """Verify-token rows to move: accepted node at depth d -> row query_start + d."""
    num_reqs = walk.accepted_nodes.shape[0]
    if query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"query_start_loc must be [num_reqs + 1] = [{num_reqs + 1}], "
            f"got {tuple(query_start_loc.shape)}"
        )
    return plan_rows(walk.accepted_nodes, query_start_loc[:-1])


def plan_rows(
    accepted_nodes: torch.Tensor,  # [num_reqs, max_depth + 1], -1 past the path
    row_start: torch.Tensor,  # [num_reqs] flat row of each root
) -> CompactionPlan:
    """plan_compaction from the accepted nodes and each request's root row."""
    width = accepted_nodes.shape[1]
    start = row_start.to(torch.int64)[:, None]  # [num_reqs, 1]
    d = torch.arange(width, device=start.device)
    node = accepted_nodes
    # Past the path: identity moves on the root row, which never moves and is
    # never a destination, and always lies inside the request's own rows.
    src = torch.where(node >= 0, start + node, start)
    dst = torch.where(node >= 0, start + d, start)
    return CompactionPlan(src_rows=src, dst_rows=dst, hidden_rows=src)


def compact_rows(
    tensors: list[torch.Tensor],  # each [num_rows, ...]: hidden states, token ids
    accepted_nodes: torch.Tensor,  # [num_reqs, max_depth + 1], -1 past the path
    row_start: torch.Tensor,  # [num_reqs] int64
    *,
    use_triton: bool | None = None,  # None: the Triton kernel on CUDA, else torch
) -> None:
    """Row row_start + d of every tensor takes row row_start + node_d (the node accepted
    at depth d), in place: the accepted path's per-row values in chain order."""
    if use_triton is None:
        use_triton = accepted_nodes.is_cuda
    if use_triton:
        from vllm_ddtree.kernels.compact_rows import compact_rows_triton

        compact_rows_triton(tensors, accepted_nodes, row_start)
        return
    plan = plan_rows(accepted_nodes, row_start)
    src, dst = plan.hidden_rows.flatten(), plan.dst_rows.flatten()
    for t in tensors:
        t.index_copy_(0, dst, t.index_select(0, src))


def restore_chain_positions(
    positions: torch.Tensor,  # [num_rows] the step's positions: root + depth at node rows
    row_start: torch.Tensor,  # [num_reqs] int64
    num_scheduled: torch.Tensor,  # [num_reqs] int64, tree nodes sent per request
    width: int,  # > every num_scheduled: the step's verify width
    *,
    use_triton: bool | None = None,  # None: the Triton kernel on CUDA, else torch
) -> None:
    """Positions back in chain order, in place: row row_start + i (0 < i <= num_scheduled)
    sits at the root's position + i, as vLLM's next step expects of a chain."""
    if use_triton is None:
        use_triton = positions.is_cuda
    if use_triton:
        from vllm_ddtree.kernels.compact_rows import restore_chain_positions_triton

        restore_chain_positions_triton(positions, row_start, num_scheduled, width)
        return
    node = torch.arange(width, device=positions.device)
    present = node[None, :] <= num_scheduled[:, None]
    rows = torch.where(present, row_start[:, None] + node[None, :], row_start[:, None])
    root = positions[row_start][:, None]
    positions[rows.flatten()] = torch.where(present, root + node, root).flatten().to(positions.dtype)


def apply_kv_moves(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; verify row -> block * block_size + offset, -1 = padding
    plan: CompactionPlan,
) -> None:
    """Move the accepted nodes' K and V entries into prefix order, in place."""
    src, dst = plan_slots(slot_mapping, plan)
    for cache in (key_cache, value_cache):
        # view (not reshape): a copy would silently drop the writes.
        move_slots(cache.view(-1, *cache.shape[2:]), src, dst)


def plan_slots(
    slot_mapping: torch.Tensor,  # [num_tokens]
    plan: CompactionPlan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (src_slots, dst_slots) for move_slots; moves touching a -1 slot (or a row past
    num_tokens) become identity moves on a slot that is never a real destination."""
    num_tokens = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)

    def lookup(rows: torch.Tensor) -> torch.Tensor:
        inside = rows < num_tokens
        return torch.where(inside, slots[rows.clamp(max=num_tokens - 1)], -1)

    src, dst = lookup(plan.src_rows.flatten()), lookup(plan.dst_rows.flatten())
    # Largest root slot: a real root if any request is real (roots never move), else slot 0
    # with nothing else moving.
    safe = lookup(plan.dst_rows[:, 0]).max().clamp(min=0)
    ok = (src >= 0) & (dst >= 0)
    return torch.where(ok, src, safe), torch.where(ok, dst, safe)


def block_slot_moves(
    src_slots: torch.Tensor,  # [num_moves] int64, from plan_slots
    dst_slots: torch.Tensor,  # [num_moves] int64
    block_size: int,
) -> SlotMoves:
    """Flat slots (block * block_size + offset) as (block, offset) pairs."""
    return SlotMoves(
        src_block=src_slots // block_size,
        src_offset=src_slots % block_size,
        dst_block=dst_slots // block_size,
        dst_offset=dst_slots % block_size,
    )


def move_slots_per_layer(
    move: Callable[[torch.Tensor, SlotMoves], None],  # one layer's in-place move
    kv_caches: list[torch.Tensor],  # a cache group's layers, one layout
    src_slots: torch.Tensor,  # [num_reqs, width] int64 flat slots
    dst_slots: torch.Tensor,  # [num_reqs, width] int64
    block_size: int,
) -> None:
    """Compaction's KV moves for every layer of a cache group: the (block, offset) pairs
    made once, then ``move`` per layer."""
    moves = block_slot_moves(src_slots.flatten(), dst_slots.flatten(), block_size)
    for kv_cache in kv_caches:
        move(kv_cache, moves)


def move_slots(
    cache_flat: torch.Tensor,  # [num_slots, ...] any per-slot layout
    src_slots: torch.Tensor,  # [num_moves] int64, >= 0
    dst_slots: torch.Tensor,  # [num_moves] int64, >= 0
) -> None:
    """cache[dst_i] = old cache[src_i] for all i, in place. Gathers every source before any
    write, so overlapping moves (path [0, 2, 3]: 2 -> 1 and 3 -> 2) are safe. A slot listed
    twice in dst_slots must receive the same value each time (e.g. identity moves)."""
    if cache_flat.dtype.itemsize == 1 and cache_flat.is_floating_point():
        cache_flat = cache_flat.view(torch.uint8)  # fp8: move raw bytes
    moved = cache_flat.index_select(0, src_slots)  # gather all sources first ...
    cache_flat.index_copy_(0, dst_slots, moved)  # ... then scatter
