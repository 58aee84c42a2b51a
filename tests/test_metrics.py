"""vllm_ddtree/metrics.py without an engine: what one step's spec-decode stats add."""

from __future__ import annotations

from types import SimpleNamespace

import prometheus_client
import pytest
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_ddtree import metrics
from vllm_ddtree.config import DDTreeConfig


def value(name: str, **labels: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


def config(ddtree):
    return SimpleNamespace(speculative_config=SimpleNamespace(ddtree=ddtree),
                           model_config=SimpleNamespace(served_model_name="m-test"))


def test_a_step_adds_its_counts_per_depth_up_to_the_trees_depth():
    ddtree = DDTreeConfig(budget=8, block_size=4, vocab_size=100)  # depth 3
    stat_logger = metrics.DDTreeStatLogger(config(ddtree), engine_index=5)
    labels = {"model_name": "m-test", "engine": "5"}
    before = {d: value("ddtree:accepted_tokens_per_depth_total", **labels, depth=str(d))
              for d in (1, 2, 3)}
    stats = SpecDecodingStats(num_spec_tokens=8, num_drafts=3, num_draft_tokens=24,
                              num_accepted_tokens=4,
                              num_accepted_tokens_per_pos=[2, 1, 1, 0, 0, 0, 0, 0])
    stat_logger.record(SimpleNamespace(spec_decoding_stats=stats), None)
    assert value("ddtree:verify_steps_total", **labels) == 3
    assert value("ddtree:tree_nodes_total", **labels) == 24
    assert value("ddtree:accepted_tokens_total", **labels) == 4
    after = {d: value("ddtree:accepted_tokens_per_depth_total", **labels, depth=str(d))
             for d in (1, 2, 3)}
    assert [after[d] - before[d] for d in (1, 2, 3)] == [2, 1, 1]
    assert value("ddtree:accepted_tokens_per_depth_total", **labels, depth="4") == 0
    assert value("ddtree:tree_size_sum", **labels) == pytest.approx(8.0)
    # A step without drafts (prefill only) adds nothing.
    stat_logger.record(SimpleNamespace(spec_decoding_stats=None), None)
    assert value("ddtree:tree_size_count", **labels) == 1


def test_other_engines_get_no_metrics():
    stat_logger = metrics.DDTreeStatLogger(
        SimpleNamespace(speculative_config=None, model_config=None))
    stat_logger.record(SimpleNamespace(spec_decoding_stats=object()), None)  # no error


def test_vllm_loads_it_as_a_stat_logger_plugin():
    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    assert metrics.DDTreeStatLogger in load_stat_logger_plugin_factories()
