"""vllm_ddtree/runner/step_graphs.py: a step's launches as CUDA graph replays.

The launches here are small torch ops that write into buffers allocated beforehand,
as the runner's are. On the CPU (and with graphs off) every call runs them; on CUDA
the first calls of a signature run them, its ``capture_after``-th captures and
replays them (the CUDA tests below capture at the second), later ones replay, and a
replay computes from the buffers' contents at that step. A tensor at another address
is another signature; launches that cannot be captured stay eager.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_utils import needs_cuda
from vllm_ddtree.runner import step_graphs
from vllm_ddtree.runner.step_graphs import StepGraphs


def logged(monkeypatch, level: str) -> list[str]:
    """The module's messages at ``level``, as formatted."""
    messages: list[str] = []
    monkeypatch.setattr(step_graphs.logger, level,
                        lambda msg, *args: messages.append(msg % args))
    return messages


class Doubling:
    """out = 2 * src + 1, written in place; counts the times its launches run on the
    host (a replay runs none)."""

    def __init__(self, device: str, n: int = 5):
        self.src = torch.arange(n, dtype=torch.float32, device=device)
        self.out = torch.zeros(n, dtype=torch.float32, device=device)
        self.calls = 0

    def launch(self) -> None:
        self.calls += 1
        torch.mul(self.src, 2, out=self.out)
        self.out.add_(1)

    def want(self) -> list[float]:
        return (self.src.cpu() * 2 + 1).tolist()


@pytest.mark.parametrize("enabled", [True, False])
def test_off_cuda_or_off_every_call_runs_the_launches(enabled):
    device = "cuda" if torch.cuda.is_available() and not enabled else "cpu"
    graphs, step = StepGraphs(torch.device(device), "test", enabled), Doubling(device)
    for i in range(4):
        step.src.fill_(i)
        graphs.run(("k",), (step.src,), step.launch)
        assert step.out.tolist() == step.want()
    assert step.calls == 4 and graphs.num_graphs == 0 and graphs.replays == 0


class CountingGraphs(StepGraphs):
    """StepGraphs on the CPU with captures counted instead of made: the choice of when
    to capture, without a GPU."""

    def __init__(self, **kwargs):
        super().__init__(torch.device("cpu"), "test", **kwargs)
        self.enabled = True
        self.captured: list[tuple] = []

    def _capture(self, signature, launch):
        self.captured.append(signature)
        return type("Graph", (), {"replay": staticmethod(launch)})


def test_a_signature_is_captured_at_its_capture_after_th_use(monkeypatch):
    """By default a shape met only within one of the tree sizer's tries (TRY_STEPS
    uses) runs eagerly every time; its next use captures it. The tally for the log
    counts each shape's first eager run once and each capture."""
    from vllm_ddtree.sizing import TRY_STEPS

    monkeypatch.setattr(step_graphs, "TALLY", step_graphs.Counter())
    monkeypatch.delenv(step_graphs.CAPTURE_AFTER_VAR, raising=False)
    assert step_graphs.CAPTURE_AFTER == TRY_STEPS + 1
    graphs, step = CountingGraphs(), Doubling("cpu")
    for i in range(TRY_STEPS):
        graphs.run(("k",), (step.src,), step.launch)
    assert graphs.captured == [] and step.calls == TRY_STEPS
    graphs.run(("k",), (step.src,), step.launch)  # captured, and replayed
    graphs.run(("k",), (step.src,), step.launch)
    assert len(graphs.captured) == 1 and graphs.replays == 2 and graphs.num_graphs == 1
    graphs.run(("other",), (step.src,), step.launch)
    assert step_graphs.TALLY["eager"] == 2 and step_graphs.TALLY["captures"] == 1
    twice = CountingGraphs(capture_after=2)
    twice.run(("k",), (step.src,), step.launch)
    twice.run(("k",), (step.src,), step.launch)
    assert len(twice.captured) == 1
    with pytest.raises(ValueError, match="capture_after >= 2"):
        CountingGraphs(capture_after=1)


def test_the_capture_use_from_the_environment(monkeypatch):
    monkeypatch.delenv(step_graphs.CAPTURE_AFTER_VAR, raising=False)
    assert CountingGraphs().capture_after == step_graphs.CAPTURE_AFTER
    monkeypatch.setenv(step_graphs.CAPTURE_AFTER_VAR, "2")
    assert CountingGraphs().capture_after == 2
    assert CountingGraphs(capture_after=3).capture_after == 3  # the caller's, over it
    for bad in ("1", "two", "-3"):
        monkeypatch.setenv(step_graphs.CAPTURE_AFTER_VAR, bad)
        with pytest.raises(ValueError, match="VLLM_DDTREE_CAPTURE_AFTER must be"):
            CountingGraphs()


