"""vllm_ddtree/sizing.py and scheduler.py without an engine."""

from __future__ import annotations

import collections
import itertools
import re
from types import SimpleNamespace

import pytest

from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.sizing import (
    EXPLORE_SHARE,
    TRY_STEPS,
    UNTIMED_TRIES,
    TreeSizer,
    candidate_sizes,
)
from vllm_ddtree.spec_config import adaptive_schedule


def drive(sizer: TreeSizer, num_reqs: int, accepted_of, verify_seconds, steps: int,
          draft_seconds: float = 0.0) -> list[int]:
    """Run ``steps`` steps of a fixed batch as vLLM runs them: each step verifies the
    size chosen at the step before and drafts (a pass costing ``draft_seconds``,
    skipped at size 0) the size chosen now. Returns the sizes chosen."""
    chosen, verified = [], 0
    for _ in range(steps):
        k = sizer[num_reqs]
        chosen.append(k)
        outcomes = [(verified, accepted_of(verified))] * num_reqs if verified else []
        seconds = verify_seconds(num_reqs * (verified + 1)) + (draft_seconds if k else 0.0)
        sizer.observe(outcomes, num_reqs=num_reqs, verified=verified, drafted=k,
                      seconds=seconds)
        verified = k
    return chosen


def truth(num_reqs: int, accepted_of, verify_seconds, draft_seconds: float = 0.0) -> int:
    """The size with the most tokens per second in a run of steps of that size."""
    def rate(k):
        cost = verify_seconds(num_reqs * (k + 1)) + (draft_seconds if k else 0.0)
        return num_reqs * (1 + (accepted_of(k) or 0)) / cost
    return max([0, 2, 4, 8, 16], key=rate)


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

    light = drive(TreeSizer(16), 2, accepted, seconds, 200)
    assert truth(2, accepted, seconds) == 16 and light[-100:].count(16) > 90
    for n, want in ((64, 8), (128, 4), (256, 2)):
        assert truth(n, accepted, seconds) == want
        heavy = drive(TreeSizer(16), n, accepted, seconds, 200)
        assert heavy[-100:].count(want) > 90, (n, heavy[-100:])


def test_no_tree_when_speculation_cannot_pay():
    accepted = {2: 0.1, 4: 0.1, 8: 0.1, 16: 0.1}.get
    chosen = drive(TreeSizer(16), 32, accepted, lambda rows: 0.001 * rows, 3000)
    tail = chosen[-2000:]
    assert tail.count(0) > 0.98 * len(tail)
    # and it still looks at the other sizes now and then
    assert set(tail) - {0}


def test_tries_of_dearer_sizes_cost_a_bounded_share_of_the_time():
    """A CPU-like load: trees up to six times a step without one, which is best. The
    tries that keep the estimates fresh cost about EXPLORE_SHARE more time than steps
    of the best size alone."""
    accepted = {2: 0.35, 4: 0.45, 8: 0.6, 16: 0.7}.get
    def verify(rows):
        return 0.09 + 0.004 * rows
    draft = 0.1
    def cost(k):
        return verify(8 * (k + 1)) + (draft if k else 0.0)
    assert truth(8, accepted, verify, draft) == 0 and cost(16) > 6 * cost(0)
    tail = drive(TreeSizer(16), 8, accepted, verify, 6000, draft)[-5000:]
    spent = sum(cost(k) for k in tail)
    assert spent <= (1 + 1.2 * EXPLORE_SHARE) * len(tail) * cost(0)
    assert set(tail) - {0}  # it does try them


def test_exploration_follows_a_change_in_acceptance():
    sizer = TreeSizer(16)
    def seconds(rows):
        return 0.004 + 0.0001 * rows

    drive(sizer, 16, {2: 0.2, 4: 0.2, 8: 0.2, 16: 0.2}.get, seconds, 300)
    assert sizer.best(16) == 0
    # The drafter got better (a new workload): the other sizes are tried again when due.
    later = drive(sizer, 16, {2: 1.5, 4: 2.5, 8: 3.5, 16: 4.5}.get, seconds, 3000)
    assert sizer.best(16) == 4 and later[-1] == 4


