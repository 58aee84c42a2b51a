"""DDTree verification: the sample-and-match walk down a verified tree.

From the root, take the target's token at the current node (argmax when greedy, a sample
when T > 0); if a valid child carries that token, move to it and repeat; otherwise that
token is the bonus. Every committed token is a target token at its true prefix, so the walk
is lossless at any temperature. Siblings carry distinct tokens, so at most one child
matches.

Two implementations with identical outputs, both free of host syncs so a step can be
captured in a CUDA graph at fixed (num_reqs, budget, max_depth): on CUDA the Triton kernel
in kernels/walk.py (the whole walk in one launch); elsewhere walk_tree below, its torch
twin and test oracle (batched over requests with masks, a loop over depth).
"""

from __future__ import annotations

import torch

from vllm_ddtree.tensors import (
    DDTree,
    WalkResult,
    check_counts_args,
    check_walk_args,
    walk_buffers,
)


def walk_tree(
    tree: DDTree,
    target_tokens: torch.Tensor,  # [num_reqs, budget + 1]; target token at every node
    max_depth: int,
    *,
    use_triton: bool | None = None,  # None: the Triton kernel on CUDA, else torch
) -> WalkResult:
    """Follow the target's tokens down the tree; emit the accepted path in chain format.
    The loop below is the CPU path and the twin of kernels/walk.py's one-launch kernel."""
    check_walk_args(tree, target_tokens, max_depth)
    if use_triton is None:
        use_triton = tree.tokens.is_cuda
    if use_triton:
        from vllm_ddtree.kernels.walk import walk_tree_triton

        return walk_tree_triton(tree, target_tokens, max_depth)
    num_reqs, n = tree.tokens.shape
    target = target_tokens.to(torch.int64)
    device = tree.tokens.device
    # Column 0 (the root) is its own parent; it is never anyone's child.
    candidate = tree.valid & (torch.arange(n, device=device) >= 1)

    current = torch.zeros(num_reqs, 1, dtype=torch.int64, device=device)
    alive = torch.ones(num_reqs, 1, dtype=torch.bool, device=device)
    path = [current]
    for _ in range(max_depth):
        want = target.gather(1, current)  # target token at the current node
        match = candidate & (tree.parents == current) & (tree.tokens == want)  # <= 1 per row
        alive = alive & match.any(dim=1, keepdim=True)
        child = match.to(torch.int8).argmax(dim=1, keepdim=True)  # the matching child
        current = torch.where(alive, child, current)
        path.append(torch.where(alive, child, -1))

    accepted_nodes = torch.cat(path, dim=1)  # [num_reqs, max_depth + 1]
    num_accepted = (accepted_nodes[:, 1:] >= 0).sum(dim=1)
    bonus = target.gather(1, current).squeeze(1)
    return WalkResult(
        accepted_nodes=accepted_nodes,
        num_accepted=num_accepted,
        bonus_tokens=bonus,
        output_tokens=chain_output(tree.tokens, accepted_nodes, num_accepted, bonus),
    )


