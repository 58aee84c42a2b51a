"""DDTree construction: the `budget` most probable draft prefixes as a token tree.

The drafter gives per-depth marginals q_1..q_L. A prefix is a rank tuple (r_1..r_d),
d <= L, naming the r_k-th most probable token at each depth; its score is
log P = sum_k log q_k(token of rank r_k). The expected acceptance length of a tree is the
sum of its nodes' prefix probabilities, so the optimal tree with B nodes is the set of the
B best prefixes under the strict total order

    (score descending, depth ascending, rank tuple lexicographically ascending).

A child never beats its parent under this order (its score is <= the parent's, and equal
scores fall to depth), nor its elder sibling (ranks are sorted by probability, equal scores
fall to the rank tuple), so the top-B set is prefix-closed and is what the paper's
best-first max-heap returns.

Conventions (all tensors on the inputs' device; shapes depend only on
(num_reqs, budget, max_depth), so build_ddtree can be captured in a CUDA graph):
- Top-K per depth: K = min(budget, topk_cap or budget, vocab) tokens ordered by
  (log-prob descending, token id ascending); ties at the K-th value keep the lowest ids.
- Log-probs are clamped to [LOGPROB_FLOOR, 0] first: -inf (zero-probability) tokens still
  form real, orderable prefixes that rank below every positive-probability prefix, and
  values above 0 (unnormalised input) cannot make a child outrank its parent. NaN is not
  allowed.
- Scores are accumulated in float32 root to leaf: score(child) = score(parent) + log q.
- Node order: column 0 is the root (bonus token); then preorder, depth first with
  siblings by rank (preorder_layout): node 1 is the best depth-1 token, nodes
  2, 3, ... its best descendants down to a leaf (the drafter's greedy chain, so a prefix
  of the drafts verified as a chain is that chain), then the rest of each subtree before
  the next sibling. Parents precede children, and a run of consecutive nodes shares most
  of its ancestors, so the verify step's ancestor mask has few populated tiles.
  select_tree first lays nodes out depth-major (all depth-1 nodes, then depth 2, ...,
  inside a depth by the total order above) and preorder_layout renumbers them; the
  Triton kernel computes the preorder positions itself.
- If fewer than `budget` prefixes exist (sum_{d=1..L} K^d < budget) every prefix is taken
  and the trailing columns are padding: valid False, token 0, parent 0, depth 0; a padding
  row's ancestor_mask holds only the root and itself, so it attends to real context only.

Two implementations of the selection, with identical outputs: on CUDA the Triton kernel
in kernels/tree.py (best-first, one program per request, a handful of launches per build);
elsewhere select_tree below, its torch twin and test oracle (depth by depth, top-B over
int64 order keys). Likewise the top-k's tie repair: on CUDA one Triton launch
(topk_triton.py), elsewhere the torch path of topk_per_depth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_ddtree.config import topk_width
from vllm_ddtree.tensors import DDTree

LOGPROB_FLOOR = -1e30  # finite stand-in for log(0); keeps zero-probability prefixes orderable
TOPK_CHUNK_ELEMS = 1 << 25  # vocab entries per tie-resolution chunk: bounds its transient memory
KEY_NONE = 1 << 62  # order key of an empty slot: after every real key
MAG_BITS = 31  # |score| bits of a float32 score <= 0
INF_MAG = 0x7F800000  # |score| bits of -inf: an empty slot's score


def build_ddtree(
    draft_logprobs: torch.Tensor,  # [num_reqs, max_depth, vocab]; row d = log q_{d+1}
    root_tokens: torch.Tensor,  # [num_reqs]
    budget: int,
    topk_cap: int | None = None,
    *,
    use_triton: bool | None = None,  # None: the Triton kernels on CUDA where they fit, else torch
) -> DDTree:
    """Build the tree of the `budget` most probable draft prefixes for every request:
    top-K tokens per depth, then the selection and layout (Triton or its torch twin)."""
    _check_args(draft_logprobs, root_tokens, budget, topk_cap)
    _, max_depth, vocab = draft_logprobs.shape
    k = topk_width(budget, topk_cap, vocab)
    top_vals, top_ids = topk_per_depth(  # [num_reqs, max_depth, k]
        draft_logprobs.float(), k,
        use_triton=draft_logprobs.is_cuda if use_triton is None else use_triton,
    )
    if use_triton is None:
        use_triton = draft_logprobs.is_cuda and _triton_fits(budget, max_depth)
    if use_triton:
        from vllm_ddtree.kernels.tree import select_tree_triton

        return select_tree_triton(top_vals, top_ids, root_tokens, budget)
    return select_tree(top_vals, top_ids, root_tokens, budget)


def preorder_layout(tree: DDTree) -> DDTree:
    """The same trees with their nodes renumbered in preorder: depth first, siblings in
    index order (for select_tree's depth-major layout, rank order), padding kept last.

    No host sync, so a build stays capturable. For node v with size[a] the nodes under
    a (a included) and elder[a] the total size of a's elder siblings, the nodes before
    v in preorder are its proper ancestors and everything under their elder siblings:
    pre[v] = sum over a ancestor-or-self of v of (elder[a] + 1), minus 1. A padding
    node (a root child after every valid node) keeps its index."""
    mask = tree.ancestor_mask  # [num_reqs, n, n]; [r, i, j]: j ancestor-or-self of i
    num_reqs, n = tree.parents.shape
    node = torch.arange(n, device=mask.device)
    size = mask.sum(1, dtype=torch.int32)  # [num_reqs, n]
    elder_sibling = (  # [num_reqs, a, s]: s is an elder sibling of a
        (tree.parents[:, :, None] == tree.parents[:, None, :])
        & (node[None, :] < node[:, None]) & (node[None, :] > 0)
    )
    elder = torch.where(elder_sibling, size[:, None, :], 0).sum(-1, dtype=torch.int32)
    pre = torch.where(mask, (elder + 1)[:, None, :], 0).sum(-1) - 1  # [num_reqs, n] int64
    order = torch.empty_like(pre).scatter_(1, pre, node.expand(num_reqs, n))  # new -> old
    rows = order[:, :, None].expand(num_reqs, n, n)
    return DDTree(
        tokens=tree.tokens.gather(1, order),
        parents=pre.gather(1, tree.parents.gather(1, order)),
        depths=tree.depths.gather(1, order),
        valid=tree.valid.gather(1, order),
        ancestor_mask=mask.gather(1, rows).gather(2, order[:, None, :].expand(num_reqs, n, n)),
        num_nodes=tree.num_nodes,
    )


def topk_per_depth(
    logprobs: torch.Tensor,  # [num_reqs, max_depth, vocab] float32, no NaN
    k: int,
    *,
    use_triton: bool | None = None,  # None: the Triton tie repair on CUDA, else torch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values clamped to [LOGPROB_FLOOR, 0], ids) per depth, ordered by
    (clamped value desc, id asc); deterministic on ties.

    One torch.topk fixes the values (clamping is monotone, so the clamped top-k values are
    the clamped raw top-k values). Every token whose clamped value beats the k-th value v is
    in any top-k; only the ids tied with v are topk's free choice, and the lowest of them
    must be kept (the tie repair). Finally each run of equal values is ordered by id.

    The repair, on CUDA: one Triton launch in which only rows whose ties cross the k-th
    slot scan the vocabulary (topk_triton.py; topk takes k + 1 values to tell). Elsewhere,
    its torch twin below: the m lowest tied ids are the first m hits of a cumsum of
    (clamped value == v) over the vocabulary, found by searchsorted. On CUDA with
    k <= FUSED_TOPK_MAX_K, topk_triton gives the same result from one read of the rows,
    without torch.topk."""
    if use_triton is None:
        use_triton = logprobs.is_cuda
    if use_triton:
        from vllm_ddtree.kernels.topk import FUSED_TOPK_MAX_K, topk_triton

        if k <= FUSED_TOPK_MAX_K:
            return topk_triton(logprobs, k, LOGPROB_FLOOR)
    return _topk_and_repair(logprobs, k, use_triton=use_triton)


def _topk_and_repair(
    logprobs: torch.Tensor,  # [num_reqs, max_depth, vocab] float32, no NaN
    k: int,
    *,
    use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_per_depth through torch.topk and the tie repair (Triton or torch)."""
    vocab = logprobs.shape[-1]
    taken = min(k + 1, vocab) if use_triton else k
    raw_vals, ids = logprobs.topk(taken, dim=-1)  # values sorted descending
    vals = raw_vals.clamp(LOGPROB_FLOOR, 0.0)
    neg = -vals[..., :k]  # ascending
    run_start = torch.searchsorted(neg, neg)  # first slot holding each slot's value
    if use_triton:
        from vllm_ddtree.kernels.topk import repair_ties_triton

        repair_ties_triton(logprobs, vals, ids, run_start, LOGPROB_FLOOR)
        vals, ids = vals[..., :k].contiguous(), ids[..., :k]
    else:
        ids = _repair_ties(logprobs, vals, ids, run_start)
    # Inside a run of equal values, ids ascending: sort (run start, id) keys; runs stay put.
    base = run_start * vocab
    return vals, ids.add(base).sort(dim=-1).values.sub_(base)


def _repair_ties(
    logprobs: torch.Tensor,  # [num_reqs, max_depth, vocab] float32
    vals: torch.Tensor,  # [num_reqs, max_depth, k] clamped top values, descending
    ids: torch.Tensor,  # [num_reqs, max_depth, k] their ids from torch.topk
    run_start: torch.Tensor,  # [num_reqs, max_depth, k] first slot of each slot's value
) -> torch.Tensor:
    """ids with the slots tied at the k-th value holding the lowest tied ids, ascending
    (the torch twin of topk_triton.repair_ties_triton)."""
    num_reqs, max_depth, vocab = logprobs.shape
    k = vals.shape[-1]
    tie_start = run_start[..., k - 1 :]  # [num_reqs, max_depth, 1]: slots >= this hold v
    kth = vals[..., k - 1 :]
    slot = torch.arange(1, k + 1, device=logprobs.device, dtype=torch.int32)
    hit_rank = (slot - tie_start.to(torch.int32)).clamp(min=1)  # slot j takes tied hit j - start
    step = max(1, TOPK_CHUNK_ELEMS // max(1, num_reqs * vocab))  # depths per chunk
    tied = []
    for d in range(0, max_depth, step):
        rows = logprobs[:, d : d + step].clamp(LOGPROB_FLOOR, 0.0)
        hits = torch.empty(rows.shape, dtype=torch.int32, device=rows.device)  # int32 at once:
        torch.eq(rows, kth[:, d : d + step], out=hits).cumsum_(-1)  # no bool -> int copy
        tied.append(torch.searchsorted(hits, hit_rank[:, d : d + step].contiguous()))
    tied_ids = tied[0] if len(tied) == 1 else torch.cat(tied, dim=1)
    return torch.where(slot > tie_start, tied_ids, ids)


def select_tree(
    top_vals: torch.Tensor,  # [num_reqs, max_depth, k] float32 <= 0, sorted descending per depth
    top_ids: torch.Tensor,  # [num_reqs, max_depth, k] int64
    root_tokens: torch.Tensor,  # [num_reqs]
    budget: int,
) -> DDTree:
    """The tree of the `budget` best prefixes in the documented layout (torch twin of
    kernels.tree.select_tree_triton)."""
    num_reqs, max_depth, k = top_vals.shape
    device = top_vals.device
    scores, codes, bound = select_prefixes(top_vals, budget)  # [num_reqs, max_depth, budget]
    lex_bits, shift = key_bits(budget, max_depth, k)
    depth = torch.arange(1, max_depth + 1, device=device)[:, None]  # [max_depth, 1]
    mag = _score_mag(scores)
    key = torch.add((depth << lex_bits) + codes, mag, alpha=1 << shift)  # the total order
    # Selected: key <= bound. Depth-major order first: depth, then the total order inside
    # a depth; preorder_layout renumbers the result.
    layout_key = torch.add((depth << (MAG_BITS + lex_bits)) + codes, mag, alpha=1 << lex_bits)
    layout_key = torch.where(key <= bound[:, :, None], layout_key, KEY_NONE)
    last, flat = layout_key.view(num_reqs, max_depth * budget).topk(budget, dim=1, largest=False)
    valid = last < KEY_NONE  # [num_reqs, budget]

    # Entry flat = (d - 1) * budget + slot; its code l * k + r names parent slot l at d - 1.
    level = flat.div(budget, rounding_mode="floor")  # d - 1
    code = codes.view(num_reqs, max_depth * budget).gather(1, flat)
    # Column c + 1 of `position` holds the node position of entry c; column 0 is the root,
    # where depth-1 entries (negative before the clamp) point.
    parent_col = ((level - 1) * budget + code.div(k, rounding_mode="floor") + 1).clamp(min=0)
    position = torch.zeros(num_reqs, max_depth * budget + 1, dtype=torch.int64, device=device)
    position.scatter_(1, flat + 1, torch.arange(1, budget + 1, device=device).expand(num_reqs, -1))
    parents = torch.where(valid, position.gather(1, parent_col), 0)  # column 0: the root
    tokens = top_ids.view(num_reqs, max_depth * k).gather(1, level * k + code.remainder(k))
    tokens = torch.cat([root_tokens.to(torch.int64)[:, None], torch.where(valid, tokens, 0)], dim=1)
    parents = F.pad(parents, (1, 0))
    return preorder_layout(DDTree(
        tokens=tokens,
        parents=parents,
        depths=F.pad(torch.where(valid, level + 1, 0), (1, 0)),
        valid=F.pad(valid, (1, 0), value=True),
        ancestor_mask=ancestor_mask_from_parents(parents, max_depth),
        num_nodes=valid.sum(dim=1),
    ))


def select_prefixes(
    top_vals: torch.Tensor,  # [num_reqs, max_depth, k] float32 <= 0, sorted descending per depth
    budget: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depth by depth, every node that is among the `budget` best prefixes of depth <= d.

    Returns, per depth d and slot s (lexicographic order inside a depth; empty slots last):
    scores [num_reqs, max_depth, budget] (-inf: empty), codes [num_reqs, max_depth, budget]
    (l * k + r: rank r under parent slot l of depth d - 1), and bound [num_reqs, 1], the order
    key of the budget-th best prefix overall: the tree is every node with key <= bound.

    Order key = |score| bits, depth, code: as integers in the total order, unique per prefix.
    A depth-d prefix among the best of depth <= d has its parent among the best of depth
    <= d - 1, so the children of the kept depth-(d-1) nodes are the only new candidates."""
    num_reqs, max_depth, k = top_vals.shape
    device = top_vals.device
    lex_bits, shift = key_bits(budget, max_depth, k)
    codes_all = torch.arange((budget + 1) * k, device=device)  # child code l * k + r: lex order
    best = torch.full((num_reqs, budget), KEY_NONE, dtype=torch.int64, device=device)
    # Depth d - 1 scores in lex order, then one -inf slot: the code of its first child
    # (`none`) marks an empty slot, and gathers through it read -inf.
    frontier = F.pad(torch.zeros(num_reqs, 1, device=device), (0, 1), value=float("-inf"))
    scores, codes = [], []
    for d in range(1, max_depth + 1):
        width, none = frontier.shape[1] * k, (frontier.shape[1] - 1) * k
        child = (frontier[:, :, None] + top_vals[:, d - 1, None, :]).view(num_reqs, width)  # log P + log q_d
        child_key = torch.add(codes_all[:width] + (d << lex_bits), _score_mag(child), alpha=1 << shift)
        top_key, top_code = child_key.topk(min(budget, none), dim=1, largest=False, sorted=False)
        best = torch.cat([best, top_key], dim=1).topk(budget, dim=1, largest=False).values
        # Children among the best so far, in lex order. Once fewer than `budget` real prefixes
        # exist, empty (-inf) children are kept too; they sort last and are never selected.
        kept = torch.where(top_key <= best[:, -1:], top_code, none).sort(dim=1).values
        frontier = F.pad(child.gather(1, kept), (0, 1), value=float("-inf"))
        pad = budget - kept.shape[1]
        scores.append(F.pad(frontier[:, :-1], (0, pad), value=float("-inf")) if pad else frontier[:, :-1])
        codes.append(F.pad(kept, (0, pad), value=none) if pad else kept)
    bound = best[:, -1:].clamp(max=(INF_MAG << shift) - 1)  # never an empty slot
    return torch.stack(scores, dim=1), torch.stack(codes, dim=1), bound


def key_bits(budget: int, max_depth: int, k: int) -> tuple[int, int]:
    """(code bits, code + depth bits) of the int64 order keys; raises if they do not fit."""
    lex_bits = ((budget + 1) * k).bit_length()  # codes l * k + r < (budget + 1) * k
    depth_bits = max_depth.bit_length()
    if MAG_BITS + depth_bits + lex_bits > 62:
        raise ValueError(
            f"budget={budget} with topk={k} and max_depth={max_depth} is too large for 62-bit "
            f"order keys; budget * topk must stay below 2**{62 - MAG_BITS - depth_bits}"
        )
    return lex_bits, depth_bits + lex_bits


def _triton_fits(budget: int, max_depth: int) -> bool:
    from vllm_ddtree.kernels.tree import triton_supports

    return triton_supports(budget, max_depth)


def _score_mag(score: torch.Tensor) -> torch.Tensor:
    """|score| bits as int32 (score <= 0, float32): increasing as the score decreases;
    -0.0 and 0.0 map to 0, -inf to INF_MAG. Callers combine them in int64."""
    return score.contiguous().view(torch.int32) & 0x7FFFFFFF


def ancestor_mask_from_parents(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[num_reqs, n, n] bool, [r, i, j] = j is ancestor-or-self of i.

    Pointer doubling: chain[..., t] = parent^t(i) for t < m, hop = parent^m; one doubling
    extends the chain by chain[hop] (parent^(m + t) = parent^t(parent^m)). The root is its
    own parent, so chains end on it; depth <= max_depth, so max_depth + 1 columns suffice."""
    num_reqs, n = parents.shape
    chain = torch.arange(n, device=parents.device).expand(num_reqs, n)[..., None]
    hop = parents
    while chain.shape[2] <= max_depth:
        m = chain.shape[2]
        chain = torch.cat([chain, chain.gather(1, hop[..., None].expand(-1, -1, m))], dim=2)
        if chain.shape[2] <= max_depth:
            hop = hop.gather(1, hop)
    mask = torch.zeros(num_reqs, n, n, dtype=torch.bool, device=parents.device)
    return mask.scatter_(2, chain, True)


def _check_args(
    draft_logprobs: torch.Tensor, root_tokens: torch.Tensor, budget: int, topk_cap: int | None
) -> None:
    if draft_logprobs.dim() != 3 or min(draft_logprobs.shape[1:]) < 1:
        raise ValueError(
            f"draft_logprobs must be [num_reqs, max_depth >= 1, vocab >= 1], "
            f"got {tuple(draft_logprobs.shape)}"
        )
    if root_tokens.shape != draft_logprobs.shape[:1]:
        raise ValueError(
            f"root_tokens must be [num_reqs={draft_logprobs.shape[0]}], got {tuple(root_tokens.shape)}"
        )
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")
    if topk_cap is not None and (not isinstance(topk_cap, int) or topk_cap < 1):
        raise ValueError(f"topk_cap must be None or an int >= 1, got {topk_cap!r}")