@needs_cuda
def test_second_call_captures_and_later_calls_replay_the_buffers_contents(monkeypatch):
    graphs, step = StepGraphs(torch.device("cuda"), "test", capture_after=2), Doubling("cuda")
    messages = logged(monkeypatch, "info")
    monkeypatch.setattr(step_graphs, "TALLY", step_graphs.Counter())
    for i in range(5):
        step.src.copy_(torch.arange(5) * (i + 1))
        graphs.run(("k", 5), (step.src,), step.launch)
        assert step.out.tolist() == step.want()
    # Call 1 eager, call 2 captured (the capture runs the launches' Python once), 3-5 replay.
    assert step.calls == 2 and graphs.captures == 1 and graphs.replays == 4
    assert graphs.num_graphs == 1
    assert len(messages) == 1 and "DDTree test: the step's launches replay" in messages[0]
    # the log's tally of shapes met for the first time (scheduler.py): one eager, one capture
    tally = step_graphs.TALLY
    assert (tally["eager"], tally["captures"]) == (1, 1) and tally["capture_s"] > 0


@needs_cuda
def test_another_address_or_key_is_another_signature():
    graphs, step = StepGraphs(torch.device("cuda"), "test", capture_after=2), Doubling("cuda")
    other = Doubling("cuda")
    for _ in range(3):
        graphs.run(("k",), (step.src,), step.launch)
    # The same key over another tensor: not the captured graph's addresses.
    other.src.fill_(3)
    graphs.run(("k",), (other.src,), other.launch)
    assert other.out.tolist() == other.want() and other.calls == 1
    graphs.run(("k2",), (step.src,), step.launch)  # another key: eager, first sighting
    assert step.calls == 3 and graphs.num_graphs == 1
    graphs.run(("k",), (other.src,), other.launch)  # second sighting: its own graph
    other.src.fill_(-1)
    graphs.run(("k",), (other.src,), other.launch)
    assert other.out.tolist() == other.want() and graphs.num_graphs == 2


@needs_cuda
def test_launches_that_cannot_be_captured_stay_eager(monkeypatch):
    graphs, step = StepGraphs(torch.device("cuda"), "test", capture_after=2), Doubling("cuda")

    def syncing_launch() -> None:  # reads a value on the host: illegal while capturing
        step.launch()
        step.out.add_(float(step.src.sum().item()) * 0)

    messages = logged(monkeypatch, "warning")
    for i in range(4):
        step.src.fill_(i)
        graphs.run(("k",), (step.src,), syncing_launch)
        assert step.out.tolist() == step.want()
    assert graphs.num_graphs == 0 and graphs.replays == 0
    assert len(messages) == 1 and "could not be captured" in messages[0]
    torch.cuda.synchronize()  # the failed capture left the device usable
    # and its random generator too (sampling draws from it), at the same seed.
    seed = torch.cuda.initial_seed()
    assert torch.randn(8, device="cuda").isfinite().all()
    assert torch.cuda.initial_seed() == seed


@needs_cuda
def test_launches_with_temporaries_share_one_pool_and_replay_right():
    """shared_pool: graphs whose launches allocate temporaries (torch ops) take them
    from one pool; each replay reads its inputs as they are now, whichever graph ran
    before it, and a second signature's capture adds no pool of its own."""
    graphs = StepGraphs(torch.device("cuda"), "test", shared_pool=True, capture_after=2)
    src = torch.arange(64, dtype=torch.float32, device="cuda")
    out = torch.zeros(64, device="cuda")

    def launch(n: int):
        def run() -> None:  # temporaries: the sort, the cumsum, the product
            out[:n].copy_(src[:n].sort(descending=True).values.cumsum(0) * 2)
        return run

    def want(n: int) -> list[float]:
        return (src[:n].sort(descending=True).values.cumsum(0) * 2).tolist()

    for i in range(4):
        for n in (16, 64):
            src.copy_(torch.randn(64, device="cuda") * (i + 1))
            graphs.run((n,), (), launch(n))
            assert out[:n].tolist() == pytest.approx(want(n))
    # Per signature: call 1 eager, call 2 captured and replayed, 3-4 replay.
    assert graphs.num_graphs == 2 and graphs.replays == 6
    pool = graphs._pool
    assert pool is not None
    graphs.run((32,), (), launch(32))
    graphs.run((32,), (), launch(32))  # a third graph, in the same pool
    assert graphs._pool == pool and graphs.num_graphs == 3


@pytest.mark.parametrize("value,enabled", [(None, True), ("1", True), ("0", False), ("", False)])
def test_the_environment_switch(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv(step_graphs.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(step_graphs.ENV_VAR, value)
    assert step_graphs.enabled_by_env() is enabled
