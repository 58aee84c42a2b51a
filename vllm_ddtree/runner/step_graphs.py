"""A verify step's own launches, replayed as CUDA graphs.

At batch 1 the DDTree step is bound by the host: each Triton launch costs the
host tens of microseconds of argument binding (``benchmarks/results/
gpu_profile_20261202_6506348_real.json``: Triton's ``run`` was a third of the
profiled host time), while the GPU runs the kernel in a few. The runner's two
groups of launches — laying out the step's trees before the target runs, and
walking them and compacting the accepted path after — read and write only
buffers that stay put from step to step (the runner's own, vLLM's persistent
input buffers, the KV caches), so each group is captured once per shape and
replayed as one graph launch afterwards.

A caller names every tensor its launches touch that is not the runner's own
(their addresses must be the captured ones for a replay to be right) and a key
for everything else the launches depend on (batch size, widths, flags). The
first uses of a signature run the launches eagerly (kernels compile, caches
fill); its ``CAPTURE_AFTER``-th use captures and replays them; from then on each
call is one replay. A capture costs the host far more than an eager run of these
launches: behind a server, sizes the tree sizer tried only once at a batch size
timed steady steps of 10-29 ms where the size it kept took 4-6 ms, with two of a
try's three timed steps capturing. A signature met only in one of the sizer's
tries (``TRY_STEPS`` uses) is therefore never captured, and one met more often is
captured after a few cheap eager runs.

The launches must not allocate what outlives them: they write into buffers
allocated beforehand. Launches that allocate temporaries (torch ops rather than
kernels writing in place) capture with ``shared_pool``: every graph of the group
then takes its temporaries from one memory pool, which is safe because they die
inside the launches and the graphs replay one at a time on one stream, and costs
the largest graph's temporaries rather than a pool per graph.
Off CUDA, in an engine without CUDA graphs (``enforce_eager``), during another
capture, past ``MAX_GRAPHS`` signatures, or when a capture fails, the launches run
eagerly: the outputs are the same either way.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

import torch
from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers

__all__ = ["CAPTURE_AFTER", "CAPTURE_AFTER_VAR", "ENV_VAR", "MAX_GRAPHS", "TALLY", "StepGraphs",
           "capture_after_by_env", "enabled_by_env"]

# VLLM_DDTREE_STEP_GRAPHS=0 runs the step's launches eagerly in every engine (to tell
# a graph's fault from the launches' when debugging; read when an engine starts).
ENV_VAR = "VLLM_DDTREE_STEP_GRAPHS"

# Signatures per StepGraphs: one per batch size and width in steady decoding, a few
# more where vLLM's buffers are sliced differently. Graphs hold no memory of their
# own (nothing is allocated inside a capture), so the cap only bounds the tables.
MAX_GRAPHS = 1024

# The use of a signature that captures it: one past the uses a try of the tree sizer
# gives a shape (vllm_ddtree/sizing.py's TRY_STEPS, 4), so a shape met only in a try
# runs eagerly; a shape met more often pays four eager runs before its capture.
CAPTURE_AFTER = 5
# VLLM_DDTREE_CAPTURE_AFTER=N captures a signature at its N-th use instead (N >= 2).
CAPTURE_AFTER_VAR = "VLLM_DDTREE_CAPTURE_AFTER"

# What every StepGraphs of this process spent on shapes met for the first time, for the
# log (scheduler.py): "eager" signatures run eagerly on their first use, "captures" and
# "capture_s" (host seconds) for the graphs captured (at their CAPTURE_AFTER-th use).
TALLY: Counter = Counter()


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "1") not in ("", "0")


def capture_after_by_env() -> int:
    """CAPTURE_AFTER, or the use set by VLLM_DDTREE_CAPTURE_AFTER."""
    text = os.environ.get(CAPTURE_AFTER_VAR, "").strip()
    if not text:
        return CAPTURE_AFTER
    if not text.isdigit() or int(text) < 2:
        raise ValueError(f"{CAPTURE_AFTER_VAR} must be a whole number of at least 2 (a "
                         f"signature's first use runs eagerly), got {text!r}")
    return int(text)


class StepGraphs:
    """CUDA graphs of a fixed sequence of launches, one per signature (a key plus
    the address and shape of each named tensor), captured at its ``capture_after``-th
    use."""

    def __init__(self, device: torch.device, name: str, enabled: bool = True,
                 shared_pool: bool = False, capture_after: int | None = None):
        capture_after = capture_after_by_env() if capture_after is None else capture_after
        if capture_after < 2:
            raise ValueError("a signature's first use runs eagerly: capture_after >= 2")
        self.device, self.name = torch.device(device), name
        self.shared_pool, self.capture_after = shared_pool, capture_after
        self._pool: tuple | None = None  # the graphs' one memory pool (shared_pool)
        # Off CUDA, or where the engine runs without CUDA graphs (enforce_eager):
        # every call runs the launches.
        self.enabled = enabled and self.device.type == "cuda"
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._seen: Counter = Counter()  # signature -> eager uses, before its capture
        self._eager: set[tuple] = set()  # their capture failed: always eager
        self._stream: torch.cuda.Stream | None = None
        self.replays = self.captures = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, tensors: Sequence[torch.Tensor],
            launch: Callable[[], None]) -> None:
        """``launch()``, as a graph replay when this signature was captured."""
        if not self.enabled:
            launch()
            return
        signature = (key, *[(t.data_ptr(), *t.shape) for t in tensors])
        graph = self._graphs.get(signature)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        if (self._seen[signature] < self.capture_after - 1 or signature in self._eager
                or len(self._graphs) >= MAX_GRAPHS or self._capturing()):
            if signature in self._seen or len(self._seen) < 4 * MAX_GRAPHS:
                TALLY["eager"] += signature not in self._seen
                self._seen[signature] += 1
            launch()
            return
        start = time.perf_counter()
        graph = self._capture(signature, launch)
        TALLY["captures"] += 1
        TALLY["capture_s"] += time.perf_counter() - start
        if graph is None:
            launch()
            return
        self._graphs[signature] = graph
        graph.replay()  # the capture ran nothing: this replay is this step's work
        self.replays += 1

    def _capturing(self) -> bool:
        """Whether another graph is being captured on this device's current stream."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _release_generator(self) -> None:
        """After a failed capture: PyTorch ends a capture's hold on the device's default
        random generator only when the capture ends well, and until then every random
        op on the device (vLLM's sampling) fails. The generator takes a fresh copy of
        its own state: the same seed and offset, not held."""
        index = self.device.index if self.device.index is not None else \
            torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        generator.graphsafe_set_state(generator.clone_state())

    def _capture(self, signature: tuple, launch: Callable[[], None]
                 ) -> torch.cuda.CUDAGraph | None:
        """The launches as a graph (on a side stream, as torch.cuda.graph does), or
        None when capturing them fails; the signature then stays eager."""
        current = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(current)
        if self.shared_pool and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    launch()
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 (a graph is an optimization: run eagerly)
            self._eager.add(signature)
            self._release_generator()
            logger.warning("DDTree %s launches could not be captured in a CUDA graph "
                           "(%s: %s); they run eagerly at this shape.", self.name,
                           type(exc).__name__, exc)
            current.wait_stream(self._stream)
            return None
        current.wait_stream(self._stream)
        self.captures += 1
        if self.captures == 1:
            logger.info("DDTree %s: the step's launches replay as a CUDA graph from now "
                        "on (one per batch shape).", self.name)
        return graph
