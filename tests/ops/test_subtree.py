"""ops/subtree.py against an independent oracle: a fresh build at the smaller budget."""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_tree import KINDS, clamp_edge_logprobs, make_logprobs
from vllm_ddtree.ops.subtree import best_subtree, node_logprobs, node_scores
from vllm_ddtree.ops.tree import build_ddtree
from vllm_ddtree.tensors import DDTree

FIELDS = ("tokens", "parents", "depths", "valid")


def assert_is_build(sub: DDTree, want: DDTree) -> None:
    """``sub`` (width n) holds ``want`` (width k + 1) in its first k + 1 columns, padding after."""
    width = want.tokens.shape[1]
    for field in FIELDS:
        got = getattr(sub, field)
        assert torch.equal(got[:, :width], getattr(want, field)), field
        assert not got[:, width:].bool().any(), f"{field} past the k nodes is not padding"
    assert torch.equal(sub.ancestor_mask[:, :width, :width], want.ancestor_mask)
    n = sub.tokens.shape[1]
    node = torch.arange(n)
    padding = (node[None, :] == node[:, None]) | (node[None, :] == 0)
    assert torch.equal(sub.ancestor_mask[:, width:], padding[width:].expand(len(sub.tokens), -1, -1))
    assert torch.equal(sub.num_nodes, want.num_nodes)


@pytest.mark.parametrize("kind", [*KINDS, "clamp_edges"])
@pytest.mark.parametrize("budget,depth,cap", [(16, 7, None), (16, 7, 4), (31, 3, 2), (12, 15, 1)])
def test_the_best_k_nodes_of_a_tree_are_the_tree_of_budget_k(kind, budget, depth, cap):
    gen = torch.Generator().manual_seed(budget * 31 + depth)
    num_reqs, vocab = 6, 40
    if kind == "clamp_edges":
        lp = clamp_edge_logprobs(num_reqs, depth, vocab, gen)
    else:
        lp = make_logprobs(kind, num_reqs, depth, vocab, gen)
    roots = torch.randint(0, vocab, (num_reqs,), generator=gen)
    full = build_ddtree(lp, roots, budget, cap)
    score = node_scores(full, lp)
    for k in range(1, budget):
        sub = best_subtree(full, score, k, depth)
        assert_is_build(sub, build_ddtree(lp, roots, k, cap))


def test_node_logprobs_are_the_clamped_terms_of_each_score():
    lp = torch.log_softmax(torch.randn(2, 3, 10), dim=-1)
    lp[0, 1, :] = float("-inf")
    lp[0, 1, 4] = 0.0
    tree = build_ddtree(lp, torch.tensor([1, 2]), 5)
    got = node_logprobs(tree, lp)
    for r in range(2):
        for i in range(6):
            if i == 0 or not tree.valid[r, i]:
                assert got[r, i] == 0
            else:
                d, t = int(tree.depths[r, i]), int(tree.tokens[r, i])
                assert got[r, i] == max(float(lp[r, d - 1, t]), -1e30)


def test_k_outside_the_tree_is_refused():
    lp = torch.log_softmax(torch.randn(1, 3, 10), dim=-1)
    tree = build_ddtree(lp, torch.tensor([0]), 4)
    for k in (0, 5):
        with pytest.raises(ValueError, match="k must be in 1..4"):
            best_subtree(tree, node_scores(tree, lp), k, 3)


def test_node_scores_sum_the_terms_along_each_path():
    lp = torch.log_softmax(torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(5)), -1)
    tree = build_ddtree(lp, torch.tensor([1, 2, 3]), 9)
    terms, got = node_logprobs(tree, lp), node_scores(tree, lp)
    for r in range(3):
        for i in range(10):
            path, j = [], i
            while j != 0:
                path.append(j)
                j = int(tree.parents[r, j])
            want = torch.zeros((), dtype=torch.float32)
            for j in reversed(path):  # root to leaf, in float32, as the build adds
                want = want + terms[r, j]
            assert got[r, i] == (want if tree.valid[r, i] else 0)


def _launches(fn) -> int:
    """Operators dispatched by ``fn()``: on a GPU, kernels launched one by one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_ranking_a_tree_takes_as_many_launches_at_any_depth():
    """best_subtree runs eagerly between replays, once per step of a smaller size; the
    per-depth work (the scores) belongs to the drafter's pass, which a graph holds."""
    counts = {}
    for depth in (3, 15):
        lp = torch.log_softmax(torch.randn(4, depth, 50), dim=-1)
        tree = build_ddtree(lp, torch.arange(4), 16)
        score = node_scores(tree, lp)
        counts[depth] = _launches(lambda: best_subtree(tree, score, 8, depth))  # noqa: B023
    assert counts[3] == counts[15], counts
