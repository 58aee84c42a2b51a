"""vllm_ddtree/kernels/walk.py against its torch twin, ops.walk.walk_tree.

Every case builds fresh random trees (a fixed seed per case) with the drafters of
tests/ops/test_tree.py, over odd budgets, depths and batch sizes, some with padding nodes, and draws
target tokens that follow a random valid child with some probability and otherwise miss
(a token no child carries, the padding token 0, or any vocabulary token), so walks accept
nothing, part of the way, or the full depth. All four WalkResult fields must match exactly.
The kernel's outputs start as garbage (torch.empty is poisoned), so every element must be
written. Run on the CPU through Triton's interpreter with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from tests.ops.test_tree import KINDS, make_logprobs
from tests.triton_utils import DEVICE, needs_cuda, needs_kernel, poisoned_empty
from vllm_ddtree.kernels import walk as verify_triton
from vllm_ddtree.kernels.walk import walk_rows_triton, walk_tree_triton
from vllm_ddtree.ops.tree import build_ddtree
from vllm_ddtree.ops.walk import walk_rows, walk_tree
from vllm_ddtree.tensors import DDTree, WalkResult

FIELDS = ("accepted_nodes", "num_accepted", "bonus_tokens", "output_tokens")
CASES = [  # (num_reqs, tree depth, walk max_depth, vocab, budget, topk_cap)
    (1, 1, 1, 5, 1, None),
    (2, 3, 3, 4, 3, None),
    (3, 3, 3, 2, 7, None),
    (4, 5, 5, 3, 8, 2),
    (2, 3, 3, 2, 16, 1),  # a 3-node chain: 13 padding nodes (token 0, parent 0)
    (5, 7, 7, 4, 16, None),
    (1, 7, 3, 6, 17, 2),  # the walk stops at max_depth 3 inside a depth-7 tree
    (2, 3, 5, 2, 17, None),  # 14 prefixes: padding; max_depth beyond the tree's depth
    (3, 15, 15, 3, 31, 1),  # a 15-node chain: padding
    (4, 7, 7, 5, 64, 3),
    (5, 5, 5, 2, 64, None),  # 62 prefixes: padding
    (1, 15, 15, 40, 64, None),
]
TARGET_MODES = [  # (probability of following a child, what a miss is)
    (1.0, "any"),  # every walk runs to a leaf or to max_depth
    (0.0, "stop"),  # no walk accepts anything
    (0.0, "pad"),  # the padding token 0 as bait: padding is never a child
    (0.7, "mixed"),
]


def make_targets(tree: DDTree, vocab: int, p_follow: float, miss: str, gen) -> torch.Tensor:
    """Target token per node: a random valid child's token with prob p_follow, else a miss."""
    num_reqs, n = tree.tokens.shape
    device = tree.tokens.device
    node = torch.arange(n, device=device)
    # kids[r, p, i]: node i is a valid child of node p.
    kids = tree.valid[:, None, :] & (node >= 1) & (tree.parents[:, None, :] == node[:, None])
    noise = torch.rand(num_reqs, n, n, generator=gen).to(device)
    kid_token = tree.tokens.gather(1, torch.where(kids, noise, -1.0).argmax(-1))
    stop = torch.full((num_reqs, n), vocab + 7, device=device)  # no node carries it
    anything = torch.randint(0, vocab, (num_reqs, n), generator=gen).to(device)
    which = torch.randint(0, 3, (num_reqs, n), generator=gen).to(device)
    misses = {"stop": stop, "pad": torch.zeros_like(stop), "any": anything}
    missed = misses.get(miss, torch.where(which == 0, stop, torch.where(which == 1, 0, anything)))
    follow = kids.any(-1) & (torch.rand(num_reqs, n, generator=gen).to(device) < p_follow)
    return torch.where(follow, kid_token, missed)


def assert_same_walk(got: WalkResult, want: WalkResult) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype == torch.int64 and a.shape == b.shape, name
        assert torch.equal(a, b), (name, a, b)


