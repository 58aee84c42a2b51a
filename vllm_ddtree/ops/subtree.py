"""The best tree of ``k`` nodes inside a built tree of ``budget`` nodes (torch).

When a step verifies fewer drafts than the budget (a tree sized for the batch), the
drafts must be the ``k`` best prefixes, not the first ``k`` nodes of the budget tree's
preorder (which are the drafter's greedy chain). The best ``k`` prefixes are the
first ``k`` of the budget tree under the build's total order (ops/tree.py: score
descending, depth ascending, rank tuple ascending), so no second build is needed:
:func:`node_scores` recomputes each node's score exactly as the build accumulated it
(float32, root to leaf, from the clamped per-depth log-probabilities that
:func:`node_logprobs` gathers), and :func:`best_subtree` ranks the nodes and keeps the
best ``k`` in their preorder. The scores take a few launches per depth and serve every
``k``, so the drafter's pass computes them (inside its CUDA graph on the V2 runner);
the ranking, which depends on ``k``, takes as many launches at any depth. Inside a
depth, the rank tuples' order is the preorder's, so a node's index breaks the
remaining ties. The result equals ``build_ddtree(.., budget=k, ..)`` in its
first ``k + 1`` columns, with padding after them.

No host synchronisation: the ops run in a CUDA graph or between replays.
"""

from __future__ import annotations

import torch

from vllm_ddtree.ops.tree import LOGPROB_FLOOR, MAG_BITS, _score_mag
from vllm_ddtree.tensors import DDTree


def node_logprobs(
    tree: DDTree,  # [num_reqs, n] per field
    draft_logprobs: torch.Tensor,  # [>= num_reqs, max_depth, vocab]; row d = log q_{d+1}
) -> torch.Tensor:  # [num_reqs, n] float32
    """Each node's clamped ``log q_depth(token)``, the term the build added to its parent's
    score; 0 for the root and padding."""
    num_reqs, _ = tree.tokens.shape
    _, max_depth, vocab = draft_logprobs.shape
    flat = draft_logprobs[:num_reqs].reshape(num_reqs, max_depth * vocab)
    index = (tree.depths - 1).clamp(min=0) * vocab + tree.tokens
    values = flat.gather(1, index).float().clamp(LOGPROB_FLOOR, 0.0)
    node = torch.arange(tree.tokens.shape[1], device=index.device)
    return torch.where(tree.valid & (node > 0), values, 0.0)


def node_scores(
    tree: DDTree,  # [num_reqs, n] per field
    draft_logprobs: torch.Tensor,  # [>= num_reqs, max_depth, vocab]; row d = log q_{d+1}
) -> torch.Tensor:  # [num_reqs, n] float32; 0 for the root and padding
    """Each node's score as the build accumulated it: score(child) = score(parent) + the
    child's clamped log q (:func:`node_logprobs`), in float32, root to leaf."""
    node_lp = node_logprobs(tree, draft_logprobs)
    score = torch.zeros_like(node_lp)
    for depth in range(1, draft_logprobs.shape[1] + 1):
        score = torch.where(tree.depths == depth, score.gather(1, tree.parents) + node_lp, score)
    return score


def best_subtree(
    tree: DDTree,  # [num_reqs, n] per field, a build's output (preorder layout)
    score: torch.Tensor,  # [num_reqs, n] float32, from node_scores
    k: int,
    max_depth: int,
) -> DDTree:  # [num_reqs, n] per field: the best k nodes first, in preorder, then padding
    """The best ``k``-node tree inside ``tree``, laid out as a build of budget ``k`` would
    lay it out, padded to the input's width."""
    num_reqs, n = tree.tokens.shape
    if not 0 < k < n:
        raise ValueError(f"k must be in 1..{n - 1} for trees of {n - 1} nodes, got {k}")
    device = tree.tokens.device
    node = torch.arange(n, device=device)
    # The build's total order as one int64 key: |score| bits, depth, preorder index.
    index_bits = n.bit_length()
    depth_bits = max_depth.bit_length()
    key = (
        (_score_mag(score).to(torch.int64) << (depth_bits + index_bits))
        + (tree.depths << index_bits) + node
    )
    real = tree.valid & (node > 0)
    key = torch.where(real, key, 1 << (MAG_BITS + depth_bits + index_bits))
    key = torch.where(node == 0, -1, key)  # the root first: always kept
    rank = key.argsort(dim=1).argsort(dim=1)
    keep = (rank <= k) & tree.valid
    # Kept nodes first, in their preorder (a stable sort), then the rest as padding.
    order = (~keep).to(torch.int8).sort(dim=1, stable=True).indices  # new -> old
    new_of_old = order.argsort(dim=1)
    kept = keep.gather(1, order)
    rows = order[:, :, None].expand(num_reqs, n, n)
    mask = tree.ancestor_mask.gather(1, rows).gather(2, order[:, None, :].expand(num_reqs, n, n))
    padding_mask = (node[None, :] == node[:, None]) | (node[None, :] == 0)  # root and self
    return DDTree(
        tokens=torch.where(kept, tree.tokens.gather(1, order), 0),
        parents=torch.where(kept, new_of_old.gather(1, tree.parents.gather(1, order)), 0),
        depths=torch.where(kept, tree.depths.gather(1, order), 0),
        valid=kept,
        ancestor_mask=torch.where(kept[:, :, None], mask, padding_mask),
        num_nodes=kept[:, 1:].sum(1),
    )
