"""TreeBuildGraphs: the tree build replayed from CUDA graphs equals the eager build.

The replay tests need CUDA (graphs); the buffer rules run anywhere."""

from __future__ import annotations

import pytest
import torch

from tests.triton_utils import needs_cuda
from vllm_ddtree.ops.tree import build_ddtree
from vllm_ddtree.runner.tree_graph import MAX_BUFFER_BYTES, TreeBuildGraphs

FIELDS = ("tokens", "parents", "depths", "valid", "ancestor_mask", "num_nodes")


def drafter_logprobs(num_reqs: int, depth: int, vocab: int, gen: torch.Generator,
                     device: torch.device) -> torch.Tensor:
    """[num_reqs * depth, vocab] log-probabilities with ties (logits on a coarse grid),
    so the tie repair and the run sort take part."""
    logits = torch.randint(-6, 3, (num_reqs * depth, vocab), generator=gen).float() / 2
    return logits.to(device).log_softmax(dim=-1)


def test_buffer_is_capped_and_only_handed_out_inside_its_rows():
    cpu = torch.device("cpu")
    big = TreeBuildGraphs(16, 4, 15, 151_936, 256, cpu)
    assert big.max_reqs == MAX_BUFFER_BYTES // (15 * 151_936 * 4) < 256
    small = TreeBuildGraphs(16, None, 7, 1000, 8, cpu)
    assert small.max_reqs == 8
    assert small.logprobs_out(0) is None and small.logprobs_out(9) is None
    out = small.logprobs_out(3)
    assert out.shape == (3 * 7, 1000) and out.dtype == torch.float32
    assert small.holds(out) and small.holds(small.logprobs_out(8))
    assert not small.holds(out.clone())
    huge_vocab = TreeBuildGraphs(16, 4, 15, MAX_BUFFER_BYTES, 4, cpu)
    assert huge_vocab.max_reqs == 0 and huge_vocab.logprobs_out(1) is None


@needs_cuda
@pytest.mark.parametrize("budget,cap,depth,vocab", [
    (16, 4, 15, 5000), (7, None, 7, 300), (31, 2, 8, 1000), (64, None, 15, 2000),
])
def test_replays_equal_the_eager_build(budget, cap, depth, vocab):
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(budget * 1000 + depth)
    graphs = TreeBuildGraphs(budget, cap, depth, vocab, 6, device)
    # Sizes revisited with new inputs: each replay must see this step's data.
    for num_reqs in (1, 3, 1, 6, 3, 1):
        logprobs = drafter_logprobs(num_reqs, depth, vocab, gen, device)
        roots = torch.randint(0, vocab, (num_reqs,), generator=gen, dtype=torch.int32).to(device)
        out = graphs.logprobs_out(num_reqs)
        out.copy_(logprobs)
        tree = graphs.build(num_reqs, roots)
        expected = build_ddtree(logprobs.view(num_reqs, depth, vocab), roots, budget, cap)
        for name in FIELDS:
            got, want = getattr(tree, name), getattr(expected, name)
            assert got.shape == want.shape and torch.equal(got, want), (num_reqs, name)
    assert graphs.captured_sizes == [1, 3, 6]
    assert len({c.graph.pool() for c in graphs._graphs.values()}) == 1  # one shared pool


@needs_cuda
def test_no_buffer_while_another_graph_is_capturing():
    device = torch.device("cuda")
    graphs = TreeBuildGraphs(8, 2, 4, 100, 4, device)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph.capture_begin()
        try:
            inside = graphs.logprobs_out(2)
        finally:
            graph.capture_end()
    assert inside is None and graphs.logprobs_out(2) is not None
