"""walk_tree against a plain-Python walk, the chain format, and losslessness in distribution."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.ops.tree import build_ddtree
from vllm_ddtree.ops.walk import walk_tree
from vllm_ddtree.tensors import DDTree, WalkResult

BUDGETS = [1, 3, 7, 8, 15, 16, 17, 31, 63]
DEPTHS = [3, 7, 15]


def random_tree(num_reqs: int, depth: int, vocab: int, budget: int, cap, gen) -> DDTree:
    logits = 3.0 * torch.randn(num_reqs, depth, vocab, generator=gen)
    roots = torch.randint(0, vocab, (num_reqs,), generator=gen)
    return build_ddtree(logits.log_softmax(-1), roots, budget, cap)


def deep_targets(tree: DDTree, vocab: int, gen, p_follow: float = 0.8) -> torch.Tensor:
    """Target token per node: one of the node's children's tokens with prob p_follow."""
    num_reqs, n = tree.tokens.shape
    target = torch.randint(0, vocab, (num_reqs, n), generator=gen)
    for r in range(num_reqs):
        kids: dict[int, list[int]] = {}
        for i in range(1, tree.num_nodes[r].item() + 1):
            kids.setdefault(tree.parents[r, i].item(), []).append(tree.tokens[r, i].item())
        for i, toks in kids.items():
            if torch.rand((), generator=gen).item() < p_follow:
                target[r, i] = toks[torch.randint(0, len(toks), (), generator=gen).item()]
    return target


def ref_walk(tree: DDTree, target: torch.Tensor, r: int, max_depth: int) -> tuple[list[int], int]:
    cur, path = 0, [0]
    for _ in range(max_depth):
        nxt = [
            i
            for i in range(1, tree.budget + 1)
            if tree.valid[r, i] and tree.parents[r, i] == cur and tree.tokens[r, i] == target[r, cur]
        ]
        assert len(nxt) <= 1  # siblings carry distinct tokens
        if not nxt:
            break
        cur = nxt[0]
        path.append(cur)
    return path, target[r, cur].item()


def check_walk(tree: DDTree, target: torch.Tensor, walk: WalkResult, max_depth: int) -> None:
    num_reqs, n = tree.tokens.shape
    assert walk.accepted_nodes.shape == (num_reqs, max_depth + 1)
    assert walk.output_tokens.shape == (num_reqs, n)
    for r in range(num_reqs):
        path, bonus = ref_walk(tree, target, r, max_depth)
        k = len(path) - 1
        assert walk.accepted_nodes[r].tolist() == path + [-1] * (max_depth - k)
        assert walk.num_accepted[r].item() == k <= min(tree.budget, max_depth)
        assert walk.bonus_tokens[r].item() == bonus
        chain = [tree.tokens[r, i].item() for i in path[1:]] + [bonus]
        assert walk.output_tokens[r].tolist() == chain + [-1] * (n - k - 1)


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_walk_matches_python_walk(budget: int, depth: int):
    gen = torch.Generator().manual_seed(100 * budget + depth)
    total = 0
    for cap in (2, None):
        tree = random_tree(6, depth, 8, budget, cap, gen)
        target = deep_targets(tree, 8, gen)
        walk = walk_tree(tree, target, depth)
        check_walk(tree, target, walk, depth)
        total += walk.num_accepted.sum().item()
    assert budget < 3 or total > 6  # the biased targets do reach below depth 1


def test_walk_stops_at_max_depth_and_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(7)
    tree = random_tree(4, 7, 8, 31, 1, gen)  # top-1 chain of depth 7
    target = deep_targets(tree, 8, gen, p_follow=1.0)  # follows the chain to the end
    walk = walk_tree(tree, target, 7)
    assert walk.num_accepted.tolist() == [7] * 4
    check_walk(tree, target, walk, 7)
    with pytest.raises(ValueError, match="target_tokens"):
        walk_tree(tree, target[:, :-1], 7)
    with pytest.raises(ValueError, match="max_depth"):
        walk_tree(tree, target, 0)


# --- Losslessness: sample-and-match reproduces the target's distribution -------------

VOCAB = 4


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; p = Q(df / 2, x / 2) (regularised upper gamma)."""
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    df = torch.tensor((counts.numel() - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, stat / 2).item()


def generate(table: torch.Tensor, num_reqs: int, rounds: int, gen, honest: bool = True) -> torch.Tensor:
    """`rounds` DDTree steps from root token 0 under the Markov target p(x | last) = table;
    returns the emitted tokens [num_reqs, rounds] (first `rounds` of each sequence)."""
    roots = torch.zeros(num_reqs, dtype=torch.int64)
    emitted: list[torch.Tensor] = []
    for _ in range(rounds):
        drafter = (2.0 * torch.randn(num_reqs, 3, VOCAB, generator=gen)).log_softmax(-1)
        tree = build_ddtree(drafter, roots, budget=6)
        # Target sample at every node, conditioned on that node's own last token (its path).
        last = tree.tokens if honest else roots[:, None].expand_as(tree.tokens)
        probs = table[last].reshape(-1, VOCAB)
        target = torch.multinomial(probs, 1, generator=gen).reshape(tree.tokens.shape)
        walk = walk_tree(tree, target, max_depth=3)
        emitted.append(walk.output_tokens)
        roots = walk.bonus_tokens
    seq = torch.cat(emitted, dim=1)  # -1 padding between steps
    # First `rounds` real tokens per row: stable-sort padding to the back.
    order = torch.argsort((seq < 0).to(torch.int8), dim=1, stable=True)
    return seq.gather(1, order)[:, :rounds]


def test_sample_and_match_preserves_target_distribution():
    gen = torch.Generator().manual_seed(0)
    table = (0.8 * torch.randn(VOCAB, VOCAB, generator=gen)).softmax(-1)  # p(x_t | x_{t-1})
    first = table[0]  # root token 0
    joint = first[:, None] * table  # p(x_1, x_2)
    third = joint.sum(0) @ table  # p(x_3)

    seq = generate(table, 20000, rounds=3, gen=gen)
    pair = torch.bincount(seq[:, 0] * VOCAB + seq[:, 1], minlength=VOCAB**2)
    p_first = chi_square_pvalue(torch.bincount(seq[:, 0], minlength=VOCAB), first)
    p_pair = chi_square_pvalue(pair, joint.flatten())
    p_third = chi_square_pvalue(torch.bincount(seq[:, 2], minlength=VOCAB), third)
    # Fixed seed, so deterministic; under H0 each p-value is uniform, 1e-3 is generous.
    assert min(p_first, p_pair, p_third) > 1e-3, (p_first, p_pair, p_third)

    # Power check: targets sampled at the wrong prefix (the root's) must be caught.
    bad = generate(table, 20000, rounds=3, gen=gen, honest=False)
    bad_pair = torch.bincount(bad[:, 0] * VOCAB + bad[:, 1], minlength=VOCAB**2)
    assert chi_square_pvalue(bad_pair, joint.flatten()) < 1e-6