def walk_poisoned(tree: DDTree, target: torch.Tensor, max_depth: int, monkeypatch) -> WalkResult:
    monkeypatch.setattr(torch, "empty", poisoned_empty(torch.empty))
    try:
        return walk_tree_triton(tree, target, max_depth)
    finally:
        monkeypatch.undo()


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=lambda c: "r{}-L{}-D{}-V{}-B{}-cap{}".format(*c))
def test_kernel_matches_torch_twin(case, monkeypatch):
    num_reqs, tree_depth, max_depth, vocab, budget, cap = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    for kind, (p_follow, miss) in itertools.product(KINDS, TARGET_MODES):
        lp = make_logprobs(kind, num_reqs, tree_depth, vocab, gen).to(DEVICE)
        roots = torch.randint(0, vocab, (num_reqs,), generator=gen).to(DEVICE)
        tree = build_ddtree(lp, roots, budget, cap)
        target = make_targets(tree, vocab, p_follow, miss, gen)
        want = walk_tree(tree, target, max_depth, use_triton=False)
        got = walk_poisoned(tree, target, max_depth, monkeypatch)
        assert_same_walk(got, want)
        if miss == "stop":
            assert not got.num_accepted.any()
        if p_follow == 1.0:  # ran to a leaf or to max_depth
            last = got.accepted_nodes.gather(1, got.num_accepted[:, None])
            is_kid = tree.valid & (tree.parents == last)
            is_kid[:, 0] = False  # the root is its own parent
            assert ((got.num_accepted == max_depth) | ~is_kid.any(1)).all()


