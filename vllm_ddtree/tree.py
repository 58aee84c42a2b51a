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
- Node order: column 0 is the root (bonus token); then depth-major (all depth-1 nodes,
  then depth 2, ...), inside a depth by the total order above. Parents precede children.
- If fewer than `budget` prefixes exist (sum_{d=1..L} K^d < budget) every prefix is taken
  and the trailing columns are padding: valid False, token 0, parent 0, depth 0; a padding
  row's ancestor_mask holds only the root and itself, so it attends to real context only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOGPROB_FLOOR = -1e30  # finite stand-in for log(0); keeps zero-probability prefixes orderable
TOPK_CHUNK_ELEMS = 1 << 25  # vocab entries per top-k chunk: bounds its transient memory
DEPTH, PARENT, RANK, LEXKEY = range(4)  # columns of select_prefixes' node meta


@dataclass
class DDTree:
    tokens: torch.Tensor  # [num_reqs, budget + 1] int64; column 0 = root (bonus token)
    parents: torch.Tensor  # [num_reqs, budget + 1] int64; parents[:, 0] = 0; parents[:, i] < i
    depths: torch.Tensor  # [num_reqs, budget + 1] int64; root 0, valid node >= 1, padding 0
    valid: torch.Tensor  # [num_reqs, budget + 1] bool; root True, padding False
    ancestor_mask: torch.Tensor  # [num_reqs, budget + 1, budget + 1] bool; [r, i, j]: j ancestor-or-self of i
    num_nodes: torch.Tensor  # [num_reqs] int64; valid nodes besides the root (<= budget)

    @property
    def budget(self) -> int:
        return self.tokens.shape[1] - 1


def build_ddtree(
    draft_logprobs: torch.Tensor,  # [num_reqs, max_depth, vocab]; row d = log q_{d+1}
    root_tokens: torch.Tensor,  # [num_reqs]
    budget: int,
    topk_cap: int | None = None,
) -> DDTree:
    """Build the tree of the `budget` most probable draft prefixes for every request."""
    _check_args(draft_logprobs, root_tokens, budget, topk_cap)
    num_reqs, max_depth, vocab = draft_logprobs.shape
    n = budget + 1
    k = min(budget, topk_cap if topk_cap is not None else budget, vocab)
    logprobs = draft_logprobs.float().clamp(LOGPROB_FLOOR, 0.0)
    top_vals, top_ids = topk_per_depth(logprobs, k)  # [num_reqs, max_depth, k] each

    score, meta = select_prefixes(top_vals, budget)
    depth, parent, rank = meta[..., DEPTH], meta[..., PARENT], meta[..., RANK]
    valid = score > float("-inf")  # root score is 0, padding -inf

    # Depth-major order; stable, so each depth keeps the total order. Padding goes last.
    key = torch.where(valid, depth, max_depth + 1)
    perm = torch.argsort(key, dim=1, stable=True)  # new index -> old; perm[:, 0] = 0 (root)
    inv = torch.empty_like(perm).scatter_(1, perm, torch.arange(n, device=perm.device).expand_as(perm))
    valid = valid.gather(1, perm)
    depth = torch.where(valid, depth.gather(1, perm), 0)
    parent = torch.where(valid, inv.gather(1, parent.gather(1, perm)), 0)
    rank = rank.gather(1, perm)

    # token = top_ids[depth - 1, rank]; the root carries the bonus token.
    flat = (depth - 1).clamp(min=0) * k + rank
    tokens = top_ids.reshape(num_reqs, max_depth * k).gather(1, flat)
    tokens = torch.where(valid, tokens, 0)
    tokens[:, 0] = root_tokens.to(torch.int64)
    return DDTree(
        tokens=tokens,
        parents=parent,
        depths=depth,
        valid=valid,
        ancestor_mask=ancestor_mask_from_parents(parent, max_depth),
        num_nodes=valid[:, 1:].sum(dim=1),
    )