def test_the_drafter_pass_is_charged_to_the_size_that_drafts():
    """A step's time holds the verify of the last size and the drafter's pass for the
    next (none at size 0). Charged to the verified size alone, a size-0 step tried
    between tree steps looks as dear as a tree step, and the tree stays on where no
    tree is three times as fast; steady steps only give each size its own cost."""
    accepted = {2: 0.35, 4: 0.45, 8: 0.5, 16: 0.6}.get
    def verify(rows):
        return 0.002 + 0.000005 * rows
    draft = 0.006
    assert truth(32, accepted, verify, draft) == 0
    chosen = drive(TreeSizer(16), 32, accepted, verify, 400, draft_seconds=draft)
    assert chosen[-128:].count(0) > 0.9 * 128
    # while a drafter pass that costs little leaves the whole tree on
    assert truth(2, accepted, verify, 0.0002) == 16
    chosen = drive(TreeSizer(16), 2, accepted, verify, 400, draft_seconds=0.0002)
    assert chosen[-128:].count(16) > 0.9 * 128


def test_a_new_scale_of_batch_is_measured_not_extrapolated():
    """Light load: the whole tree pays. The batch then jumps to 32, where no tree is three
    times as fast; every size is tried at the new scale, so the sizer drops the tree at
    once instead of pricing size 0 from its cost at 2 requests times 16."""
    accepted = {2: 0.35, 4: 0.45, 8: 0.5, 16: 0.6}.get
    def verify(rows):
        return 0.002 + 0.000005 * rows
    def draft(n):
        return 0.0002 * n
    assert truth(2, accepted, verify, draft(2)) == 16
    assert truth(32, accepted, verify, draft(32)) == 0
    sizer = TreeSizer(16)
    assert drive(sizer, 2, accepted, verify, 200, draft(2))[-50:].count(16) > 45
    jump = drive(sizer, 32, accepted, verify, 40, draft(32))
    tries = [k for k in (16, 8, 4, 2, 0) for _ in range(TRY_STEPS)]
    assert jump[:len(tries)] == tries  # the sizes tried at the new scale
    assert jump[len(tries):] == [0] * (40 - len(tries))


def test_steady_steps_few_and_far_between_still_price_every_size():
    """A server under load: a request ends and a new one arrives on most steps, and a
    step with prompt tokens is not timed. A try whose steps all had prompt tokens gives
    no time, so the size stays untimed at that scale and is tried again, the one tried
    least lately first, instead of the budget holding for want of any other time."""
    import random

    accepted = {2: 0.5, 4: 0.6, 8: 0.68, 16: 0.7}.get
    def verify(rows):
        return 0.003 + 0.000004 * rows
    draft = 0.0012
    assert truth(64, accepted, verify, draft) == 0
    sizer, draws, verified, chosen = TreeSizer(16), random.Random(0), 0, []
    for _ in range(4000):
        num_reqs = 64 - draws.randrange(2)  # a request ended, its successor not yet in
        k = sizer[num_reqs]
        chosen.append(k)
        outcomes = [(verified, accepted(verified))] * num_reqs if verified else []
        if draws.random() < 0.97:  # a new request's prompt in this step
            sizer.observe(outcomes)
        else:
            sizer.observe(outcomes, num_reqs=num_reqs, verified=verified, drafted=k,
                          seconds=verify(num_reqs * (verified + 1)) + (draft if k else 0))
        verified = k
    assert chosen[-2000:].count(0) > 0.9 * 2000, collections.Counter(chosen[-2000:])
    line = sizer.report(now=1e9)
    timed, seen = map(int, re.search(r"(\d+) of (\d+) steps timed", line).groups())
    assert seen == 4000 and 0 < timed < 0.05 * seen


