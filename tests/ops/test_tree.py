"""build_ddtree against a brute-force oracle, the paper's best-first heap, and invariants."""

from __future__ import annotations

import heapq
import itertools
import random

import numpy as np
import pytest
import torch

from vllm_ddtree.ops import tree as tree_mod
from vllm_ddtree.ops.tree import LOGPROB_FLOOR, build_ddtree
from vllm_ddtree.tensors import DDTree

BUDGETS = [1, 3, 7, 8, 15, 16, 17, 31, 63]
DEPTHS = [3, 7, 15]  # DFlash block sizes 4, 8, 16
CAPS = [1, 2, 4, None]
KINDS = ["random", "ties", "neginf", "onehot", "uniform"]


def make_logprobs(kind: str, num_reqs: int, depth: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Drafter log-probs [num_reqs, depth, vocab] with the hard cases: ties, -inf, one-hot."""
    shape = (num_reqs, depth, vocab)
    if kind == "random":
        logits = 2.0 * torch.randn(shape, generator=gen)
    elif kind == "ties":  # few distinct values: many equal log-probs and equal prefix scores
        logits = torch.randint(0, 3, shape, generator=gen).float()
    elif kind == "neginf":  # zero-probability tokens (at least one finite per row)
        logits = torch.randn(shape, generator=gen)
        logits[torch.rand(shape, generator=gen) < 0.6] = float("-inf")
        logits[..., 0] = 0.0
    elif kind == "onehot":  # log q = 0 for one token, -inf elsewhere
        logits = torch.full(shape, float("-inf"))
        logits.scatter_(2, torch.randint(0, vocab, (*shape[:2], 1), generator=gen), 0.0)
    else:  # uniform: every prefix of a depth ties
        logits = torch.zeros(shape)
    return logits.log_softmax(dim=-1)


def clamp_edge_logprobs(num_reqs: int, depth: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Unnormalised values on both sides of the clamp (> 0, +-0, the floor, below it, -inf):
    clamping merges them into ties the top-k and the order must still break exactly."""
    values = torch.tensor([0.5, 2.0, 0.0, -0.0, -1.0, -2.0, LOGPROB_FLOOR, -3e30, float("-inf")])
    return values[torch.randint(0, len(values), (num_reqs, depth, vocab), generator=gen)]


def ref_topk(lp_row: np.ndarray, k: int) -> list[int]:
    """Token ids ordered by (log-prob desc, id asc), first k."""
    return sorted(range(len(lp_row)), key=lambda t: (-lp_row[t], t))[:k]


def ref_setup(lp: torch.Tensor, budget: int, cap: int | None):
    """Clamped float32 log-probs, K, and per-depth top-K (ids, values) for one request."""
    clamped = lp.float().clamp(LOGPROB_FLOOR, 0.0).numpy()
    k = min(budget, cap or budget, lp.shape[-1])
    ids = [ref_topk(row, k) for row in clamped]
    vals = [[clamped[d][t] for t in ids[d]] for d in range(len(ids))]
    return k, ids, vals


def prefix_score(vals: list[list[np.float32]], ranks: tuple[int, ...]) -> np.float32:
    score = np.float32(0.0)
    for d, r in enumerate(ranks):  # float32, root to leaf: the library's accumulation order
        score = np.float32(score + vals[d][r])
    return score


def brute_force(lp: torch.Tensor, budget: int, cap: int | None) -> list[tuple[int, ...]]:
    """Every prefix, sorted by (score desc, depth asc, ranks asc); the first `budget`."""
    k, _, vals = ref_setup(lp, budget, cap)
    prefixes = [
        ranks for d in range(1, lp.shape[0] + 1) for ranks in itertools.product(range(k), repeat=d)
    ]
    prefixes.sort(key=lambda rk: (-prefix_score(vals, rk), len(rk), rk))
    return prefixes[:budget]


def best_first(lp: torch.Tensor, budget: int, cap: int | None) -> list[tuple[int, ...]]:
    """The paper's max-heap: each pop adds a node, pushes its next sibling and first child."""
    k, _, vals = ref_setup(lp, budget, cap)
    depth = lp.shape[0]
    heap = [(-prefix_score(vals, (0,)), 1, (0,))]
    out: list[tuple[int, ...]] = []
    while heap and len(out) < budget:
        _, d, ranks = heapq.heappop(heap)
        out.append(ranks)
        if ranks[-1] + 1 < k:
            sib = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(heap, (-prefix_score(vals, sib), d, sib))
        if d + 1 <= depth:
            child = ranks + (0,)
            heapq.heappush(heap, (-prefix_score(vals, child), d + 1, child))
    return out


def expected_layout(lp, root: int, budget: int, cap, selected) -> dict[str, list]:
    """The library's documented layout for a selected set: preorder with siblings by
    rank, which is the lexicographic order of the rank tuples (a prefix first)."""
    _, ids, _ = ref_setup(lp, budget, cap)
    nodes = [()] + sorted(selected)
    index = {ranks: i for i, ranks in enumerate(nodes)}
    pad = budget + 1 - len(nodes)
    return {
        "tokens": [root] + [ids[len(rk) - 1][rk[-1]] for rk in nodes[1:]] + [0] * pad,
        "parents": [0] + [index[rk[:-1]] for rk in nodes[1:]] + [0] * pad,
        "depths": [len(rk) for rk in nodes] + [0] * pad,
        "valid": [True] * len(nodes) + [False] * pad,
    }


def check_layout(tree: DDTree, r: int, want: dict[str, list]) -> None:
    for name, values in want.items():
        assert getattr(tree, name)[r].tolist() == values, name


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    chain = {i}
    while i != 0:
        i = parents[i]
        chain.add(i)
    return chain


def check_invariants(tree: DDTree, lp: torch.Tensor, roots: torch.Tensor, budget: int, cap) -> None:
    num_reqs, depth, vocab = lp.shape
    n = budget + 1
    for name in ("tokens", "parents", "depths"):
        t = getattr(tree, name)
        assert t.dtype == torch.int64 and t.shape == (num_reqs, n), name
    assert tree.valid.dtype == torch.bool and tree.ancestor_mask.shape == (num_reqs, n, n)
    assert tree.budget == budget
    k = min(budget, cap or budget, vocab)
    avail = sum(k**d for d in range(1, depth + 1))
    assert tree.num_nodes.tolist() == [min(budget, avail)] * num_reqs
    for r in range(num_reqs):
        tokens, parents = tree.tokens[r].tolist(), tree.parents[r].tolist()
        depths, valid = tree.depths[r].tolist(), tree.valid[r].tolist()
        m = tree.num_nodes[r].item()
        assert valid == [True] * (m + 1) + [False] * (budget - m)  # padding trails
        assert tokens[0] == roots[r].item() and parents[0] == 0 and depths[0] == 0
        _, ids, _ = ref_setup(lp[r], budget, cap)
        children: dict[int, list[int]] = {}
        for i in range(1, m + 1):
            p = parents[i]
            assert p < i and depths[i] == depths[p] + 1 <= depth  # parents first, depth <= L
            assert p in ancestors_or_self(parents, i - 1)  # preorder: under the node before
            assert tokens[i] in ids[depths[i] - 1]  # within the top-k cap
            children.setdefault(p, []).append(tokens[i])
        assert all(len(c) == len(set(c)) for c in children.values())  # distinct siblings
        for i in range(m + 1, n):
            assert (tokens[i], parents[i], depths[i]) == (0, 0, 0)
        for i in range(n):  # ancestor mask = chain of parents (padding: root + self)
            want, j = {i}, i
            while j != 0:
                j = parents[j]
                want.add(j)
            want.add(0)
            assert set(torch.nonzero(tree.ancestor_mask[r, i]).flatten().tolist()) == want


def test_brute_force_oracle_random_small_cases():
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for case in range(240):
        kind = KINDS[case % len(KINDS)]
        vocab, depth = rng.randint(5, 7), rng.randint(1, 4)
        budget, cap = rng.choice(BUDGETS), rng.choice(CAPS)
        lp = make_logprobs(kind, 2, depth, vocab, gen)
        roots = torch.randint(0, vocab, (2,), generator=gen)
        tree = build_ddtree(lp, roots, budget, cap)
        check_invariants(tree, lp, roots, budget, cap)
        for r in range(2):
            want = brute_force(lp[r], budget, cap)
            check_layout(tree, r, expected_layout(lp[r], roots[r].item(), budget, cap, want))


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_matches_best_first_heap(budget: int, depth: int):
    gen = torch.Generator().manual_seed(1000 * budget + depth)
    for i, cap in enumerate(CAPS):
        kind = KINDS[(budget + depth + i) % len(KINDS)]
        vocab = [6, 40][i % 2]  # vocab 40 lets K reach the budget
        lp = make_logprobs(kind, 3, depth, vocab, gen)
        roots = torch.randint(0, vocab, (3,), generator=gen)
        tree = build_ddtree(lp, roots, budget, cap)
        check_invariants(tree, lp, roots, budget, cap)
        for r in range(3):
            want = best_first(lp[r], budget, cap)
            check_layout(tree, r, expected_layout(lp[r], roots[r].item(), budget, cap, want))


def test_topk_per_depth_ties_and_chunking(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    lp = torch.randint(-3, 1, (3, 5, 9), generator=gen).float()  # heavy ties
    lp[0, 0] = -0.0  # -0.0 == 0.0: one tie class
    vals, ids = tree_mod.topk_per_depth(lp, 4)
    for r, d in itertools.product(range(3), range(5)):
        want = ref_topk(lp[r, d].numpy(), 4)
        assert ids[r, d].tolist() == want and vals[r, d].tolist() == lp[r, d, want].tolist()
    monkeypatch.setattr(tree_mod, "TOPK_CHUNK_ELEMS", 1)  # one depth per chunk
    assert torch.equal(tree_mod.topk_per_depth(lp, 4)[1], ids)


def test_one_hot_drafter_gives_the_greedy_chain_first():
    # log q = 0 on one token per depth: the chain of argmax tokens must be the top prefixes.
    lp = make_logprobs("onehot", 1, 7, 11, torch.Generator().manual_seed(3))
    tree = build_ddtree(lp, torch.tensor([5]), budget=7)
    assert tree.tokens[0, 1:].tolist() == lp[0].argmax(-1).tolist()
    assert tree.parents[0].tolist() == [0, 0, 1, 2, 3, 4, 5, 6]


def preorder_oracle(parents: list[int], num_valid: int) -> list[int]:
    """Old index of each new node: an explicit depth-first walk (children by index), then
    the padding nodes in their order."""
    children: dict[int, list[int]] = {}
    for i in range(1, num_valid):
        children.setdefault(parents[i], []).append(i)
    order, stack = [], [0]
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(reversed(children.get(v, [])))
    return order + list(range(num_valid, len(parents)))


@pytest.mark.parametrize("n", [1, 2, 9, 33, 130])
def test_preorder_layout_renumbers_any_tree_depth_first(n: int):
    rng = random.Random(n)
    num_reqs, max_depth = 3, 6
    parents, depths, valid = [], [], []
    for r in range(num_reqs):
        num_valid = n if r == 0 else rng.randint(1, n)  # the rest: padding (root children)
        par, dep = [0], [0]
        for i in range(1, n):
            p = rng.choice([j for j in range(i) if dep[j] < max_depth]) if i < num_valid else 0
            par.append(p)
            dep.append(dep[p] + 1 if i < num_valid else 0)
        parents.append(par)
        depths.append(dep)
        valid.append([i < num_valid for i in range(n)])
    parents_t = torch.tensor(parents)
    tokens = torch.randint(0, 1000, (num_reqs, n), generator=torch.Generator().manual_seed(n))
    tree = DDTree(
        tokens=tokens, parents=parents_t, depths=torch.tensor(depths), valid=torch.tensor(valid),
        ancestor_mask=tree_mod.ancestor_mask_from_parents(parents_t, max_depth),
        num_nodes=torch.tensor(valid).sum(1) - 1,
    )
    out = tree_mod.preorder_layout(tree)
    for r in range(num_reqs):
        order = preorder_oracle(parents[r], sum(valid[r]))
        new_of = {old: new for new, old in enumerate(order)}
        assert out.tokens[r].tolist() == [tokens[r, i].item() for i in order]
        assert out.depths[r].tolist() == [depths[r][i] for i in order]
        assert out.valid[r].tolist() == [valid[r][i] for i in order]
        assert out.parents[r].tolist() == [new_of[parents[r][i]] for i in order]
        for new, old in enumerate(order):  # the mask follows its nodes
            want = {new_of[j] for j in torch.nonzero(tree.ancestor_mask[r, old]).flatten().tolist()}
            assert set(torch.nonzero(out.ancestor_mask[r, new]).flatten().tolist()) == want
    assert torch.equal(out.num_nodes, tree.num_nodes)


def test_preorder_puts_the_greedy_chain_first():
    # Two confident depths then a spread: nodes 1.. are the best token's best descendants.
    lp = torch.full((1, 4, 6), -9.0)
    lp[0, :, 2], lp[0, :, 4] = -0.05, -3.0
    tree = build_ddtree(lp.log_softmax(-1), torch.tensor([1]), budget=9, topk_cap=2)
    assert tree.tokens[0, 1:5].tolist() == [2, 2, 2, 2]
    assert tree.parents[0, :5].tolist() == [0, 0, 1, 2, 3]


def test_fewer_prefixes_than_budget_pads():
    lp = torch.randn(2, 3, 2).log_softmax(-1)  # 2 + 4 + 8 = 14 prefixes
    tree = build_ddtree(lp, torch.tensor([1, 0]), budget=20)
    assert tree.num_nodes.tolist() == [14, 14]
    assert not tree.valid[:, 15:].any() and (tree.tokens[:, 15:] == 0).all()


def test_rejects_bad_arguments():
    lp = torch.zeros(1, 3, 4)
    with pytest.raises(ValueError, match="budget"):
        build_ddtree(lp, torch.zeros(1, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="topk_cap"):
        build_ddtree(lp, torch.zeros(1, dtype=torch.int64), 4, topk_cap=0)
    with pytest.raises(ValueError, match="root_tokens"):
        build_ddtree(lp, torch.zeros(2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="draft_logprobs"):
        build_ddtree(torch.zeros(1, 0, 4), torch.zeros(1, dtype=torch.int64), 4)


def test_clamp_edges_match_brute_force():
    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    for _ in range(120):
        vocab, depth = rng.randint(2, 7), rng.randint(1, 4)
        budget, cap = rng.choice(BUDGETS), rng.choice(CAPS)
        lp = clamp_edge_logprobs(2, depth, vocab, gen)
        roots = torch.randint(0, vocab, (2,), generator=gen)
        tree = build_ddtree(lp, roots, budget, cap)
        check_invariants(tree, lp, roots, budget, cap)
        for r in range(2):
            want = brute_force(lp[r], budget, cap)
            check_layout(tree, r, expected_layout(lp[r], roots[r].item(), budget, cap, want))


@pytest.mark.parametrize("depth", [40, 63])  # DFlash block sizes up to MAX_BLOCK_SIZE = 64
def test_deep_trees_match_best_first_heap(depth: int):
    gen = torch.Generator().manual_seed(depth)
    for i, (budget, kind) in enumerate(itertools.product([17, 100], ["onehot", "uniform", "ties"])):
        cap = [None, 2][i % 2]
        lp = make_logprobs(kind, 2, depth, 5, gen)
        roots = torch.randint(0, 5, (2,), generator=gen)
        tree = build_ddtree(lp, roots, budget, cap)
        check_invariants(tree, lp, roots, budget, cap)
        for r in range(2):
            want = best_first(lp[r], budget, cap)
            check_layout(tree, r, expected_layout(lp[r], roots[r].item(), budget, cap, want))


@pytest.mark.parametrize("k", [1, 7, 64])
def test_topk_per_depth_ties_straddling_the_kth_value(k: int, monkeypatch):
    # Many exact copies of a value near rank k: torch.topk may keep any of them, the
    # result must keep the lowest ids. Clamp edges add ties torch.topk never sees.
    gen = torch.Generator().manual_seed(k)
    lp = torch.randn(2, 3, 3000, generator=gen)
    tied = lp.topk(max(1, k // 2), dim=-1).values[..., -1:]
    lp.scatter_(2, torch.randint(0, 3000, (2, 3, 500), generator=gen), tied.expand(-1, -1, 500))
    lp[1, 2] = clamp_edge_logprobs(1, 1, 3000, gen)[0, 0]
    clamped = lp.clamp(LOGPROB_FLOOR, 0.0)
    vals, ids = tree_mod.topk_per_depth(lp, k)
    for r, d in itertools.product(range(2), range(3)):
        want = ref_topk(clamped[r, d].numpy(), k)
        assert ids[r, d].tolist() == want and vals[r, d].tolist() == clamped[r, d, want].tolist()
    monkeypatch.setattr(tree_mod, "TOPK_CHUNK_ELEMS", 3000 * 2 * 2)  # two depths per chunk
    assert torch.equal(tree_mod.topk_per_depth(lp, k)[1], ids)


@pytest.mark.parametrize("max_depth", [1, 2, 3, 15, 16, 17, 63])
def test_ancestor_mask_of_a_full_depth_chain(max_depth: int):
    # A chain root -> 1 -> ... -> max_depth (the deepest a node can be), then padding.
    n = max_depth + 3
    parents = torch.tensor([[0] + list(range(max_depth)) + [0, 0]])
    mask = tree_mod.ancestor_mask_from_parents(parents, max_depth)[0]
    for i in range(n):
        want = set(range(i + 1)) if i <= max_depth else {0, i}
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == want


def test_order_keys_refuse_to_overflow():
    with pytest.raises(ValueError, match="62-bit order keys"):
        tree_mod.key_bits(budget=1 << 20, max_depth=63, k=1 << 20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("budget", [7, 16, 17])
def test_cuda_graph_capture_matches_eager(budget: int, use_triton: bool):
    from vllm_ddtree.ops.walk import walk_tree

    num_reqs, depth, vocab, dev = 5, 7, 1000, torch.device("cuda")
    gen = torch.Generator().manual_seed(budget)
    lp = torch.zeros(num_reqs, depth, vocab, device=dev)
    roots = torch.zeros(num_reqs, dtype=torch.int64, device=dev)
    target = torch.zeros(num_reqs, budget + 1, dtype=torch.int64, device=dev)

    def step():
        tree = build_ddtree(lp, roots, budget, topk_cap=4, use_triton=use_triton)
        return tree, walk_tree(tree, target, depth)

    def new_inputs(kind: str) -> None:
        lp.copy_(make_logprobs(kind, num_reqs, depth, vocab, gen))
        roots.copy_(torch.randint(0, vocab, (num_reqs,), generator=gen))
        tree = build_ddtree(lp, roots, budget, topk_cap=4, use_triton=use_triton)  # eager
        child_tok = torch.zeros(num_reqs, budget + 2, dtype=torch.int64, device=dev)
        child_tok.scatter_(1, torch.where(tree.valid, tree.parents, budget + 1), tree.tokens)
        noise = torch.randint(0, vocab, target.shape, generator=gen).to(dev)
        keep = torch.rand(target.shape, generator=gen).to(dev) < 0.8
        target.copy_(torch.where(keep, child_tok[:, : budget + 1], noise))

    new_inputs("random")
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the eager path raises
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_tree, g_walk = step()
    for kind in KINDS:
        new_inputs(kind)
        graph.replay()
        e_tree, e_walk = step()
        for name in ("tokens", "parents", "depths", "valid", "ancestor_mask", "num_nodes"):
            assert torch.equal(getattr(g_tree, name), getattr(e_tree, name)), name
        for name in ("accepted_nodes", "num_accepted", "bonus_tokens", "output_tokens"):
            assert torch.equal(getattr(g_walk, name), getattr(e_walk, name)), name
