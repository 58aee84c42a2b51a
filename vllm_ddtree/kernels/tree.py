"""DDTree selection in Triton: the `budget` best prefixes laid out as a tree, one launch.

Same signature and outputs as ``tree.select_tree`` (its torch twin, the CPU path and the
test oracle); ops/tree.py defines the total order and the layout. build_ddtree calls this on
CUDA after ``topk_per_depth``, so a whole build is the top-k launches plus one kernel.

Kernel design (one program per request; BLOCK = next power of 2 >= budget + 1 lanes, one
per node slot; slot i holds the i-th best prefix, slot 0 the root):
- Best-first, as the paper's heap: every selected node owns two candidates, its next
  sibling and its first child (a [BLOCK, 2] tile of scores, -inf = none). Each of the
  `budget` steps pops the best candidate with one int64 min over the tile. The key is
  (|score| bits, depth, lex rank of the parent, rank): equal scores fall to depth, then to
  the rank tuple, whose order inside a depth is (parent's lex order, rank).
- Lex ranks among the selected nodes of each depth stay dense: inserting a node moves the
  ranks behind it, and the parent ranks of their children, up by one (vector updates).
- Layout: preorder (ops/tree.py). Inside a depth, the lex ranks order siblings contiguously
  by rank, and a node's elder siblings are ranks 0 .. rank - 1 (a sibling is opened only
  once the one before it is taken). So one prefix sum of subtree sizes in (depth, lex
  order) gives each node the size of everything under its elder siblings, and a chase up
  its parents sums (that + 1) over its ancestors-or-self into its preorder position.
  Subtree sizes come from atomic adds up each node's ancestors in a scratch row. Each lane
  then writes its node at its position, reads its parent's position from a scratch row,
  and chases parents to fill its ancestor-mask row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.device import require_triton_device
from vllm_ddtree.tensors import DDTree

__all__ = ["select_tree_triton", "triton_supports"]

KEY_NONE = tl.constexpr((1 << 63) - 1)  # key of an empty candidate: after every real one
SCRATCH_ROWS = tl.constexpr(5)  # select_tree_kernel's scratch rows per request


def triton_supports(budget: int, max_depth: int) -> bool:
    """Whether a candidate's (depth, parent lex rank, rank) fits the kernel's 31-bit tie key."""
    return 2 * budget.bit_length() + (max_depth + 1).bit_length() <= 31


def select_tree_triton(
    top_vals: torch.Tensor,  # [num_reqs, max_depth, k] float32 <= 0, sorted descending per depth
    top_ids: torch.Tensor,  # [num_reqs, max_depth, k] int64
    root_tokens: torch.Tensor,  # [num_reqs]
    budget: int,
) -> DDTree:
    """The tree of the `budget` best prefixes (Triton twin of tree.select_tree)."""
    num_reqs, max_depth, k = _check_inputs(top_vals, top_ids, root_tokens, budget)
    n = budget + 1
    block = triton.next_power_of_2(n)
    device = top_vals.device
    tokens = torch.empty(num_reqs, n, dtype=torch.int64, device=device)
    parents = torch.empty_like(tokens)
    depths = torch.empty_like(tokens)
    valid = torch.empty(num_reqs, n, dtype=torch.bool, device=device)
    ancestor_mask = torch.empty(num_reqs, n, n, dtype=torch.bool, device=device)
    num_nodes = torch.empty(num_reqs, dtype=torch.int64, device=device)
    # Scratch rows per request: positions, parent slots, subtree sizes, sizes in
    # (depth, lex) order then their prefix sums, and each node's preorder step.
    scratch = torch.empty(num_reqs, SCRATCH_ROWS.value, block, dtype=torch.int32,
                          device=device)
    if num_reqs > 0:
        select_tree_kernel[(num_reqs,)](
            tokens,
            parents,
            depths,
            valid.view(torch.uint8),
            ancestor_mask.view(torch.uint8),
            num_nodes,
            scratch,
            top_vals,
            top_ids,
            # vLLM's DFlash sends int32 next tokens: one dtype (and no alignment
            # specialization) for every caller, so the start-up warm-up's variant is
            # the one every step uses.
            root_tokens.to(torch.int64),
            BUDGET=budget,
            MAX_DEPTH=max_depth,
            TOPK=k,
            BLOCK=block,
            RANK_BITS=budget.bit_length(),
            MASK_ROWS=max(1, 4096 // block),
            num_warps=1 if block <= 128 else (2 if block <= 256 else 4),
        )
    return DDTree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        valid=valid,
        ancestor_mask=ancestor_mask,
        num_nodes=num_nodes,
    )


def _check_inputs(
    top_vals: torch.Tensor, top_ids: torch.Tensor, root_tokens: torch.Tensor, budget: int
) -> tuple[int, int, int]:
    if top_vals.dim() != 3 or top_vals.dtype != torch.float32 or not top_vals.is_contiguous():
        raise ValueError(
            f"top_vals must be a contiguous float32 [num_reqs, max_depth, k] tensor, got "
            f"{top_vals.dtype} {tuple(top_vals.shape)}"
        )
    num_reqs, max_depth, k = top_vals.shape
    if top_ids.shape != top_vals.shape or top_ids.dtype != torch.int64 or not top_ids.is_contiguous():
        raise ValueError(
            f"top_ids must be a contiguous int64 tensor of shape {tuple(top_vals.shape)}, got "
            f"{top_ids.dtype} {tuple(top_ids.shape)}"
        )
    if root_tokens.shape != (num_reqs,) or not root_tokens.is_contiguous():
        raise ValueError(f"root_tokens must be contiguous [{num_reqs}], got {tuple(root_tokens.shape)}")
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= k <= budget:
        raise ValueError(f"budget must be an int >= k = {k}, got {budget!r}")
    if not triton_supports(budget, max_depth):
        raise ValueError(
            f"budget={budget} with max_depth={max_depth} overflows the kernel's 31-bit tie key; "
            f"use tree.select_tree"
        )
    require_triton_device(top_vals, "select_tree_triton", "tree.select_tree")
    return num_reqs, max_depth, k


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize_on_alignment=["root_tokens_ptr"])
def select_tree_kernel(
    tokens_ptr,  # [num_reqs, BUDGET + 1] int64
    parents_ptr,  # [num_reqs, BUDGET + 1] int64
    depths_ptr,  # [num_reqs, BUDGET + 1] int64
    valid_ptr,  # [num_reqs, BUDGET + 1] uint8 (bool)
    mask_ptr,  # [num_reqs, BUDGET + 1, BUDGET + 1] uint8 (bool)
    num_nodes_ptr,  # [num_reqs] int64
    scratch_ptr,  # [num_reqs, SCRATCH_ROWS, BLOCK] int32 scratch (select_tree_triton)
    top_vals_ptr,  # [num_reqs, MAX_DEPTH, TOPK] float32
    top_ids_ptr,  # [num_reqs, MAX_DEPTH, TOPK] int64
    root_tokens_ptr,  # [num_reqs] int64
    BUDGET: tl.constexpr,
    MAX_DEPTH: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,  # power of 2 >= BUDGET + 1: one lane per slot
    RANK_BITS: tl.constexpr,  # ranks and lex ranks are < 2 ** RANK_BITS
    MASK_ROWS: tl.constexpr,  # ancestor-mask rows zeroed per store
):
    req = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = BUDGET + 1
    RANK_MASK = (1 << RANK_BITS) - 1
    lane = tl.arange(0, BLOCK)
    side = tl.arange(0, 2)[None, :]  # candidate kind: 0 = next sibling, 1 = first child
    vals_ptr = top_vals_ptr + req * (MAX_DEPTH * TOPK)

    # Slot fields; slot 0 is the root (depth 0, score 0).
    depth = tl.zeros([BLOCK], dtype=tl.int32)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    parent = tl.zeros([BLOCK], dtype=tl.int32)  # parent's slot
    lex = tl.zeros([BLOCK], dtype=tl.int32)  # lex rank among the taken nodes of its depth
    parent_lex = tl.zeros([BLOCK], dtype=tl.int32)
    score = tl.zeros([BLOCK], dtype=tl.float32)
    parent_score = tl.zeros([BLOCK], dtype=tl.float32)
    taken = lane == 0
    cand = tl.where((lane[:, None] == 0) & (side == 1), tl.load(vals_ptr), float("-inf"))

    for step in range(BUDGET):
        # Pop the best candidate: (|score| bits, depth, parent lex rank, rank), smallest first.
        c_depth = depth[:, None] + side
        c_lex = tl.where(side == 0, parent_lex[:, None], lex[:, None])
        c_rank = tl.where(side == 0, rank[:, None] + 1, 0)
        tie = (c_depth << (2 * RANK_BITS)) | (c_lex << RANK_BITS) | c_rank
        mag = cand.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        key = tl.where(cand > float("-inf"), (mag.to(tl.int64) << 32) | tie.to(tl.int64), KEY_NONE)
        best = tl.min(key)
        alive = best < KEY_NONE  # False once every prefix is taken
        # Per-lane copy: Triton's interpreter mis-types a scalar bool broadcast to a vector.
        alive_lane = (tl.zeros([BLOCK], dtype=tl.int64) + best) < KEY_NONE
        win = (key == best) & (key < KEY_NONE)
        new_parent = tl.max(tl.where(win, tl.where(side == 0, parent[:, None], lane[:, None]), -1))
        new_pscore = tl.max(
            tl.where(win, tl.where(side == 0, parent_score[:, None], score[:, None]), float("-inf"))
        )
        low = (best & 0x7FFFFFFF).to(tl.int32)
        new_depth = low >> (2 * RANK_BITS)
        new_plex = (low >> RANK_BITS) & RANK_MASK
        new_rank = low & RANK_MASK
        new_score = -((best >> 32).to(tl.int32).to(tl.float32, bitcast=True))

        # Its lex rank: same-depth nodes before it in (parent lex rank, rank); shift the rest.
        same = taken & (depth == new_depth)
        before = same & ((parent_lex < new_plex) | ((parent_lex == new_plex) & (rank < new_rank)))
        new_lex = tl.sum(before.to(tl.int32))
        lex += (alive_lane & same & (lex >= new_lex)).to(tl.int32)
        parent_lex += (alive_lane & taken & (depth == new_depth + 1) & (parent_lex >= new_lex)).to(tl.int32)

        # Take it into slot step + 1; open its next sibling and its first child.
        sib = new_pscore + tl.load(
            vals_ptr + (new_depth - 1) * TOPK + new_rank + 1,
            mask=alive & (new_rank + 1 < TOPK),
            other=float("-inf"),
        )
        kid = new_score + tl.load(
            vals_ptr + new_depth * TOPK, mask=alive & (new_depth < MAX_DEPTH), other=float("-inf")
        )
        is_new = (lane == step + 1) & alive_lane
        depth = tl.where(is_new, new_depth, depth)
        rank = tl.where(is_new, new_rank, rank)
        parent = tl.where(is_new, new_parent, parent)
        lex = tl.where(is_new, new_lex, lex)
        parent_lex = tl.where(is_new, new_plex, parent_lex)
        score = tl.where(is_new, new_score, score)
        parent_score = tl.where(is_new, new_pscore, parent_score)
        taken = taken | is_new
        cand = tl.where(win, float("-inf"), cand)
        cand = tl.where(is_new[:, None], tl.where(side == 0, sib, kid), cand)

    # Preorder layout (ops/tree.py): node v goes to the sum over its ancestors-or-self a
    # below the root of elder(a) + 1, elder(a) = the nodes under a's elder siblings.
    # Padding slots (not taken) are the last ones and keep their index.
    row = lane < N
    node = taken & (lane > 0)
    scratch = scratch_ptr + req * (SCRATCH_ROWS * BLOCK)
    position_row, parent_row, size_row = scratch, scratch + BLOCK, scratch + 2 * BLOCK
    lexed_row, step_row = scratch + 3 * BLOCK, scratch + 4 * BLOCK
    lexpos = tl.zeros([BLOCK], dtype=tl.int32)  # (depth, lex) as one dense index, root 0
    base = tl.full([], 1, tl.int32)
    for d in range(1, MAX_DEPTH + 1):
        at = taken & (depth == d)
        lexpos = tl.where(at, base + lex, lexpos)
        base += tl.sum(at.to(tl.int32))
    tl.store(parent_row + lane, parent, mask=row)
    tl.store(size_row + lane, node.to(tl.int32), mask=row)
    tl.debug_barrier()  # parents and the sizes' 1s are written before any chase
    cur = parent
    for _ in range(MAX_DEPTH - 1):  # a node of depth d has d - 1 ancestors below the root
        up = node & (cur > 0)
        tl.atomic_add(size_row + cur, 1, mask=up)
        cur = tl.load(parent_row + cur, mask=up, other=0)
    tl.debug_barrier()  # every add is done before the sizes are read (from L2: .cg)
    size = tl.load(size_row + lane, mask=row, other=0, cache_modifier=".cg")
    tl.store(lexed_row + lexpos, size, mask=node)
    tl.debug_barrier()
    by_lex = tl.load(lexed_row + lane, mask=(lane > 0) & (lane < base), other=0)
    before = tl.cumsum(by_lex, 0) - by_lex  # sizes of the entries before, (depth, lex) order
    tl.debug_barrier()  # every lane has read its entry before the prefix sums overwrite it
    tl.store(lexed_row + lane, before, mask=row)
    tl.debug_barrier()
    elder = (tl.load(lexed_row + lexpos, mask=node, other=0)
             - tl.load(lexed_row + lexpos - rank, mask=node, other=0))
    tl.store(step_row + lane, elder + 1, mask=row)
    tl.debug_barrier()
    position = tl.zeros([BLOCK], dtype=tl.int32)
    cur = lane
    for _ in range(MAX_DEPTH):  # a node of depth d: d ancestors-or-self below the root
        up = node & (cur > 0)
        position += tl.load(step_row + cur, mask=up, other=0)
        cur = tl.load(parent_row + cur, mask=up, other=0)
    position = tl.where(taken, position, lane)

    tl.store(position_row + lane, position, mask=row)
    tl.debug_barrier()  # every slot's position is written before any lane reads its parent's
    parent_position = tl.load(position_row + parent, mask=node, other=0).to(tl.int64)
    ids_ptr = top_ids_ptr + req * (MAX_DEPTH * TOPK)
    token = tl.load(ids_ptr + (depth - 1) * TOPK + rank, mask=node, other=0)
    token = tl.where(lane == 0, tl.load(root_tokens_ptr + req).to(tl.int64), token)
    me = position.to(tl.int64)
    out = req * N + me
    tl.store(tokens_ptr + out, token, mask=row)
    tl.store(parents_ptr + out, parent_position, mask=row)
    tl.store(depths_ptr + out, tl.where(taken, depth, 0).to(tl.int64), mask=row)
    tl.store(valid_ptr + out, taken.to(tl.uint8), mask=row)
    tl.store(num_nodes_ptr + req, (tl.sum(taken.to(tl.int32)) - 1).to(tl.int64))

    # Ancestor mask: zero the request's [N, N] block, then each row sets root, self, and
    # the parents it chases (a node of depth d has d - 1 ancestors besides the root).
    mask_rows = mask_ptr + req * (N * N)
    cols = lane[None, :]
    for r0 in range(0, N, MASK_ROWS):
        rows = r0 + tl.arange(0, MASK_ROWS)[:, None]
        zeros = tl.zeros([MASK_ROWS, BLOCK], dtype=tl.uint8)
        tl.store(mask_rows + rows * N + cols, zeros, mask=(rows < N) & (cols < N))
    tl.debug_barrier()  # zeros and parents are written before any row sets its bits
    ones = tl.full([BLOCK], 1, dtype=tl.uint8)
    my_row = mask_rows + me * N
    tl.store(my_row, ones, mask=row)
    tl.store(my_row + me, ones, mask=row)
    cur = me
    for _ in range(MAX_DEPTH - 1):
        cur = tl.load(parents_ptr + req * N + cur, mask=row, other=0)
        tl.store(my_row + cur, ones, mask=row)
