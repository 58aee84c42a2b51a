"""vllm_ddtree/sizing.py and scheduler.py without an engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.sizing import TreeSizer, candidate_sizes
from vllm_ddtree.spec_config import adaptive_schedule


def drive(sizer: TreeSizer, num_reqs: int, accepted_of, seconds_of, steps: int) -> list[int]:
    """Run ``steps`` steps of a fixed batch: the sizer chooses, the 'engine' answers
    with the acceptance and step time of that size."""
    chosen = []
    for _ in range(steps):
        k = sizer[num_reqs]
        chosen.append(k)
        outcomes = [(k, accepted_of(k))] * num_reqs if k else []
        rows = num_reqs * (k + 1)
        sizer.observe(outcomes, rows, seconds_of(rows))
    return chosen


def test_candidate_sizes():
    assert candidate_sizes(16) == [0, 2, 4, 8, 16]
    assert candidate_sizes(5) == [0, 1, 2, 5]
    assert candidate_sizes(1) == [0, 1]
    assert adaptive_schedule(16) == [(1, 1, 16), (2, 2, 8), (3, 3, 4), (4, 4, 2),
                                     (5, 1 << 20, 0)]


def test_flat_cost_takes_the_whole_tree_and_load_takes_less():
    accepted = {2: 1.2, 4: 1.8, 8: 2.3, 16: 2.6}.get
    # Memory-bound step: time flat up to 512 rows, then linear.
    def seconds(rows):
        return 0.005 * max(1.0, rows / 512)

    def truth(n):  # the size with the most tokens per second, from the true functions
        return max([0, 2, 4, 8, 16],
                   key=lambda k: n * (1 + (accepted(k) or 0)) / seconds(n * (k + 1)))

    light = drive(TreeSizer(16), 2, accepted, seconds, 200)
    assert truth(2) == 16 and light[-100:].count(16) > 90
    for n, want in ((64, 8), (128, 4), (256, 2)):
        assert truth(n) == want
        heavy = drive(TreeSizer(16), n, accepted, seconds, 200)
        assert heavy[-100:].count(want) > 90, (n, heavy[-100:])


def test_no_tree_when_speculation_cannot_pay():
    accepted = {2: 0.1, 4: 0.1, 8: 0.1, 16: 0.1}.get
    chosen = drive(TreeSizer(16), 32, accepted, lambda rows: 0.001 * rows, 300)
    tail = chosen[-128:]
    assert tail.count(0) > 0.9 * len(tail)
    # and it still looks at the other sizes now and then
    assert set(tail) - {0}


def test_exploration_follows_a_change_in_acceptance():
    sizer = TreeSizer(16)
    def seconds(rows):
        return 0.004 + 0.0001 * rows

    drive(sizer, 16, {2: 0.2, 4: 0.2, 8: 0.2, 16: 0.2}.get, seconds, 300)
    assert sizer.best(16) == 0
    # The drafter got better (a new workload): one step in 32 looks at each other size.
    later = drive(sizer, 16, {2: 1.5, 4: 2.5, 8: 3.5, 16: 4.5}.get, seconds, 3000)
    assert sizer.best(16) == 4 and later[-1] == 4


def test_step_time_interpolates_and_scales():
    sizer = TreeSizer(4)
    assert sizer.step_time(10) is None and sizer.best(3) == 4
    sizer.observe([], 10, 0.010)
    sizer.observe([], 30, 0.030)
    assert sizer.step_time(5) == 0.010
    assert sizer.step_time(20) == pytest.approx(0.020)
    assert sizer.step_time(60) == pytest.approx(0.060)


def test_report_lists_the_sizes_chosen():
    sizer = TreeSizer(8)
    drive(sizer, 3, lambda k: 1.0, lambda rows: 0.001, 10)
    line = sizer.report(now=100.0)
    assert "3 reqs:" in line and "accepted drafts per request by size" in line
    assert sizer.report(now=101.0) is None  # at most one line per LOG_EVERY_S


def test_scheduler_feeds_decode_steps_only():
    from vllm_ddtree.scheduler import observe_step

    sizer = TreeSizer(4)
    decode = SimpleNamespace(
        scheduled_spec_decode_tokens={"a": [1, 2, 3, 4], "b": [5, 6]},
        num_scheduled_tokens={"a": 5, "b": 3}, total_num_scheduled_tokens=8)
    out = SimpleNamespace(sampled_token_ids=[[9, 9, 9], [9]], req_id_to_index={"a": 0, "b": 1})
    observe_step(sizer, decode, out, 0.02)
    assert sizer.accepted(4) == 2 and sizer.accepted(2) == 0
    assert sizer.step_time(8) == 0.02
    prefill = SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 2, 3, 4]},
                              num_scheduled_tokens={"a": 5, "c": 40},
                              total_num_scheduled_tokens=45)
    observe_step(sizer, prefill, out, 0.5)
    assert sorted(sizer._cost) == [8]  # the prompt's step is not a decode step's cost


def test_adaptive_key():
    assert DDTreeConfig.from_user_keys({"ddtree_adaptive": True}, block_size=8,
                                       vocab_size=100).adaptive
    assert not DDTreeConfig.from_user_keys({}, block_size=8, vocab_size=100).adaptive
    with pytest.raises(ValueError, match="ddtree_adaptive must be true or false"):
        DDTreeConfig.from_user_keys({"ddtree_adaptive": "yes"}, block_size=8, vocab_size=100)