def topk_per_depth(
    logprobs: torch.Tensor,  # [num_reqs, max_depth, vocab] float32, no NaN
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values, ids) per depth, ordered by (value desc, id asc); deterministic on ties.

    torch.topk's choice among values tied with the k-th is unspecified, so a second topk on
    an int32 key with unique tied entries picks the canonical set: every value above the
    k-th value, then the lowest ids among those equal to it."""
    num_reqs, max_depth, vocab = logprobs.shape
    ids = torch.arange(vocab, device=logprobs.device, dtype=torch.int32)
    step = max(1, TOPK_CHUNK_ELEMS // max(1, num_reqs * vocab))  # depths per chunk
    chosen = []
    for d in range(0, max_depth, step):
        rows = logprobs[:, d : d + step]
        kth = rows.topk(k, dim=-1).values[..., k - 1 :]  # same value whichever tie topk keeps
        key = torch.where(rows > kth, vocab, torch.where(rows == kth, -ids, -vocab - 1))
        chosen.append(key.topk(k, dim=-1).indices)
    idx = torch.cat(chosen, dim=1).sort(dim=-1).values  # ids ascending ...
    vals, order = logprobs.gather(-1, idx).sort(dim=-1, descending=True, stable=True)
    return vals, idx.gather(-1, order)  # ... then values descending: (value desc, id asc)


def select_prefixes(
    top_vals: torch.Tensor,  # [num_reqs, max_depth, k] sorted descending per depth
    budget: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-`budget` prefixes in total order: score [num_reqs, budget + 1] (padding -inf)
    and meta [num_reqs, budget + 1, 4] = (depth, parent, rank, lexkey); column 0 = root."""
    num_reqs, max_depth, k = top_vals.shape
    n = budget + 1
    device = top_vals.device
    score = torch.full((num_reqs, n), float("-inf"), device=device)
    score[:, 0] = 0.0
    meta = torch.zeros(num_reqs, n, 4, dtype=torch.int64, device=device)
    slot = torch.arange(n * k, device=device)  # child slot l * k + r of the l-th frontier node
    # Children's (rank, lexkey) = (r, lexrank(parent) * k + r); depth and parent set per step.
    child_meta = torch.stack([slot * 0, slot * 0, slot % k, slot], dim=1)  # [n * k, 4]
    new_index = torch.arange(1, n, device=device).expand(num_reqs, -1)

    # Invariant after step d: columns 1.. hold the top-`budget` prefixes of depth <= d, sorted.
    # A depth-d prefix can only enter if its parent is in, so the frontier's children suffice.
    for d in range(1, max_depth + 1):
        frontier = (meta[..., DEPTH] == d - 1) & (score > float("-inf"))
        # Frontier in lexicographic rank-tuple order (lexkey order among same-depth nodes).
        order = torch.argsort(torch.where(frontier, meta[..., LEXKEY], n * k), dim=1, stable=True)
        par_score = torch.where(frontier.gather(1, order), score.gather(1, order), float("-inf"))
        child_score = par_score[:, :, None] + top_vals[:, d - 1, None, :]  # log P + log q_d
        kids = child_meta.repeat(num_reqs, 1, 1)
        kids[..., DEPTH] = d
        kids[..., PARENT] = order.repeat_interleave(k, dim=1)

        # Candidates = selected prefixes, then the children in lexicographic order; a stable
        # sort on score then realises (score desc, depth asc, rank tuple asc).
        cand_score = torch.cat([score[:, 1:], child_score.reshape(num_reqs, n * k)], dim=1)
        top = torch.sort(cand_score, dim=1, descending=True, stable=True).indices[:, :budget]
        chosen = torch.cat([meta[:, 1:], kids], dim=1).gather(1, top[..., None].expand(-1, -1, 4))

        # Old node index -> new node index for surviving selected nodes (root stays 0).
        remap = torch.zeros(num_reqs, n + 1, dtype=torch.int64, device=device)
        remap.scatter_(1, torch.where(top < budget, top + 1, n), new_index)  # column n: dump
        chosen[..., PARENT] = remap.gather(1, chosen[..., PARENT])
        score = torch.cat([score[:, :1], cand_score.gather(1, top)], dim=1)
        meta = torch.cat([meta[:, :1], chosen], dim=1)
    return score, meta


def ancestor_mask_from_parents(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[num_reqs, n, n] bool, [r, i, j] = j is ancestor-or-self of i (pointer chasing)."""
    num_reqs, n = parents.shape
    mask = torch.zeros(num_reqs, n, n, dtype=torch.bool, device=parents.device)
    cur = torch.arange(n, device=parents.device).expand(num_reqs, n)
    mask.scatter_(2, cur[..., None], True)  # self
    for _ in range(max_depth):  # depth <= max_depth, and the root is its own parent
        cur = parents.gather(1, cur)
        mask.scatter_(2, cur[..., None], True)
    return mask


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
