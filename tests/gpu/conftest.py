"""The GPU engine tests run a few dozen steps each: the runner's step launches are
captured at their second use here (VLLM_DDTREE_CAPTURE_AFTER=2, read by the engines'
processes as they start), so that the identity tests check the graph replays, and not
only the eager runs that come before a capture (runner/step_graphs.py)."""

from __future__ import annotations

import pytest

from vllm_ddtree.runner.step_graphs import CAPTURE_AFTER_VAR


@pytest.fixture(autouse=True)
def step_graphs_captured_at_second_use(monkeypatch):
    monkeypatch.setenv(CAPTURE_AFTER_VAR, "2")