def test_a_scale_never_timed_stops_being_tried():
    """Where every step at a scale carries prompt tokens, its tries give no time; after
    UNTIMED_TRIES of each size the sizer prices that scale from the others instead of
    cycling through every size for good."""
    sizer = TreeSizer(16)
    for k, seconds in ((0, 0.004), (2, 0.006), (4, 0.007), (8, 0.009), (16, 0.012)):
        for _ in range(3):
            sizer.observe([(k, 0.1)] * 9 if k else [], num_reqs=9, verified=k, drafted=k,
                          seconds=seconds)
    assert sizer.best(40) == 0
    chosen = [sizer[40] for _ in range(len(sizer.sizes) * UNTIMED_TRIES * TRY_STEPS + 100)]
    assert collections.Counter(chosen[:-100]) == {k: UNTIMED_TRIES * TRY_STEPS
                                                 for k in sizer.sizes}
    assert chosen[-100:] == [0] * 100


def test_a_scale_timed_but_never_chosen_at_is_priced():
    """A step's batch can differ from the one its size was chosen for (requests end in
    between), so every size can be timed at a scale the sizer never chose at; it then
    prices them, and tries each again in its turn."""
    sizer = TreeSizer(16, explore_every=2)
    for k, seconds in ((0, 0.004), (2, 0.006), (4, 0.007), (8, 0.009), (16, 0.012)):
        sizer.observe([(k, 1.0)] * 9 if k else [], num_reqs=9, verified=k, drafted=k,
                      seconds=seconds)
    chosen = [sizer[9] for _ in range(2000)]
    assert chosen[0] == sizer.best(9) and set(chosen) == set(sizer.sizes)


def test_only_steady_steps_are_timed():
    sizer = TreeSizer(4)
    sizer.observe([], num_reqs=8, verified=4, drafted=0, seconds=0.5)
    sizer.observe([], num_reqs=8, verified=0, drafted=4, seconds=0.5)
    assert sizer.step_time(8, 4) is None and sizer.step_time(8, 0) is None
    sizer.observe([], num_reqs=8, verified=4, drafted=4, seconds=0.02)
    assert sizer.step_time(8, 4) == 0.02 and sizer.step_time(8, 0) is None


def test_a_size_tried_is_held_for_its_steady_steps():
    """A try holds its size for TRY_STEPS steps: the first verifies the size before it,
    the others give a steady time each."""
    assert TRY_STEPS == 4
    sizer = TreeSizer(16, explore_every=8)
    first = [sizer[4] for _ in range(20)]
    assert first == [16] * 4 + [8] * 4 + [4] * 4 + [2] * 4 + [0] * 4
    later = [sizer[4] for _ in range(120)]  # no times known: the budget, tries when due
    runs = [(k, len(list(run))) for k, run in itertools.groupby(later)]
    tries = [(k, n) for k, n in runs if k != 16]
    assert len(tries) >= 4 and all(n == TRY_STEPS for _, n in tries), runs


def test_one_slow_step_in_a_try_does_not_price_a_size_out():
    """The first steady step of the whole tree's try takes ten times as long (a stall).
    With one steady time a try, that time alone priced the whole tree, and the sizer
    kept the half tree until the tree's next try was due, thousands of steps later; the
    median of a try's steady times passes over it."""
    accepted = {2: 1.2, 4: 1.8, 8: 2.3, 16: 2.6}.get
    def seconds(rows):
        return 0.005  # flat: the whole tree is best
    steps = []
    def stalled(rows):
        steps.append(rows)
        return seconds(rows) * (10 if len(steps) == 2 else 1)  # step 2 verifies 16, drafts 16

    assert truth(8, accepted, seconds) == 16
    sizer = TreeSizer(16)
    chosen = drive(sizer, 8, accepted, stalled, 100)
    assert chosen[:2] == [16, 16] and sizer.step_time(8, 16) == 0.005
    assert sizer.best(8) == 16 and chosen[-50:].count(16) > 45, chosen


