"""DDTree's own Prometheus metrics, through vLLM's stat-logger plugins
(``vllm.stat_logger_plugins``; the OpenAI server loads them).

vLLM's spec-decode counters treat every tree node as a draft token, so for a tree its
"acceptance rate" is accepted drafts over all nodes verified (a few percent at budget
16 while the tree gains), and it counts per position up to the budget, past the depth
a tree can reach. These metrics say the same in a tree's terms:

================================================  ==========================================
``ddtree:verify_steps_total``                     requests' verify steps (one tree each)
``ddtree:tree_nodes_total``                       tree nodes verified
``ddtree:accepted_tokens_total``                  drafts accepted (the bonus token excluded)
``ddtree:accepted_tokens_per_depth_total{depth}`` verify steps that accepted a draft at this
                                                  depth, for depths 1 to the tree's deepest
``ddtree:tree_size``                              histogram: mean nodes per request of each
                                                  engine step (the sizes ddtree_adaptive
                                                  chose)
================================================  ==========================================

Mean acceptance length = 1 + accepted_tokens / verify_steps; mean tree size =
tree_nodes / verify_steps (as rates over a window in PromQL). The names sit outside
vLLM's ``vllm:`` namespace, which vLLM clears when an engine starts.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_ddtree.config import get_ddtree_config

PREFIX = "ddtree:"
_COLLECTORS: dict[str, Any] = {}  # one per name and process: engines share them by label


def _collector(kind: str, name: str, doc: str, labels: list[str], **kwargs: Any):
    """The process's collector of this name, made on first use."""
    if name not in _COLLECTORS:
        import prometheus_client

        _COLLECTORS[name] = getattr(prometheus_client, kind)(name, doc, labels, **kwargs)
    return _COLLECTORS[name]


class DDTreeStatLogger(StatLoggerBase):
    """Records each engine step's spec-decode stats as DDTree metrics; does nothing for
    an engine that does not run DDTree."""

    def __init__(self, vllm_config: Any, engine_index: int = 0):
        self.ddtree = get_ddtree_config(vllm_config)
        if self.ddtree is None:
            return
        labels = {"model_name": vllm_config.model_config.served_model_name,
                  "engine": str(engine_index)}
        names = list(labels)
        self.steps = _collector("Counter", PREFIX + "verify_steps",
                                "Requests' DDTree verify steps.", names).labels(**labels)
        self.nodes = _collector("Counter", PREFIX + "tree_nodes",
                                "DDTree nodes verified.", names).labels(**labels)
        self.accepted = _collector("Counter", PREFIX + "accepted_tokens",
                                   "Drafts accepted by DDTree verify steps.",
                                   names).labels(**labels)
        per_depth = _collector("Counter", PREFIX + "accepted_tokens_per_depth",
                               "DDTree verify steps that accepted a draft at this depth.",
                               [*names, "depth"])
        self.per_depth = [per_depth.labels(**labels, depth=str(d))
                          for d in range(1, self.ddtree.max_depth + 1)]
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, self.ddtree.budget})
        self.size = _collector("Histogram", PREFIX + "tree_size",
                               "Mean DDTree nodes per request of each engine step.", names,
                               buckets=[s for s in sizes if s <= self.ddtree.budget]
                               ).labels(**labels)

    def record(self, scheduler_stats: Any, iteration_stats: Any,
               mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
        stats = getattr(scheduler_stats, "spec_decoding_stats", None)
        if self.ddtree is None or stats is None or stats.num_drafts == 0:
            return
        self.steps.inc(stats.num_drafts)
        self.nodes.inc(stats.num_draft_tokens)
        self.accepted.inc(stats.num_accepted_tokens)
        # vLLM's position j counts steps that accepted at least j + 1 drafts: in chain
        # format, depth j + 1; positions past the tree's depth are always 0.
        for counter, count in zip(self.per_depth, stats.num_accepted_tokens_per_pos):
            counter.inc(count)
        self.size.observe(stats.num_draft_tokens / stats.num_drafts)

    def log_engine_initialized(self) -> None:
        pass