@pytest.mark.gpu
@needs_kernel
def test_int32_strided_targets_and_empty_batch(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    lp = make_logprobs("random", 3, 7, 4, gen).to(DEVICE)
    roots = torch.randint(0, 4, (3,), generator=gen).to(DEVICE)
    tree = build_ddtree(lp, roots, 17)
    target = make_targets(tree, 4, 0.9, "mixed", gen)
    want = walk_tree(tree, target, 7, use_triton=False)
    assert want.num_accepted.any()
    wide = torch.zeros(3, 40, dtype=torch.int32, device=DEVICE)
    wide[:, 5:23] = target.to(torch.int32)
    assert_same_walk(walk_poisoned(tree, wide[:, 5:23], 7, monkeypatch), want)  # row stride 40
    transposed = target.t().contiguous().t()  # column stride num_reqs: copied
    assert_same_walk(walk_poisoned(tree, transposed, 7, monkeypatch), want)

    empty = DDTree(**{f: getattr(tree, f)[:0] for f in DDTree.__dataclass_fields__})
    got = walk_tree(empty, target[:0], 7, use_triton=True)
    assert_same_walk(got, walk_tree(empty, target[:0], 7, use_triton=False))


def narrow(tree: DDTree, width: int, scheduled: torch.Tensor) -> DDTree:
    """The first `width` nodes, nodes past the scheduled count cut: column slices of the
    stored tree (row stride budget + 1), trees as a verify step may hand them over."""
    cut = tree.valid[:, :width] & (torch.arange(width, device=DEVICE) <= scheduled[:, None])
    return DDTree(
        tokens=tree.tokens[:, :width],
        parents=tree.parents[:, :width],
        depths=tree.depths[:, :width],
        valid=cut,
        ancestor_mask=tree.ancestor_mask[:, :width, :width] & cut[:, None, :],
        num_nodes=cut[:, 1:].sum(dim=1),
    )


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("width", [1, 2, 5, 9, 16, 32])
def test_narrowed_trees_as_the_sampler_passes_them(width: int, monkeypatch):
    gen = torch.Generator().manual_seed(width)
    lp = make_logprobs("ties", 4, 15, 3, gen).to(DEVICE)
    tree = build_ddtree(lp, torch.randint(0, 3, (4,), generator=gen).to(DEVICE), 31)
    narrowed = narrow(tree, width, torch.randint(0, width, (4,), generator=gen).to(DEVICE))
    target = make_targets(tree, 3, 0.9, "mixed", gen)[:, :width]
    want = walk_tree(narrowed, target, 15, use_triton=False)
    assert_same_walk(walk_poisoned(narrowed, target, 15, monkeypatch), want)
    stored = torch.zeros(4, 40, dtype=torch.bool, device=DEVICE)
    stored[:, :width] = narrowed.valid
    narrowed.valid = stored[:, :width]  # a row-strided slice too, differing per row
    assert_same_walk(walk_poisoned(narrowed, target, 15, monkeypatch), want)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("budget,depth", [(1, 1), (7, 3), (16, 7), (64, 15)])
def test_walk_over_logits_rows_matches_its_twin(budget: int, depth: int, monkeypatch):
    """walk_rows_triton reads each node's target token from the step's flat logits rows
    (a request's rows end at its cumulative count; absent nodes repeat its last row),
    as the V2 sampler hands them over: requests send all, some or none of their nodes,
    and rows before a request's tree rows belong to no node. The twin is step_rows'
    index, then walk_tree; the tokens committed per request are k + 1."""
    gen = torch.Generator().manual_seed(budget * 10 + depth)
    num_reqs, vocab, width = 5, 4, budget + 1
    lp = make_logprobs("random", num_reqs, depth, vocab, gen).to(DEVICE)
    tree = build_ddtree(lp, torch.randint(0, vocab, (num_reqs,), generator=gen).to(DEVICE),
                        budget)
    scheduled = torch.tensor([budget, 0, budget // 2, budget, 1], device=DEVICE).clamp(max=budget)
    narrowed = narrow(tree, width, scheduled)
    target = make_targets(tree, vocab, 0.9, "mixed", gen)
    # Each request's rows: 0-2 rows before its nodes, then one per sent node and the root.
    extra = torch.randint(0, 3, (num_reqs,), generator=gen).to(DEVICE)
    cu = (scheduled + 1 + extra).cumsum(0)
    row_tokens = torch.randint(0, vocab, (int(cu[-1]),), generator=gen).to(DEVICE)
    for r in range(num_reqs):
        end, n = int(cu[r]), int(scheduled[r])
        row_tokens[end - n - 1 : end] = target[r, : n + 1]
    want_sampled = torch.full((num_reqs,), -7, dtype=torch.int32, device=DEVICE)
    want = walk_rows(narrowed, row_tokens, cu, scheduled, depth, want_sampled, use_triton=False)
    assert torch.equal(want_sampled.long(), want.num_accepted + 1)
    assert want.num_accepted.any() and not want.num_accepted[1]  # root-only: no drafts
    for tokens in (row_tokens, row_tokens.to(torch.int32)):
        monkeypatch.setattr(torch, "empty", poisoned_empty(torch.empty))
        got_sampled = torch.full((num_reqs,), -7, dtype=torch.int32, device=DEVICE)
        got = walk_rows_triton(narrowed, tokens, cu, scheduled, depth, got_sampled)
        monkeypatch.undo()
        assert_same_walk(got, want)
        assert torch.equal(got_sampled, want_sampled)
    assert_same_walk(walk_rows_triton(narrowed, row_tokens, cu, scheduled, depth), want)
    with pytest.raises(ValueError, match="num_sampled_out"):
        walk_rows_triton(narrowed, row_tokens, cu, scheduled, depth, want_sampled.long())
    with pytest.raises(ValueError, match="row_tokens"):
        walk_rows_triton(narrowed, row_tokens[:, None], cu, scheduled, depth)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("budget,depth", [(3, 3), (16, 7)])
def test_walk_over_rows_counts_as_vllm_and_writes_into_buffers(budget: int, depth: int,
                                                               monkeypatch):
    """The counts V2's runner takes, in the walk's launch: tokens committed (k + 1) and
    logits rows rejected (rows - committed), both 0 for a request still prefilling its
    prompt (seq_len below its state's prefill_len: vLLM's get_num_sampled_and_rejected,
    written out below as the oracle). With ``out`` the walk lands in the leading rows
    of wider, longer buffers (as laid out for any width), and nothing else of them
    is written. Kernel and torch twin alike."""
    gen = torch.Generator().manual_seed(budget + depth)
    num_reqs, vocab, width = 4, 3, budget + 1
    lp = make_logprobs("random", num_reqs, depth, vocab, gen).to(DEVICE)
    tree = build_ddtree(lp, torch.randint(0, vocab, (num_reqs,), generator=gen).to(DEVICE),
                        budget)
    scheduled = torch.tensor([budget, 0, budget - 1, budget], device=DEVICE)
    narrowed = narrow(tree, width, scheduled)
    target = make_targets(tree, vocab, 0.9, "mixed", gen)
    cu = (scheduled + 1).cumsum(0)
    row_tokens = torch.cat([target[r, : int(scheduled[r]) + 1] for r in range(num_reqs)])
    # Request 2 (state 6) is mid-prompt; the others (states 3, 0, 1) decode.
    idx_mapping = torch.tensor([3, 0, 6, 1], device=DEVICE)
    prefill_len = torch.tensor([5, 9, 0, 40, 0, 0, 50, 0], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([60, 12, 41, 33, 99], dtype=torch.int32, device=DEVICE)  # padded
    walk = walk_tree(narrowed, target, depth, use_triton=False)
    logits_rows = (scheduled + 1).tolist()
    want_sampled, want_rejected = [], []
    for r in range(num_reqs):  # vLLM's rule, in plain Python
        prefilling = int(seq_lens[r]) < int(prefill_len[int(idx_mapping[r])])
        committed = 0 if prefilling else int(walk.num_accepted[r]) + 1
        want_sampled.append(committed)
        want_rejected.append(0 if prefilling else logits_rows[r] - committed)
    assert want_sampled[2] == want_rejected[2] == 0 and min(want_sampled[:2]) > 0

    for use_triton in (False, True):
        out = WalkResult(*(torch.full(shape, -9, dtype=torch.int64, device=DEVICE) for shape in
                           ((num_reqs + 2, depth + 1), (num_reqs + 2,), (num_reqs + 2,),
                            (num_reqs + 2, width + 5))))
        counts = torch.full((2, num_reqs), -7, dtype=torch.int32, device=DEVICE)
        if use_triton:
            monkeypatch.setattr(torch, "empty", poisoned_empty(torch.empty))
        got = walk_rows(narrowed, row_tokens, cu, scheduled, depth, counts[0],
                        num_rejected_out=counts[1],
                        chunked_prefill=(seq_lens, idx_mapping, prefill_len), out=out,
                        use_triton=use_triton)
        monkeypatch.undo()
        assert_same_walk(got, walk)
        assert counts[0].tolist() == want_sampled and counts[1].tolist() == want_rejected
        assert got.output_tokens.data_ptr() == out.output_tokens.data_ptr()
        assert got.accepted_nodes.data_ptr() == out.accepted_nodes.data_ptr()
        assert (out.output_tokens.view(-1)[num_reqs * width :] == -9).all()
        assert (out.accepted_nodes[num_reqs:] == -9).all() and (out.num_accepted[num_reqs:] == -9).all()
    with pytest.raises(ValueError, match="come with num_sampled_out"):
        walk_rows(narrowed, row_tokens, cu, scheduled, depth, num_rejected_out=counts[1])
    with pytest.raises(ValueError, match="out must hold"):
        walk_rows(narrowed, row_tokens, cu, scheduled, depth + 1, out=out)


@pytest.mark.gpu
@needs_kernel
def test_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(4)
    roots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    tree = build_ddtree(make_logprobs("random", 2, 3, 5, gen).to(DEVICE), roots, 7)
    target = torch.zeros(2, 8, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="target_tokens"):
        walk_tree_triton(tree, target[:, :-1], 3)
    with pytest.raises(ValueError, match="int32 or int64"):
        walk_tree_triton(tree, target.float(), 3)
    with pytest.raises(ValueError, match="max_depth"):
        walk_tree_triton(tree, target, 0)


def test_default_dispatch_on_cpu_is_torch(monkeypatch):
    def kernel_called(*args, **kwargs):
        raise AssertionError("walk_tree_triton called")

    monkeypatch.setattr(verify_triton, "walk_tree_triton", kernel_called)
    gen = torch.Generator().manual_seed(5)
    tree = build_ddtree(make_logprobs("random", 2, 3, 5, gen), torch.zeros(2, dtype=torch.int64), 7)
    target = make_targets(tree, 5, 0.9, "any", gen)
    walk = walk_tree(tree, target, 3)  # CPU tensors: the torch loop
    assert walk.output_tokens.shape == (2, 8)
    with pytest.raises(AssertionError, match="walk_tree_triton called"):
        walk_tree(tree, target, 3, use_triton=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_cuda_default_is_kernel_without_host_sync_and_graph_safe(budget: int):
    gen = torch.Generator().manual_seed(budget)
    num_reqs, depth, vocab = 4, 15, 50
    lp = make_logprobs("random", num_reqs, depth, vocab, gen).cuda()
    roots = torch.randint(0, vocab, (num_reqs,), generator=gen).cuda()
    tree = build_ddtree(lp, roots, budget)
    target = make_targets(tree, vocab, 0.9, "mixed", gen)
    walk_tree(tree, target, depth)  # compile outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = walk_tree(tree, target, depth)  # default on CUDA: the kernel
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same_walk(got, walk_tree(tree, target, depth, use_triton=False))

    # Captured once, replayed on new targets.
    static_target = target.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = walk_tree(tree, static_target, depth)
    for p_follow, miss in TARGET_MODES:
        static_target.copy_(make_targets(tree, vocab, p_follow, miss, gen))
        graph.replay()
        assert_same_walk(captured, walk_tree(tree, static_target, depth, use_triton=False))
