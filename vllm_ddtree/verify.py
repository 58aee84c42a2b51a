"""DDTree verification: the sample-and-match walk down a verified tree.

From the root, take the target's token at the current node (argmax when greedy, a sample
when T > 0); if a valid child carries that token, move to it and repeat; otherwise that
token is the bonus. Every committed token is a target token at its true prefix, so the walk
is lossless at any temperature. Siblings carry distinct tokens, so at most one child
matches.

Two implementations with identical outputs, both free of host syncs so a step can be
captured in a CUDA graph at fixed (num_reqs, budget, max_depth): on CUDA the Triton kernel
in verify_triton.py (the whole walk in one launch); elsewhere walk_tree below, its torch
twin and test oracle (batched over requests with masks, a loop over depth).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.tree import DDTree


@dataclass
class WalkResult:
    accepted_nodes: torch.Tensor  # [num_reqs, max_depth + 1] int64; node at each depth, col 0 = 0, -1 past num_accepted
    num_accepted: torch.Tensor  # [num_reqs] int64; accepted drafts (bonus excluded), 0..min(budget, max_depth)
    bonus_tokens: torch.Tensor  # [num_reqs] int64; target token at the last accepted node
    output_tokens: torch.Tensor  # [num_reqs, budget + 1] int64; chain format: accepted, bonus, -1 ...


def walk_tree(
    tree: DDTree,
    target_tokens: torch.Tensor,  # [num_reqs, budget + 1]; target token at every node
    max_depth: int,
    *,
    use_triton: bool | None = None,  # None: the Triton kernel on CUDA, else torch
) -> WalkResult:
    """Follow the target's tokens down the tree; emit the accepted path in chain format.
    The loop below is the CPU path and the twin of verify_triton's one-launch kernel."""
    check_walk_args(tree, target_tokens, max_depth)
    if use_triton is None:
        use_triton = tree.tokens.is_cuda
    if use_triton:
        from vllm_ddtree.verify_triton import walk_tree_triton

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
    CUDA one launch (verify_triton.walk_rows_triton); this is its torch twin."""
    if use_triton is None:
        use_triton = tree.tokens.is_cuda
    if use_triton:
        from vllm_ddtree.verify_triton import walk_rows_triton

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


def walk_buffers(num_reqs: int, n: int, max_depth: int, device: torch.device,
                 out: WalkResult | None = None) -> WalkResult:
    """Where a walk of ``num_reqs`` trees of ``n`` nodes is written: the leading rows
    of ``out`` (checked), or new tensors."""
    if out is None:
        return WalkResult(
            accepted_nodes=torch.empty(num_reqs, max_depth + 1, dtype=torch.int64,
                                       device=device),
            num_accepted=torch.empty(num_reqs, dtype=torch.int64, device=device),
            bonus_tokens=torch.empty(num_reqs, dtype=torch.int64, device=device),
            output_tokens=torch.empty(num_reqs, n, dtype=torch.int64, device=device),
        )
    fits = (
        out.accepted_nodes.shape[0] >= num_reqs and out.accepted_nodes.shape[1] == max_depth + 1
        and out.output_tokens.shape[0] >= num_reqs and out.output_tokens.shape[1] >= n
        and out.num_accepted.shape[0] >= num_reqs and out.bonus_tokens.shape[0] >= num_reqs
        and out.accepted_nodes.is_contiguous() and out.output_tokens.is_contiguous()
        and all(t.dtype == torch.int64 for t in (out.accepted_nodes, out.num_accepted,
                                                   out.bonus_tokens, out.output_tokens))
    )
    if not fits:
        raise ValueError(
            f"out must hold int64 walks of >= {num_reqs} requests, max depth {max_depth} "
            f"and >= {n} nodes, got accepted_nodes {tuple(out.accepted_nodes.shape)} and "
            f"output_tokens {tuple(out.output_tokens.shape)}"
        )
    return WalkResult(
        accepted_nodes=out.accepted_nodes[:num_reqs],
        num_accepted=out.num_accepted[:num_reqs],
        bonus_tokens=out.bonus_tokens[:num_reqs],
        # Rows of n, row-major, whatever the buffer's width: the kernel's layout.
        output_tokens=out.output_tokens.view(-1)[: num_reqs * n].view(num_reqs, n),
    )


def check_counts_args(
    num_reqs: int,
    num_sampled_out: torch.Tensor | None,
    num_rejected_out: torch.Tensor | None,
    chunked_prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """The count outputs of walk_rows and its Triton twin: int32 [num_reqs]; the
    rejected count and the prefill rule come with the committed count."""
    for name, t in (("num_sampled_out", num_sampled_out), ("num_rejected_out", num_rejected_out)):
        if t is not None and (t.shape != (num_reqs,) or t.dtype != torch.int32):
            raise ValueError(f"{name} must be int32 [{num_reqs}], got {t.dtype} "
                             f"{tuple(t.shape)}")
    if num_sampled_out is None and (num_rejected_out is not None or chunked_prefill is not None):
        raise ValueError("num_rejected_out and chunked_prefill come with num_sampled_out")
    if chunked_prefill is not None and (
        len(chunked_prefill) != 3 or chunked_prefill[0].shape[0] < num_reqs
        or chunked_prefill[1].shape[0] < num_reqs
    ):
        raise ValueError("chunked_prefill is (seq_lens, idx_mapping, prefill_len), the "
                         f"first two over >= {num_reqs} requests")


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


def check_walk_args(tree: DDTree, target_tokens: torch.Tensor, max_depth: int) -> None:
    """Shapes and depth shared by walk_tree and its Triton twin."""
    num_reqs, n = tree.tokens.shape
    if target_tokens.shape != (num_reqs, n):
        raise ValueError(
            f"target_tokens must be [num_reqs, budget + 1] = {(num_reqs, n)}, "
            f"got {tuple(target_tokens.shape)}"
        )
    check_max_depth(max_depth)


def check_max_depth(max_depth: int) -> None:
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")


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
