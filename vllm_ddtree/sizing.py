"""The verify tree's size, chosen each step from what the engine sees (ddtree_adaptive).

A step over ``n`` requests with trees of ``k`` nodes verifies ``n * (k + 1)`` rows and
yields ``n * (1 + a(k))`` tokens, ``a(k)`` being the mean accepted drafts per request
at size ``k``. The size that maximises tokens per second is

    argmax_k  n * (1 + a(k)) / t(n * (k + 1))

over a few sizes (the budget, its halves down to an eighth, and 0: no drafts), where

- ``a(k)`` is measured: the accepted drafts of every request that verified ``k``
  drafts, a running mean per size (accepted lengths are what the target decided, so
  the estimate needs no drafter calibration);
- ``t(r)`` is measured: the engine's time per step, as the interval between
  consecutive step outputs of pure decode steps, a median per row count, linear
  between the row counts seen and proportional to rows beyond them.

Every size is tried once at start (largest first), then one step in ``explore_every``
goes to the size tried longest ago, so the estimates follow the workload. The sizer is vLLM's
batch-size lookup (``scheduler.dynamic_sd_lookup[n]``): the scheduler asks it once per
step for the drafts to schedule next. Trees of a chosen size are the best trees of
that size (ops/subtree.py); any size is lossless.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

EXPLORE_EVERY = 32  # steps between two visits of the stalest size
ACCEPT_WINDOW = 256  # request-steps per size in the acceptance mean
COST_WINDOW = 15  # step times per row count in the cost median
LOG_EVERY_S = 10.0


def candidate_sizes(budget: int) -> list[int]:
    """0, then the budget halved three times at most (not below 1), ascending:
    ``[0, 2, 4, 8, 16]`` for 16. Each size is a verify width with its own CUDA graphs."""
    sizes = {0}
    k = budget
    while k >= max(1, budget // 8):
        sizes.add(k)
        k //= 2
    return sorted(sizes)


@dataclass
class TreeSizer:
    """Chooses each step's tree size; see the module docstring."""

    budget: int
    explore_every: int = EXPLORE_EVERY
    sizes: list[int] = field(init=False)
    _accepted: dict[int, deque] = field(init=False)  # size -> accepted drafts per request
    _last_tried: dict[int, int] = field(init=False)  # size -> step it last ran
    _cost: dict[int, deque] = field(init=False)  # rows -> seconds per step
    _rows: list[int] = field(init=False)  # the row counts of _cost, ascending
    _median: dict[int, float] = field(init=False)  # rows -> median of _cost[rows]
    _step: int = field(init=False, default=0)
    _chosen: dict[int, int] = field(init=False)  # batch size -> size, since the last log
    _last_log: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        self.sizes = candidate_sizes(self.budget)
        self._accepted = {k: deque(maxlen=ACCEPT_WINDOW) for k in self.sizes if k > 0}
        self._last_tried = {}
        self._cost = {}
        self._rows = []
        self._median = {}
        self._chosen = {}

    # vLLM's scheduler reads the size as dynamic_sd_lookup[num_requests].
    def __getitem__(self, num_reqs: int) -> int:
        return self.choose(num_reqs)

    def choose(self, num_reqs: int) -> int:
        self._step += 1
        untried = [k for k in self.sizes if k not in self._last_tried]
        if untried:
            k = untried[-1]
        elif self._step % self.explore_every == 0:
            k = min(self.sizes, key=lambda s: self._last_tried[s])
        else:
            k = self.best(num_reqs)
        self._last_tried[k] = self._step
        self._chosen[num_reqs] = k
        return k

    def best(self, num_reqs: int) -> int:
        """The size with the most expected tokens per second at this batch size (the
        largest on a tie: the tree is free where the cost is flat)."""
        rates = {k: r for k in self.sizes if (r := self.rate(num_reqs, k)) is not None}
        if not rates:
            return self.budget
        top = max(rates.values())
        return max(k for k, r in rates.items() if r >= top)

    def rate(self, num_reqs: int, k: int) -> float | None:
        """Expected tokens per second of a step of ``num_reqs`` requests at size ``k``,
        or None while either estimate is missing."""
        accepted = self.accepted(k)
        seconds = self.step_time(num_reqs * (k + 1))
        if accepted is None or seconds is None:
            return None
        return num_reqs * (1.0 + accepted) / seconds

    def accepted(self, k: int) -> float | None:
        if k == 0:
            return 0.0
        seen = self._accepted[k]
        return sum(seen) / len(seen) if seen else None

    def step_time(self, rows: int) -> float | None:
        known, median = self._rows, self._median
        if not known:
            return None
        if rows <= known[0]:
            return median[known[0]]
        if rows >= known[-1]:
            return median[known[-1]] * rows / known[-1]
        i = bisect.bisect_left(known, rows)
        hi = known[i]
        if hi == rows:
            return median[hi]
        lo = known[i - 1]
        return median[lo] + (median[hi] - median[lo]) * (rows - lo) / (hi - lo)

    def observe(self, drafts_and_accepted: Iterable[tuple[int, int]], rows: int | None,
                seconds: float | None) -> None:
        """One step's outcome: ``(drafts verified, drafts accepted)`` per request, and,
        for a pure decode step, its rows and duration."""
        for drafts, accepted in drafts_and_accepted:
            if drafts in self._accepted:
                self._accepted[drafts].append(accepted)
        if rows is not None and seconds is not None and seconds > 0:
            if rows not in self._cost:
                self._cost[rows] = deque(maxlen=COST_WINDOW)
                bisect.insort(self._rows, rows)
            self._cost[rows].append(seconds)
            # Kept here, once per sample: the scheduler reads step_time several times a step.
            self._median[rows] = statistics.median(self._cost[rows])

    def report(self, now: float | None = None) -> str | None:
        """A log line of the sizes chosen since the last one, at most every LOG_EVERY_S."""
        now = time.monotonic() if now is None else now
        if not self._chosen or now - self._last_log < LOG_EVERY_S:
            return None
        self._last_log = now
        chosen = ", ".join(f"{n} reqs: {k}" for n, k in sorted(self._chosen.items()))
        self._chosen = {}
        means = ", ".join(
            f"{k}: {a:.2f}" for k in self.sizes if k and (a := self.accepted(k)) is not None
        )
        return (f"DDTree tree sizes chosen (batch: nodes) {chosen}; accepted drafts per "
                f"request by size {means}")