def walk_rows(
    tree: DDTree,
    row_tokens: torch.Tensor,  # [num_rows] the target's token at every logits row
    cu_num_sampled: torch.Tensor,  # [num_reqs] cumulative logits rows per request
    num_scheduled: torch.Tensor,  # [num_reqs] int64, drafts sent per request
    max_depth: int,
    num_sampled_out: torch.Tensor | None = None,  # [num_reqs] int32 (out): tokens committed
    *,
    num_rejected_out: torch.Tensor | None = None,  # [num_reqs] int32 (out), with num_sampled_out
    # (seq_lens [num_reqs], idx_mapping [num_reqs], prefill_len [num_states]): vLLM V2's
    # rule for a request still prefilling its prompt, which commits nothing.
    chunked_prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out: WalkResult | None = None,  # [>= num_reqs, ...] buffers to write the walk into
    use_triton: bool | None = None,  # None: the Triton kernel on CUDA, else torch
) -> WalkResult:
    """walk_tree over a step's flat logits rows (each request's rows end at
    ``cu_num_sampled``, node i at the i-th of its last ``num_scheduled + 1``), and
    into ``num_sampled_out`` the tokens each request commits (accepted drafts plus
    the bonus) and into ``num_rejected_out`` its logits rows less those; a request
    whose ``seq_len`` is below its ``prefill_len`` commits and rejects nothing
    (vLLM V2's ``get_num_sampled_and_rejected``). With ``out`` the walk lands in
    those buffers' leading rows (a CUDA graph replays over fixed addresses). On
    CUDA one launch (kernels.walk.walk_rows_triton); this is its torch twin."""
    if use_triton is None:
        use_triton = tree.tokens.is_cuda
    if use_triton:
        from vllm_ddtree.kernels.walk import walk_rows_triton

        return walk_rows_triton(tree, row_tokens, cu_num_sampled, num_scheduled, max_depth,
                                num_sampled_out, num_rejected_out=num_rejected_out,
                                chunked_prefill=chunked_prefill, out=out)
    num_reqs, n = tree.tokens.shape
    check_counts_args(num_reqs, num_sampled_out, num_rejected_out, chunked_prefill)
    rows = step_rows(cu_num_sampled, num_scheduled, n)
    walk = walk_tree(tree, row_tokens[rows], max_depth, use_triton=False)
    if out is not None:
        written = walk_buffers(num_reqs, n, max_depth, tree.tokens.device, out)
        for name in ("accepted_nodes", "num_accepted", "bonus_tokens", "output_tokens"):
            getattr(written, name).copy_(getattr(walk, name))
        walk = written
    if num_sampled_out is not None:
        committed = walk.num_accepted + 1
        prefilling = torch.zeros_like(committed, dtype=torch.bool)
        if chunked_prefill is not None:
            seq_lens, idx_mapping, prefill_len = chunked_prefill
            prefilling = seq_lens[:num_reqs] < prefill_len[idx_mapping[:num_reqs]]
        committed = torch.where(prefilling, 0, committed)
        num_sampled_out.copy_(committed)
        if num_rejected_out is not None:
            num_rejected_out.copy_(torch.where(prefilling, 0, num_scheduled + 1 - committed))
    return walk


def step_rows(
    cu_num_sampled: torch.Tensor,  # [num_reqs] cumulative rows per request
    num_scheduled: torch.Tensor,  # [num_reqs]
    width: int,
) -> torch.Tensor:
    """Flat logits row of node i of request r, ``[num_reqs, width]``.

    Rows of absent nodes (i > num_scheduled[r]) repeat the request's last row.
    """
    first = cu_num_sampled.to(torch.int64) - num_scheduled - 1
    offsets = torch.arange(width, device=first.device)
    return first[:, None] + torch.minimum(offsets[None, :], num_scheduled[:, None])


def chain_output(
    tree_tokens: torch.Tensor,  # [num_reqs, budget + 1]
    accepted_nodes: torch.Tensor,  # [num_reqs, max_depth + 1], -1 padded
    num_accepted: torch.Tensor,  # [num_reqs]
    bonus: torch.Tensor,  # [num_reqs]
) -> torch.Tensor:
    """[num_reqs, budget + 1]: out[:, j] = token of path node j+1 for j < k, bonus at j = k,
    -1 after (the rejection sampler's output format)."""
    num_reqs, n = tree_tokens.shape
    width = min(accepted_nodes.shape[1], n)  # k <= min(budget, max_depth), so k < width
    drafted = tree_tokens.gather(1, accepted_nodes[:, 1:width].clamp(min=0))  # path tokens
    drafted = torch.cat([drafted, bonus[:, None]], dim=1)  # width columns; last never used
    col = torch.arange(width, device=tree_tokens.device)
    k = num_accepted[:, None]
    chain = torch.where(col < k, drafted, torch.where(col == k, bonus[:, None], -1))
    out = torch.full((num_reqs, n), -1, dtype=torch.int64, device=tree_tokens.device)
    out[:, :width] = chain
    return out