def test_step_time_beyond_the_largest_batch_borrows_another_sizes_shape():
    """Size 16 was timed at 8 and 64 requests, its step nearly all fixed overhead; size
    2 only at 8. At 64, size 2 costs what its time at 8 grows by on size 16's curve, not
    eight times its time at 8 (which would make it dearer than the whole tree)."""
    sizer = TreeSizer(16)
    for n, t in ((8, 0.0100), (64, 0.0120)):
        sizer.observe([], num_reqs=n, verified=16, drafted=16, seconds=t)
    sizer.observe([], num_reqs=8, verified=2, drafted=2, seconds=0.0090)
    assert sizer.step_time(64, 2) == pytest.approx(0.0090 * 0.0120 / 0.0100)
    assert sizer.step_time(64, 2) < sizer.step_time(64, 16)
    t32 = 0.0100 + 0.0020 * (32 - 8) / (64 - 8)  # size 16's curve, linear between its times
    assert sizer.step_time(32, 2) == pytest.approx(0.0090 * t32 / 0.0100)
    # beyond every size's largest batch the shape's own time grows in proportion
    assert sizer.step_time(128, 2) == pytest.approx(0.0090 * 0.0240 / 0.0100)
    assert sizer.step_time(4, 2) == 0.0090  # flat below the smallest, as before
    # the furthest reach sets the shape, over a nearer size timed less far
    sizer.observe([], num_reqs=8, verified=4, drafted=4, seconds=0.0095)
    sizer.observe([], num_reqs=16, verified=4, drafted=4, seconds=0.0190)
    assert sizer.step_time(64, 2) == pytest.approx(0.0090 * 0.0120 / 0.0100)
    # on a tie of reach, the nearest size
    sizer.observe([], num_reqs=64, verified=4, drafted=4, seconds=0.0380)
    assert sizer.step_time(64, 2) == pytest.approx(0.0090 * 0.0380 / 0.0095)


def test_step_time_beyond_every_timed_batch_grows_in_proportion():
    """No other size was timed beyond size 2's largest batch (or none at or below it):
    no shape to borrow, so the time grows with the batch size, the dearest guess."""
    sizer = TreeSizer(16)
    sizer.observe([], num_reqs=8, verified=2, drafted=2, seconds=0.0090)
    sizer.observe([], num_reqs=8, verified=16, drafted=16, seconds=0.0100)
    sizer.observe([], num_reqs=4, verified=8, drafted=8, seconds=0.0080)
    sizer.observe([], num_reqs=16, verified=4, drafted=4, seconds=0.0100)
    sizer.observe([], num_reqs=64, verified=4, drafted=4, seconds=0.0110)
    assert sizer.step_time(64, 2) == pytest.approx(0.0090 * 64 / 8)
    assert sizer.step_time(64, 16) == pytest.approx(0.0100 * 64 / 8)


def test_step_time_interpolates_and_scales():
    sizer = TreeSizer(4)
    assert sizer.step_time(10, 4) is None and sizer.best(3) == 4
    sizer.observe([], num_reqs=10, verified=4, drafted=4, seconds=0.010)
    sizer.observe([], num_reqs=30, verified=4, drafted=4, seconds=0.030)
    assert sizer.step_time(5, 4) == 0.010
    assert sizer.step_time(20, 4) == pytest.approx(0.020)
    assert sizer.step_time(60, 4) == pytest.approx(0.060)
    assert sizer.step_time(20, 2) is None  # sizes do not share their costs


def test_report_lists_the_sizes_chosen():
    sizer = TreeSizer(8)
    drive(sizer, 3, lambda k: 1.0, lambda rows: 0.001, 5 * TRY_STEPS)
    line = sizer.report(now=100.0)
    assert "3 reqs:" in line and "accepted drafts per request by size" in line
    assert "step ms by size at 3 reqs 0: 1.00" in line
    assert sizer.report(now=101.0) is None  # at most one line per LOG_EVERY_S


def test_report_says_where_the_time_not_timed_went():
    """Steps with prompts are not costs, but their time is logged beside the steady
    steps': where a server's time goes when the steady steps do not account for it.
    An interval of IDLE_S or more is an idle engine, not a step."""
    from vllm_ddtree.sizing import IDLE_S

    sizer = TreeSizer(4)
    for _ in range(3):
        sizer.observe([], num_reqs=8, verified=4, drafted=4, seconds=0.004)
    for seconds in (0.010, 0.030, 0.020, IDLE_S + 1):
        sizer.observe([], seconds=seconds, prompt=True)
    sizer.observe([], num_reqs=8, verified=2, drafted=4, seconds=0.005)  # a size changed
    sizer.observe([], seconds=0.007)  # requests that verified different sizes
    sizer[8]
    line = sizer.report(now=100.0)
    assert line.endswith(
        "3 of 9 steps timed (0.01 s); steps with prompts 3 (0.06 s, median 20.00 ms, "
        "longest 30.0 ms); decode steps of mixed sizes 1 (0.01 s, median 7.00 ms, longest "
        "7.0 ms); steps changing size 1 (0.01 s, median 5.00 ms, longest 5.0 ms)"), line
    sizer[8]
    sizer.observe([], num_reqs=8, verified=4, drafted=4, seconds=0.004)
    line = sizer.report(now=200.0)
    assert line.endswith("1 of 1 steps timed (0.00 s)"), line


