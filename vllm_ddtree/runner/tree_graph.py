"""The tree build as one CUDA-graph replay per batch size.

Eager, ``build_ddtree`` was about fifteen small launches (top-k, clamp, tie repair, run
sort, selection; fewer since the fused top-k); at small batches the host spent longer
issuing them than the GPU spent running them (H200, batch 1, budget 16: 0.65 ms eager against 0.11 ms as one
graph replay, ``benchmarks/results/gpu_step.json``). So on CUDA the proposer writes the
drafter's log-probabilities straight into a persistent buffer (``logprobs_out``) and
``build`` replays a graph captured, the first time each number of requests is met, over
that buffer's leading rows. The graphs' outputs are reused by later replays (of any
size: the graphs share one memory pool): a tree must be consumed before the next build
(the runner copies what it needs into the step's own trees at the next verify step,
before the drafter runs again).

Batches larger than ``max_reqs`` (the buffer is capped at MAX_BUFFER_BYTES) and builds
met during another capture run eagerly; the outputs are the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.ops.tree import build_ddtree
from vllm_ddtree.tensors import DDTree

__all__ = ["MAX_BUFFER_BYTES", "TreeBuildGraphs"]

# The persistent log-probability buffer's ceiling: [max_reqs, max_depth, vocab] float32.
# A Qwen3-sized vocabulary (151,936) at depth 15 takes 9.1 MB per request: 56 requests.
MAX_BUFFER_BYTES = 512 << 20


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tree: DDTree  # the graph's outputs, rewritten by every replay


class TreeBuildGraphs:
    """CUDA graphs of ``build_ddtree`` at fixed (budget, top-k cap, depth, vocab),
    one per number of requests up to ``max_reqs``, captured at first use."""

    def __init__(self, budget: int, topk_cap: int | None, max_depth: int, vocab: int,
                 max_num_reqs: int, device: torch.device):
        self.budget, self.topk_cap = budget, topk_cap
        self.max_depth, self.vocab, self.device = max_depth, vocab, device
        per_req = max_depth * vocab * 4
        self.max_reqs = max(0, min(max_num_reqs, MAX_BUFFER_BYTES // per_req))
        self._logprobs: torch.Tensor | None = None  # [max_reqs, max_depth, vocab] float32
        self._roots: torch.Tensor | None = None  # [max_reqs] int64
        self._graphs: dict[int, _Captured] = {}
        # One memory pool for every size's graph, as vLLM shares one for its own: a
        # replay may reuse memory of another size's graph, whose tree is consumed by
        # then (module docstring), and a pool per size would keep at least a 2 MiB
        # segment for each of up to max_reqs sizes.
        self._pool = None

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def logprobs_out(self, num_reqs: int) -> torch.Tensor | None:
        """Where the drafter writes this step's log-probabilities,
        ``[num_reqs * max_depth, vocab]``, so ``build`` can replay; None: build eagerly."""
        if not 0 < num_reqs <= self.max_reqs or (
            self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        ):
            return None
        if self._logprobs is None:
            # Zeros: rows never written stay finite (a uniform distribution).
            self._logprobs = torch.zeros(self.max_reqs, self.max_depth, self.vocab,
                                         dtype=torch.float32, device=self.device)
            self._roots = torch.zeros(self.max_reqs, dtype=torch.int64, device=self.device)
        return self._logprobs[:num_reqs].view(num_reqs * self.max_depth, self.vocab)

    def holds(self, logprobs: torch.Tensor) -> bool:
        """Whether ``logprobs`` is the buffer's view that ``logprobs_out`` handed out."""
        return self._logprobs is not None and logprobs.data_ptr() == self._logprobs.data_ptr()

    def build(self, num_reqs: int, root_tokens: torch.Tensor) -> DDTree:
        """The trees of the log-probabilities written through ``logprobs_out(num_reqs)``:
        the same outputs as ``build_ddtree`` on them, from one graph replay."""
        assert self._roots is not None, "logprobs_out hands out the buffer first"
        self._roots[:num_reqs].copy_(root_tokens, non_blocking=True)  # int32 from vLLM: cast
        captured = self._graphs.get(num_reqs)
        if captured is None:
            captured = self._graphs[num_reqs] = self._capture(num_reqs)
        captured.graph.replay()
        return captured.tree

    def _capture(self, num_reqs: int) -> _Captured:
        args = (self._logprobs[:num_reqs], self._roots[:num_reqs], self.budget, self.topk_cap)
        # One eager build first, on the capture's stream, so kernels are compiled and
        # libraries initialised outside the capture (which runs nothing: the replay in
        # build computes this step's tree).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(side):
            build_ddtree(*args)
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                tree = build_ddtree(*args)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return _Captured(graph, tree)
