"""vllm_ddtree/kernels/topk.py against its torch twin, tree.topk_per_depth on torch:
the fused top-k (k <= FUSED_TOPK_MAX_K) and torch.topk + the Triton tie repair.

Inputs are built to tie: values drawn from a handful of levels (so runs of equal
values cross the k-th slot), many copies of the value near rank k, zero-probability
(-inf) and clamp-edge entries, vocabularies that are not a multiple of the scan
block, and k from 1 to the whole vocabulary. Values and ids must match exactly. Run
on the CPU through Triton's interpreter with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_tree import clamp_edge_logprobs
from tests.triton_utils import DEVICE, KernelRecorder, needs_kernel
from vllm_ddtree.kernels import topk as topk_module
from vllm_ddtree.ops.tree import LOGPROB_FLOOR, _topk_and_repair, topk_per_depth

pytestmark = [pytest.mark.gpu, needs_kernel]


def tied_logprobs(num_reqs: int, depth: int, vocab: int, k: int, gen: torch.Generator):
    lp = torch.randn(num_reqs, depth, vocab, generator=gen)
    lp[0] = torch.randint(-4, 1, (depth, vocab), generator=gen).float()  # few levels
    near_k = lp[1:].topk(max(1, k // 2), dim=-1).values[..., -1:]
    copies = max(1, vocab // 4)
    where = torch.randint(0, vocab, (num_reqs - 1, depth, copies), generator=gen)
    lp[1:].scatter_(2, where, near_k.expand(-1, -1, copies))
    lp[-1, 0] = clamp_edge_logprobs(1, 1, vocab, gen)[0, 0]  # -inf, -0.0, huge, tiny
    lp[-1, -1, : vocab // 2] = float("-inf")  # many tokens of zero probability
    return lp


def fused(lp: torch.Tensor, k: int):
    return topk_module.topk_triton(lp, k, LOGPROB_FLOOR)


def repaired(lp: torch.Tensor, k: int):
    return _topk_and_repair(lp, k, use_triton=True)


PATHS = {"fused": fused, "repair": repaired}


@pytest.mark.parametrize("path", ["fused", "repair"])
@pytest.mark.parametrize("vocab,k", [
    (1, 1), (5, 1), (5, 4), (5, 5), (40, 7), (300, 16), (1500, 1), (2100, 32),
    (10_000, 3),  # several scan blocks
    (5000, 17),
])
def test_kernel_matches_torch(path: str, vocab: int, k: int):
    gen = torch.Generator().manual_seed(vocab * 7 + k)
    lp = tied_logprobs(3, 4, vocab, k, gen)
    want_vals, want_ids = topk_per_depth(lp, k, use_triton=False)
    got_vals, got_ids = PATHS[path](lp.to(DEVICE), k)
    assert torch.equal(got_vals.cpu(), want_vals)
    assert torch.equal(got_ids.cpu(), want_ids)
    assert got_vals.is_contiguous() and got_ids.is_contiguous()


@pytest.mark.parametrize("vocab,k,fused_launches", [(300, 16, 2), (2100, 17, 0),
                                                    (1500, 64, 0), (2100, 33, 0)])
def test_small_k_takes_the_fused_top_k(monkeypatch, vocab: int, k: int, fused_launches: int):
    """On the device topk_per_depth runs the fused top-k up to FUSED_TOPK_MAX_K (16), and
    torch.topk with the tie repair above; both match the torch path."""
    assert topk_module.FUSED_TOPK_MAX_K == 16
    calls: list = []
    for name in ("block_topk_kernel", "merge_topk_kernel"):
        monkeypatch.setattr(topk_module, name,
                            KernelRecorder(getattr(topk_module, name), calls))
    gen = torch.Generator().manual_seed(vocab + k)
    lp = tied_logprobs(2, 3, vocab, k, gen)
    got = topk_per_depth(lp.to(DEVICE), k, use_triton=True)
    want = topk_per_depth(lp, k, use_triton=False)
    assert len(calls) == fused_launches
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


def test_fused_top_k_refuses_k_beyond_its_bound():
    lp = torch.zeros(1, 1, 100, device=DEVICE)
    with pytest.raises(ValueError, match="k <= min"):
        fused(lp, 65)


@pytest.mark.parametrize("path", ["fused", "repair"])
def test_rows_without_crossing_ties_are_left_to_the_sort(path: str):
    """A row whose ties stay inside the top-k needs no scan; its tied ids still come
    out ascending."""
    lp = torch.full((1, 1, 10), -5.0)
    lp[0, 0, [7, 2, 9]] = -1.0  # three tied tokens, all in the top 3; the 4th is lower
    vals, ids = PATHS[path](lp.to(DEVICE), 3)
    assert ids.cpu().tolist() == [[[2, 7, 9]]]
    assert vals.cpu().tolist() == [[[-1.0, -1.0, -1.0]]]


@pytest.mark.parametrize("path", ["fused", "repair"])
def test_tied_ids_spread_over_scan_blocks_take_their_ranks(path: str):
    """The lowest tied ids lie in different blocks of the scan (4096 entries each; the
    fused top-k's blocks hold 2048), a later block's ids ranked after the earlier ones."""
    lp = torch.full((1, 1, 10_000), -5.0)
    lp[0, 0, [9500, 5000, 200, 9000]] = -1.0  # four tied, three kept: 200, 5000, 9000
    lp[0, 0, 7000] = -0.5  # the best token, alone
    vals, ids = PATHS[path](lp.to(DEVICE), 4)
    assert ids.cpu().tolist() == [[[7000, 200, 5000, 9000]]]
    assert vals.cpu().tolist() == [[[-0.5, -1.0, -1.0, -1.0]]]


@pytest.mark.parametrize("best_at", [list(range(16, 24)), list(range(5, 4096, 512)),
                                     list(range(3, 128, 16)),  # k sub-blocks of one block
                                     [2047, 2048, 4095, 0, 1, 31, 32, 1000]])
def test_fused_top_k_finds_the_best_wherever_they_sit_in_a_block(best_at):
    """The fused top-k keeps, per block, only the sub-blocks with the largest maxima:
    the k best entries packed into one sub-block, one in each of k sub-blocks, or at
    block edges must all come out."""
    gen = torch.Generator().manual_seed(len(best_at))
    lp = -10.0 - torch.rand(2, 1, 4096, generator=gen)
    lp[:, 0, best_at] = -torch.rand(2, len(best_at), generator=gen)
    want_vals, want_ids = topk_per_depth(lp, len(best_at), use_triton=False)
    got_vals, got_ids = fused(lp.to(DEVICE), len(best_at))
    assert sorted(got_ids[0, 0].cpu().tolist()) == sorted(best_at)
    assert torch.equal(got_vals.cpu(), want_vals) and torch.equal(got_ids.cpu(), want_ids)
