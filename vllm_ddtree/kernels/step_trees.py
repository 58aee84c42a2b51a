"""The trees a verify step checks, chosen and laid out in one Triton launch.

Same outputs as ``ops.step_trees.step_trees`` on its torch path (``chain_trees`` then
``select_trees``, the CPU path and the test oracle), which defines the rule: each
request verifies the tree its drafter built when the drafts the scheduler sent are
that tree's tokens (or a prefix of them), and otherwise the chain it was sent as.
The torch path costs some sixty small launches per step; this is one.

Kernel design (one program per request; BLOCK = next power of 2 >= width lanes, one
per node): the chain comes from the flat draft list (node i > 0 is draft i - 1 of
the request), the drafted row from the drafter's last trees; one comparison over the
scheduled nodes decides which the request uses. Then the per-node fields are stored
and the ancestor mask is written row by row (the tree's rows, or the chain's
lower triangle over the scheduled nodes with {self} for the rest), each row also
packed into 32-bit words when the caller passes a buffer (the attention kernel's
input, so no separate packing pass runs). Bool tensors travel as uint8.

Given the step's positions and query offsets, the same launch also moves each sent
node to its depth position and writes the request's root row (the Triton twin of
``ops.step_trees.tree_positions``, which runs after the trees on the torch path): the
runner then spends one launch, not two, on the step's trees before the target runs,
when the GPU waits for the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.device import require_triton_device
from vllm_ddtree.tensors import DDTree, tree_outputs

__all__ = ["step_trees_triton", "tree_outputs"]


def step_trees_triton(
    drafted: DDTree | None,  # [num_prev_reqs, budget + 1] per field; None: chains only
    index: torch.Tensor | None,  # [num_reqs] int64, row in `drafted` (-1: none); with drafted
    draft_token_ids: torch.Tensor,  # [total drafts] the scheduled drafts, request-major
    cu_num_draft_tokens: torch.Tensor,  # [num_reqs] cumulative drafts per request
    num_scheduled: torch.Tensor,  # [num_reqs] int64, drafts sent per request
    width: int,  # verify width: the widest request's drafts + 1
    packed_out: torch.Tensor | None = None,  # [>= num_reqs, >= width, >= words] int32
    positions: torch.Tensor | None = None,  # [num_rows] the step's positions, moved in place
    query_start_loc: torch.Tensor | None = None,  # [>= num_reqs + 1], with positions
    row_start_out: torch.Tensor | None = None,  # [>= num_reqs] int64, with positions
    *,
    state_rows: torch.Tensor | None = None,  # [num_states] int64: tree row of each state
    cu_num_logits: torch.Tensor | None = None,  # [num_reqs + 1] logits rows per request
    out: DDTree | None = None,  # [>= num_reqs, >= width] per field: buffers to write into
) -> DDTree:
    """The tree each request verifies this step (Triton twin of ops.step_trees.step_trees),
    its ancestor masks also packed into ``packed_out`` when given (as
    tensors.pack_tree_mask packs them: column j is bit j % 32 of word
    j // 32). With ``positions``, also what ``ops.step_trees.tree_positions`` does with
    the chosen trees' depths: each sent node moves to its root's position plus its
    depth, and ``row_start_out[:num_reqs]`` takes each request's root row (its tree
    rows end its query rows).

    Two inputs can also be derived in the launch (vLLM's V2 runner, where each
    would otherwise cost the host a copy or a few small launches): with
    ``state_rows``, ``index`` holds each request's state index and its tree row is
    ``state_rows[index[r]]`` (the torch path's ``index``); with ``cu_num_logits``
    (one logits row per draft plus the bonus), ``num_scheduled`` is an output, each
    request's ``rows - 1`` drafts. With ``out`` the trees land in its buffers (rows
    of ``width``, row-major, at their start), so that a CUDA graph can replay the
    launch over fixed addresses (the V2 runner)."""
    num_reqs = num_scheduled.shape[0]
    device = num_scheduled.device
    if cu_num_logits is not None and (
        cu_num_logits.shape[0] < num_reqs + 1 or num_scheduled.dtype != torch.int64
        or not num_scheduled.is_contiguous()
    ):
        raise ValueError(
            f"cu_num_logits must be [>= num_reqs + 1] = [>= {num_reqs + 1}] and num_scheduled "
            f"(written) contiguous int64, got {tuple(cu_num_logits.shape)} and "
            f"{num_scheduled.dtype}"
        )
    if state_rows is not None and (index is None or state_rows.dtype != torch.int64):
        raise ValueError("state_rows (int64) needs index: each request's state index")
    _check_inputs(drafted, index, cu_num_draft_tokens, num_scheduled, width)
    words = -(-width // 32)
    if packed_out is not None and (
        packed_out.dtype != torch.int32 or packed_out.dim() != 3
        or packed_out.shape[0] < num_reqs or packed_out.shape[1] < width
        or packed_out.shape[2] < words or packed_out.stride(2) != 1
    ):
        raise ValueError(
            f"packed_out must be int32 [>= {num_reqs}, >= {width}, >= {words}] with "
            f"contiguous words, got {packed_out.dtype} {tuple(packed_out.shape)}"
        )
    has_positions = positions is not None
    if has_positions and (
        query_start_loc is None or row_start_out is None or positions.dim() != 1
        or query_start_loc.shape[0] < num_reqs + 1 or row_start_out.shape[0] < num_reqs
        or row_start_out.dtype != torch.int64
    ):
        raise ValueError(
            "positions need query_start_loc [>= num_reqs + 1] and row_start_out "
            f"[>= num_reqs] int64; num_reqs is {num_reqs}"
        )
    tokens, parents, depths, valid, mask, num_nodes = tree_outputs(num_reqs, width, device, out)
    if num_reqs == 0:
        return DDTree(tokens, parents, depths, valid, mask, num_nodes)
    has_drafted = drafted is not None and index is not None
    if has_drafted:  # one row-major layout for the fields (a no-op for the drafter's trees)
        drafted = DDTree(*(t.contiguous() for t in (
            drafted.tokens, drafted.parents, drafted.depths, drafted.valid,
            drafted.ancestor_mask, drafted.num_nodes)))
    source = drafted if has_drafted else DDTree(tokens, parents, depths, valid, mask, num_nodes)
    # int32 drafts and counts whatever the caller sends (vLLM sends int32; with no
    # drafts the pointer is never read): one compiled variant for every step.
    cu_drafts = cu_num_draft_tokens.to(torch.int32).contiguous()
    drafts = draft_token_ids.to(torch.int32).contiguous() if draft_token_ids.numel() > 0 \
        else cu_drafts
    packed = packed_out if packed_out is not None else num_nodes  # never written without it
    step_trees_kernel[(num_reqs,)](
        tokens, parents, depths, valid.view(torch.uint8), mask.view(torch.uint8), num_nodes,
        source.tokens, source.parents, source.depths,
        source.valid.view(torch.uint8), source.ancestor_mask.view(torch.uint8),
        (index if has_drafted else num_scheduled).contiguous(),
        state_rows if state_rows is not None else num_scheduled,  # read with STATE_ROWS
        drafts, cu_drafts,
        num_scheduled.contiguous(),  # itself when written (SCHEDULED_OUT): checked above
        cu_num_logits if cu_num_logits is not None else num_scheduled,  # with SCHEDULED_OUT
        width, draft_token_ids.numel(),
        source.tokens.stride(0), source.ancestor_mask.stride(0), source.ancestor_mask.stride(1),
        packed,
        packed_out.stride(0) if packed_out is not None else 0,
        packed_out.stride(1) if packed_out is not None else 0,
        positions if has_positions else num_nodes,  # never touched without positions
        query_start_loc if has_positions else num_nodes,
        row_start_out if has_positions else num_nodes,
        HAS_DRAFTED=has_drafted,
        HAS_POSITIONS=has_positions,
        STATE_ROWS=has_drafted and state_rows is not None,
        SCHEDULED_OUT=cu_num_logits is not None,
        BLOCK=triton.next_power_of_2(width),
        WORDS=words if packed_out is not None else 0,
    )
    return DDTree(tokens, parents, depths, valid, mask, num_nodes)


def _check_inputs(
    drafted: DDTree | None,
    index: torch.Tensor | None,
    cu_num_draft_tokens: torch.Tensor,
    num_scheduled: torch.Tensor,
    width: int,
) -> None:
    """Shape and layout checks that need no device sync."""
    num_reqs = num_scheduled.shape[0]
    if cu_num_draft_tokens.shape != (num_reqs,) or (
        index is not None and index.shape != (num_reqs,)
    ):
        raise ValueError(
            f"index and cu_num_draft_tokens must be [num_reqs={num_reqs}], got "
            f"{None if index is None else tuple(index.shape)} and "
            f"{tuple(cu_num_draft_tokens.shape)}"
        )
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if drafted is not None:
        budget1 = drafted.tokens.shape[1]
        if width > budget1:
            raise ValueError(
                f"{width - 1} drafts were scheduled but trees have budget {budget1 - 1}."
            )
    require_triton_device(num_scheduled, "step_trees_triton", "ops.step_trees.step_trees")


# ----------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------


# Per-request metadata may start anywhere in a shared buffer (the tree index is the second
# row of a [2, num_reqs] copy, 16-byte aligned only for an even batch): no alignment
# specialization for them, so the batch's parity never compiles a second variant.
@triton.jit(do_not_specialize=["width", "num_drafts", "row_stride", "mask_stride_r",
                               "mask_stride_i", "packed_stride_r", "packed_stride_i"],
            do_not_specialize_on_alignment=["index_ptr", "state_rows_ptr", "drafts_ptr",
                                            "cu_drafts_ptr", "num_scheduled_ptr",
                                            "cu_logits_ptr", "positions_ptr",
                                            "query_start_ptr", "row_start_ptr"])
def step_trees_kernel(
    tokens_ptr,  # [num_reqs, width] int64 (out)
    parents_ptr,  # [num_reqs, width] int64 (out)
    depths_ptr,  # [num_reqs, width] int64 (out)
    valid_ptr,  # [num_reqs, width] uint8 (out)
    mask_ptr,  # [num_reqs, width, width] uint8 (out)
    num_nodes_ptr,  # [num_reqs] int64 (out)
    tree_tokens_ptr,  # [num_prev_reqs, budget + 1] int64, the drafter's trees (HAS_DRAFTED)
    tree_parents_ptr,  # [num_prev_reqs, budget + 1] int64
    tree_depths_ptr,  # [num_prev_reqs, budget + 1] int64
    tree_valid_ptr,  # [num_prev_reqs, budget + 1] uint8
    tree_mask_ptr,  # [num_prev_reqs, budget + 1, budget + 1] uint8
    index_ptr,  # [num_reqs] int64, -1: no tree (STATE_ROWS: each request's state index)
    state_rows_ptr,  # [num_states] int64, tree row of each state, -1: none (STATE_ROWS)
    drafts_ptr,  # [num_drafts] the scheduled draft tokens
    cu_drafts_ptr,  # [num_reqs] cumulative drafts
    num_scheduled_ptr,  # [num_reqs] int64 (out with SCHEDULED_OUT)
    cu_logits_ptr,  # [num_reqs + 1] cumulative logits rows (SCHEDULED_OUT)
    width,
    num_drafts,
    row_stride,  # the drafted fields' row stride
    mask_stride_r,
    mask_stride_i,
    packed_ptr,  # [>= num_reqs, >= width, >= WORDS] int32 (out), rows of packed mask words
    packed_stride_r,
    packed_stride_i,
    positions_ptr,  # [num_rows] the step's positions (HAS_POSITIONS), moved in place
    query_start_ptr,  # [num_reqs + 1] query offsets (HAS_POSITIONS)
    row_start_ptr,  # [num_reqs] int64 (out, HAS_POSITIONS): each request's root row
    HAS_DRAFTED: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    STATE_ROWS: tl.constexpr,  # index_ptr holds state indices, mapped through state_rows_ptr
    SCHEDULED_OUT: tl.constexpr,  # drafts per request = logits rows - 1, stored
    BLOCK: tl.constexpr,
    WORDS: tl.constexpr,  # words per packed row; 0: no packed output
):
    req = tl.program_id(0)
    node = tl.arange(0, BLOCK)
    in_width = node < width
    if SCHEDULED_OUT:  # one logits row per draft, plus the bonus row
        rows = tl.load(cu_logits_ptr + req + 1) - tl.load(cu_logits_ptr + req)
        scheduled = (rows - 1).to(tl.int64)
        tl.store(num_scheduled_ptr + req, scheduled)
    else:
        scheduled = tl.load(num_scheduled_ptr + req)
    present = node <= scheduled
    first = tl.load(cu_drafts_ptr + req).to(tl.int64) - scheduled
    draft = tl.minimum(tl.maximum(first + node - 1, 0), tl.maximum(num_drafts - 1, 0))
    is_draft = present & (node > 0) & in_width
    chain_tokens = tl.load(drafts_ptr + draft, mask=is_draft, other=0).to(tl.int64)
    chain_tokens = tl.where(is_draft, chain_tokens, 0)

    if HAS_DRAFTED:
        index = tl.load(index_ptr + req)
        if STATE_ROWS:
            index = tl.load(state_rows_ptr + index)
        row = tl.maximum(index, 0)
        picked = tl.load(tree_tokens_ptr + row * row_stride + node, mask=in_width, other=0)
        differs = (picked != chain_tokens) & present & (node > 0) & in_width
        use = (index >= 0) & (tl.sum(differs.to(tl.int32), axis=0) == 0)
    else:
        row = scheduled * 0
        use = scheduled < 0  # never: no trees this step

    out = req.to(tl.int64) * width + node
    if use:
        at = row * row_stride + node
        tl.store(tokens_ptr + out, tl.load(tree_tokens_ptr + at, mask=in_width), mask=in_width)
        tl.store(parents_ptr + out, tl.load(tree_parents_ptr + at, mask=in_width), mask=in_width)
        depth = tl.load(tree_depths_ptr + at, mask=in_width, other=0)
        tl.store(depths_ptr + out, depth, mask=in_width)
        valid = (tl.load(tree_valid_ptr + at, mask=in_width, other=0) != 0) & present & in_width
        tl.store(valid_ptr + out, valid.to(tl.uint8), mask=in_width)
        count = tl.sum((valid & (node > 0)).to(tl.int64), axis=0)
        tl.store(num_nodes_ptr + req, count)
    else:
        tl.store(tokens_ptr + out, chain_tokens, mask=in_width)
        tl.store(parents_ptr + out, tl.maximum(node - 1, 0).to(tl.int64), mask=in_width)
        depth = tl.where(present, node, 0).to(tl.int64)
        tl.store(depths_ptr + out, depth, mask=in_width)
        tl.store(valid_ptr + out, present.to(tl.uint8), mask=in_width)
        tl.store(num_nodes_ptr + req, scheduled)
    if HAS_POSITIONS:  # node i of the tree rows (which end the query rows): root + depth
        start = tl.load(query_start_ptr + req + 1).to(tl.int64) - scheduled - 1
        tl.store(row_start_ptr + req, start)
        sent = (node >= 1) & (node <= scheduled) & in_width
        position = tl.load(positions_ptr + start + node, mask=sent, other=0)
        tl.store(positions_ptr + start + node, position + depth - node, mask=sent)
    for i in range(width):
        if use:  # the tree's row
            mask_row = tl.load(tree_mask_ptr + row * mask_stride_r + i * mask_stride_i + node,
                               mask=in_width, other=0) != 0
        else:  # scheduled rows: the causal chain; the rest: {self}
            mask_row = tl.where(i <= scheduled, (node <= i) & present, node == i)
        tl.store(mask_ptr + (req.to(tl.int64) * width + i) * width + node,
                 mask_row.to(tl.uint8), mask=in_width)
        for w in tl.static_range(WORDS):  # column j: bit j % 32 of word j // 32
            bits = tl.where(mask_row & (node // 32 == w), 1 << (node % 32), 0)
            tl.store(packed_ptr + req.to(tl.int64) * packed_stride_r + i * packed_stride_i + w,
                     tl.sum(bits, axis=0))
