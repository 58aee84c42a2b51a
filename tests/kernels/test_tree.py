"""vllm_ddtree/kernels/tree.py against its torch twin, tree.select_tree.

Every case draws fresh inputs (a fixed seed per case) from the drafters of tests/ops/test_tree.py
(random, heavy ties, -inf, one-hot, uniform, and values on both sides of the clamp), over
odd budgets, depths and top-k widths, and compares all six DDTree fields exactly. The
kernel's outputs start as garbage (torch.empty is poisoned), so every element must be
written. Run on the CPU through Triton's interpreter with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.ops.test_tree import KINDS, clamp_edge_logprobs, make_logprobs
from tests.triton_utils import DEVICE, needs_kernel, poisoned_empty
from vllm_ddtree.kernels.tree import select_tree_triton
from vllm_ddtree.ops.tree import build_ddtree, select_tree, topk_per_depth

pytestmark = [pytest.mark.gpu, needs_kernel]
FIELDS = ("tokens", "parents", "depths", "valid", "ancestor_mask", "num_nodes")
CASES = [  # (num_reqs, max_depth, vocab, budget, topk_cap)
    (1, 1, 5, 1, None),
    (2, 1, 9, 7, None),
    (3, 2, 2, 20, None),  # 2 + 4 = 6 prefixes < budget: padding
    (2, 3, 7, 5, None),
    (3, 4, 9, 16, 3),
    (1, 7, 6, 17, None),
    (2, 15, 40, 31, None),
    (1, 15, 11, 33, 2),
    (2, 5, 300, 64, None),
    (1, 15, 100, 100, 4),
    (1, 20, 70, 255, None),
]


def draft_logprobs(kind: str, num_reqs: int, depth: int, vocab: int, gen: torch.Generator):
    if kind == "clamp_edges":
        return clamp_edge_logprobs(num_reqs, depth, vocab, gen)
    return make_logprobs(kind, num_reqs, depth, vocab, gen)


def assert_same_tree(got, want) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", KINDS + ["clamp_edges"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "r{}-L{}-V{}-B{}-cap{}".format(*c))
def test_kernel_matches_torch_twin(case, kind: str, monkeypatch):
    num_reqs, depth, vocab, budget, cap = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case, kind)).encode()))
    lp = draft_logprobs(kind, num_reqs, depth, vocab, gen).to(DEVICE)
    roots = torch.randint(0, vocab, (num_reqs,), generator=gen).to(DEVICE)
    top_vals, top_ids = topk_per_depth(lp, min(budget, cap or budget, vocab))
    want = select_tree(top_vals, top_ids, roots, budget)
    monkeypatch.setattr(torch, "empty", poisoned_empty(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned_empty(torch.empty_like))
    got = select_tree_triton(top_vals, top_ids, roots, budget)
    monkeypatch.undo()
    assert_same_tree(got, want)


@pytest.mark.parametrize("budget", [1, 16, 63])
def test_int32_roots_and_empty_batch(budget: int):
    gen = torch.Generator().manual_seed(budget)
    lp = make_logprobs("ties", 3, 4, 12, gen).to(DEVICE)
    roots = torch.randint(0, 12, (3,), generator=gen, dtype=torch.int32).to(DEVICE)
    want = build_ddtree(lp, roots, budget, use_triton=False)
    assert_same_tree(build_ddtree(lp, roots, budget, use_triton=True), want)
    empty = build_ddtree(lp[:0], roots[:0], budget, use_triton=True)
    assert empty.tokens.shape == (0, budget + 1) and empty.ancestor_mask.shape == (0, budget + 1, budget + 1)


def test_rejects_bad_inputs():
    vals = torch.zeros(2, 3, 4, device=DEVICE)
    ids = torch.zeros(2, 3, 4, dtype=torch.int64, device=DEVICE)
    roots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="top_vals"):
        select_tree_triton(vals.double(), ids, roots, 4)
    with pytest.raises(ValueError, match="top_ids"):
        select_tree_triton(vals, ids.int(), roots, 4)
    with pytest.raises(ValueError, match="budget"):
        select_tree_triton(vals, ids, roots, 3)  # k = 4 > budget
    with pytest.raises(ValueError, match="31-bit"):
        select_tree_triton(vals, ids, roots, 1 << 14)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (full vocabulary)")
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_full_vocab_build_matches_torch_without_host_sync(budget: int):
    gen = torch.Generator().manual_seed(budget)
    num_reqs, depth, vocab = 4, 15, 151936
    for kind in KINDS:
        lp = make_logprobs(kind, num_reqs, depth, vocab, gen).cuda()
        roots = torch.randint(0, vocab, (num_reqs,), generator=gen).cuda()
        want = build_ddtree(lp, roots, budget, use_triton=False)
        build_ddtree(lp, roots, budget, use_triton=True)  # compile outside sync checks
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = build_ddtree(lp, roots, budget)  # default on CUDA: the kernel
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_same_tree(got, want)