def test_scheduler_line_counts_the_step_graphs_met_since_the_last():
    from vllm_ddtree import scheduler
    from vllm_ddtree.runner import step_graphs

    mixin = scheduler.TreeSizingMixin.__new__(scheduler.DDTreeScheduler)
    start = dict(step_graphs.TALLY)
    mixin._graphs_logged = dict(start)  # as __init__ leaves it
    try:
        assert mixin._graphs_since_last_line() == ""
        step_graphs.TALLY.update({"eager": 5, "captures": 4, "capture_s": 0.012})
        assert mixin._graphs_since_last_line() == (
            "; step graphs: 5 new shapes run eagerly, 4 captured in 12 ms")
        assert mixin._graphs_since_last_line() == ""  # counted once
    finally:
        step_graphs.TALLY.clear()
        step_graphs.TALLY.update(start)


def test_scheduler_feeds_decode_steps_only():
    from vllm_ddtree.scheduler import observe_step

    sizer = TreeSizer(4)
    # a pure decode step that verified 4 drafts a request and drafts 4 for the next
    decode = SimpleNamespace(
        scheduled_spec_decode_tokens={"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]},
        num_scheduled_tokens={"a": 5, "b": 5}, total_num_scheduled_tokens=10,
        num_spec_tokens_to_schedule=4)
    out = SimpleNamespace(sampled_token_ids=[[9, 9, 9], [9]], req_id_to_index={"a": 0, "b": 1})
    observe_step(sizer, decode, out, 0.02)
    assert sizer.accepted(4) == 1 and sizer.step_time(2, 4) == 0.02
    # the same step drafting 2 for the next: not steady, its time is not a cost
    observe_step(sizer, SimpleNamespace(**{**vars(decode), "num_spec_tokens_to_schedule": 2}),
                 out, 0.05)
    assert sizer.step_time(2, 4) == 0.02 and sizer.step_time(2, 2) is None
    # requests that verified different sizes (one capped by its length): no cost
    mixed = SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 2, 3, 4], "b": [5, 6]},
                            num_scheduled_tokens={"a": 5, "b": 3},
                            total_num_scheduled_tokens=8, num_spec_tokens_to_schedule=2)
    observe_step(sizer, mixed, out, 0.05)
    assert sizer.accepted(2) == 0 and sizer.step_time(2, 2) is None
    prefill = SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 2, 3, 4]},
                              num_scheduled_tokens={"a": 5, "c": 40},
                              total_num_scheduled_tokens=45, num_spec_tokens_to_schedule=4)
    observe_step(sizer, prefill, out, 0.05)
    assert sizer._batches[4] == [2]  # the prompt's step is not a decode step's cost
    # each untimed step is logged under its kind
    sizer[2]
    line = sizer.report(now=1e9)
    for kind in ("steps with prompts 1", "decode steps of mixed sizes 1",
                 "steps changing size 1"):
        assert f"; {kind} (0.05 s" in line, line


def test_adaptive_key():
    assert DDTreeConfig.from_user_keys({"ddtree_adaptive": True}, block_size=8,
                                       vocab_size=100).adaptive
    assert not DDTreeConfig.from_user_keys({}, block_size=8, vocab_size=100).adaptive
    with pytest.raises(ValueError, match="ddtree_adaptive must be true or false"):
        DDTreeConfig.from_user_keys({"ddtree_adaptive": "yes"}, block_size=8, vocab_size=100)
