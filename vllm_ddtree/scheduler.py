"""vLLM's scheduler with DDTree's tree sizer (``ddtree_adaptive``; sizing.py).

vLLM's scheduler already asks a batch-size lookup, each step, how many drafts to
schedule (``dynamic_sd_lookup[num_requests]``, built from
``num_speculative_tokens_per_batch_size``). A DDTree engine with ``ddtree_adaptive``
gets this scheduler (``scheduler_cls``, vLLM's seam), whose lookup is the
:class:`~vllm_ddtree.sizing.TreeSizer`, fed after every step with what the step
verified, what the target accepted and how long the step took. The model runners
then build the best tree of the size asked (runner/v1_proposer.py,
runner/v2_speculator.py). Slot accounting stays vLLM's: it schedules the size it was
told, as for any dynamic draft length.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.runner import step_graphs
from vllm_ddtree.sizing import TreeSizer

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers


class TreeSizingMixin:
    """Installs the sizer as the scheduler's draft-length lookup and feeds it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ddtree = get_ddtree_config(self.vllm_config)
        assert ddtree is not None, "the DDTree scheduler runs DDTree engines only"
        self.tree_sizer = TreeSizer(ddtree.budget)
        self.dynamic_sd_lookup = self.tree_sizer
        self._last_output_at: float | None = None
        self._graphs_logged = dict(step_graphs.TALLY)  # as of the last log line
        logger.info("DDTree: tree size chosen per step from measured acceptance and step "
                    "time, among %s nodes (ddtree_adaptive).", self.tree_sizer.sizes)

    def update_from_output(self, scheduler_output, model_runner_output):
        now = time.perf_counter()
        seconds = None if self._last_output_at is None else now - self._last_output_at
        self._last_output_at = now
        observe_step(self.tree_sizer, scheduler_output, model_runner_output, seconds)
        line = self.tree_sizer.report()
        if line is not None:
            logger.info(line + self._graphs_since_last_line())
        return super().update_from_output(scheduler_output, model_runner_output)

    def _graphs_since_last_line(self) -> str:
        """The runner's step graphs met for the first time since the last line, where
        the runner shares this process (one GPU: vLLM runs the worker in the engine's
        process); a step that ran such a shape eagerly or captured it took longer."""
        now = dict(step_graphs.TALLY)
        last, self._graphs_logged = self._graphs_logged, now
        new = {key: now.get(key, 0) - last.get(key, 0) for key in ("eager", "captures",
                                                                     "capture_s")}
        if not new["eager"] and not new["captures"]:
            return ""
        return (f"; step graphs: {new['eager']} new shapes run eagerly, {new['captures']} "
                f"captured in {new['capture_s'] * 1e3:.0f} ms")


def observe_step(sizer: TreeSizer, scheduler_output, model_runner_output,
                 seconds: float | None) -> None:
    """Tell the sizer what one step verified and accepted, and, for a pure decode step
    (every request verifying drafts, no prompt tokens), its batch size, the size its
    requests verified (the last step's), the size it drafted for the next step
    (``num_spec_tokens_to_schedule``) and its duration."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    sampled = model_runner_output.sampled_token_ids
    index = model_runner_output.req_id_to_index
    outcomes = []
    for req_id, drafts in spec.items():
        i = index.get(req_id)
        if i is not None and i < len(sampled) and sampled[i]:
            outcomes.append((len(drafts), len(sampled[i]) - 1))
    num_scheduled = scheduler_output.num_scheduled_tokens
    decode_only = len(num_scheduled) > 0 and all(
        num_scheduled[req_id] == 1 + len(spec.get(req_id, ())) for req_id in num_scheduled
    )
    verified = {len(spec.get(req_id, ())) for req_id in num_scheduled}
    if not decode_only or len(verified) != 1:
        sizer.observe(outcomes, seconds=seconds, prompt=not decode_only)  # only logged
        return
    sizer.observe(outcomes, num_reqs=len(num_scheduled), verified=verified.pop(),
                  drafted=scheduler_output.num_spec_tokens_to_schedule, seconds=seconds)


class DDTreeScheduler(TreeSizingMixin, Scheduler):
    pass


class DDTreeAsyncScheduler(TreeSizingMixin, AsyncScheduler):
    pass


def make_scheduler(*args: Any, **kwargs: Any):
    """What ``scheduler_cls`` names: vLLM decides async scheduling after the engine's
    arguments are read, so the class is picked when the engine builds its scheduler."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    asynchronous = vllm_config.scheduler_config.async_scheduling
    cls = DDTreeAsyncScheduler if asynchronous else DDTreeScheduler
    return cls(*args, **kwargs)
