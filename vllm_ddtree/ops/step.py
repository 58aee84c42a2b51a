"""One DDTree step in plain torch, read top to bottom.

The engine runs these six lines spread over vLLM's model runner, with Triton kernels
on CUDA (runner/v1.py and runner/v2.py say where each line happens); this function is
their torch twin, and the tests' end-to-end oracle: a model decoded through it must
give exactly its plain greedy output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_ddtree.ops.compaction import compact_rows
from vllm_ddtree.ops.tree import build_ddtree
from vllm_ddtree.ops.walk import walk_tree
from vllm_ddtree.tensors import DDTree, WalkResult

# One target pass over the verify rows: (tokens, positions, ancestor masks), each
# [num_reqs, budget + 1] ([.., budget + 1] more for the masks) -> logits
# [num_reqs, budget + 1, vocab]. Row i attends to the request's prefix and to row j
# iff mask[r, i, j]; its KV goes to the cache row ``start + i``.
Verify = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepOutput:
    tree: DDTree  # [num_reqs, budget + 1] per field: what was verified
    walk: WalkResult  # accepted path, bonus token, output in chain format
    committed: list[list[int]]  # per request: accepted drafts, then the bonus token


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def ddtree_step(
    draft_logprobs: torch.Tensor,  # [num_reqs, max_depth, vocab]: row d is log q_{d+1}
    roots: torch.Tensor,  # [num_reqs] int64, the last committed (bonus) token
    start: torch.Tensor,  # [num_reqs] int64, the root's position
    verify: Verify,
    budget: int,
    topk_cap: int | None = None,
    sample: Callable[[torch.Tensor], torch.Tensor] = greedy,  # logits -> tokens
    rows: Sequence[torch.Tensor] = (),  # per-row state [num_reqs, max_rows, ...] (KV)
) -> StepOutput:
    num_reqs, max_depth, _ = draft_logprobs.shape
    # 1. draft: one drafter pass gave q_1..q_L, the marginals of depths 1..L (input).
    # 2. tree: the `budget` most probable prefixes under q_1 * .. * q_d, prefix-closed;
    #    node 0 is the root, nodes follow in preorder (parents before children).
    tree = build_ddtree(draft_logprobs, roots, budget, topk_cap, use_triton=False)
    # 3. verify: one target pass over root + nodes; siblings share a position
    #    (start + depth) and each row sees the prefix and its own ancestors.
    logits = verify(tree.tokens, start[:, None] + tree.depths, tree.ancestor_mask)
    # 4. the target's token at every node: argmax when greedy, a sample when T > 0.
    target = sample(logits)
    # 5. walk: from the root, move to the child carrying the target's token; the
    #    first token no child carries is the bonus. Each committed token is the
    #    target's own at its true prefix, so the output is the target's.
    walk = walk_tree(tree, target, max_depth, use_triton=False)
    # 6. compaction: the node accepted at depth d moves to row start + d (its KV was
    #    computed at position start + d already): a chain step with k accepted drafts.
    for state in rows:
        flat = state.view(num_reqs * state.shape[1], -1)  # in place: a view
        row_start = torch.arange(num_reqs, device=start.device) * state.shape[1] + start
        compact_rows([flat], walk.accepted_nodes, row_start, use_triton=False)
    k = walk.num_accepted.tolist()
    committed = [walk.output_tokens[r, : k[r] + 1].tolist() for r in range(num_reqs)]
    return StepOutput(tree=tree, walk=walk, committed=committed)
