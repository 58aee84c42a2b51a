"""The verify tree's size, chosen each step from what the engine sees (ddtree_adaptive).

A step over ``n`` requests at size ``k`` verifies ``n`` trees of ``k`` nodes and yields
``n * (1 + a(k))`` tokens, ``a(k)`` being the mean accepted drafts per request at size
``k``. The size that maximises tokens per second is

    argmax_k  n * (1 + a(k)) / t(n, k)

over a few sizes (the budget, its halves down to an eighth, and 0: no drafts), where

- ``a(k)`` is measured: the accepted drafts of every request that verified ``k``
  drafts, a running mean per size (accepted lengths are what the target decided, so
  the estimate needs no drafter calibration);
- ``t(n, k)`` is measured: the engine's time per step, as the interval between
  consecutive step outputs, a median per size and batch size, linear in the batch
  size between the batch sizes timed and flat below the smallest.

Beyond the largest batch size ``n0`` timed at size ``k``, ``t(n, k)`` takes the shape
of another size's curve: ``t(n0, k) * t(n, j) / t(n0, j)``, where ``j`` is, of the
other sizes timed both at or below ``n0`` and beyond it, the one timed at the largest
batch (on a tie, the size nearest ``k``, whose cost grows most alike). A step's time
is mostly fixed overhead, so scaling ``t(n0, k)`` by ``n / n0`` would price a size
timed only at small batches far above one timed at ``n``. Where no other size is
timed beyond ``n0``, and for ``j`` itself beyond its largest batch, the time grows in
proportion to the batch size, as if a step had no fixed overhead: the dearest guess.

Which step a time belongs to: vLLM asks for the size when it schedules a step, and
the runner drafts that many tokens at the end of that step, for the next one to
verify. A step therefore verifies the previous step's size and drafts its own, and
its time is the cost of both: the drafter's pass is skipped where the new size is 0,
whatever the step verified. So a time counts only for a *steady* step, one that
verified the size it drafted (every request, no prompt tokens): the cost of a step at
that size, as a run of such steps pays it. Counting every step would charge a size-0
step with the next step's drafter pass and hand that pass's saving to the tree size
before it, making trees look cheaper under load than they are.

Every size is tried at each new scale of batch (batch sizes within a factor of two:
1, 2-3, 4-7, ...; largest size first), so each size's cost is measured near every batch
size the engine meets, not extrapolated from batches far smaller. A size tried is held
for ``TRY_STEPS`` steps: the first verifies the size before it, the others are steady
and give a time each, so the median of a try passes over one slow step. A try counts
once it gave a steady time: under a server's steady arrivals most steps carry a new
request's prompt, and a size whose try had none is tried again (the size tried least
lately first, up to ``UNTIMED_TRIES`` times) rather than left unpriced, which would leave
the budget in place. After the
first tries, a size other than the best is tried again when it is due: no sooner than
one try of some size in ``explore_every`` steps would have it (tries then take at most
one step in 16), and late enough that the tries of all other sizes together cost about
``EXPLORE_SHARE`` more time than the best size would have (with five sizes, a size
twice as dear as the best is tried about every 800 steps, one eight times as dear
about every 5,600). The sizer is vLLM's batch-size lookup
(``scheduler.dynamic_sd_lookup[n]``): the scheduler asks it once per step for the
drafts to schedule next. Trees of a chosen size are the best trees of that size
(ops/subtree.py); any size is lossless.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

EXPLORE_EVERY = 64  # fewest steps per try, over the sizes other than the best
EXPLORE_SHARE = 0.02  # most extra time that the tries of other sizes may cost, together
TRY_STEPS = 4  # steps a size tried is held: TRY_STEPS - 1 steady times
UNTIMED_TRIES = 16  # tries of a size at one scale that may go untimed before it waits its turn
ACCEPT_WINDOW = 256  # request-steps per size in the acceptance mean
COST_WINDOW = 15  # steady step times per (size, batch size) in the cost median
LOG_EVERY_S = 10.0
IDLE_S = 0.5  # an interval between step outputs this long held idle time, not a step
# The steps not timed, as the log line names them.
UNTIMED_KINDS = ("steps with prompts", "decode steps of mixed sizes", "steps changing size")


def candidate_sizes(budget: int) -> list[int]:
    """0, then the budget halved three times at most (not below 1), ascending:
    ``[0, 2, 4, 8, 16]`` for 16. Each size is a verify width with its own CUDA graphs."""
    sizes = {0}
    k = budget
    while k >= max(1, budget // 8):
        sizes.add(k)
        k //= 2
    return sorted(sizes)


def scale_of(num_reqs: int) -> int:
    """Batch sizes within a factor of two share a scale: 1, 2-3, 4-7, ..."""
    return max(num_reqs, 1).bit_length()


@dataclass
class TreeSizer:
    """Chooses each step's tree size; see the module docstring."""

    budget: int
    explore_every: int = EXPLORE_EVERY
    sizes: list[int] = field(init=False)
    _accepted: dict[int, deque] = field(init=False)  # size -> accepted drafts per request
    _last_tried: dict[tuple[int, int], int] = field(init=False)  # (scale, size) -> step
    _timed: set[tuple[int, int]] = field(init=False)  # (scale, size) with a steady time
    _tries: Counter = field(init=False)  # (scale, size) -> tries while untimed
    _hold: tuple[int, int] | None = field(init=False, default=None)  # (size, steps left)
    _cost: dict[int, dict[int, deque]] = field(init=False)  # size -> batch -> seconds
    _batches: dict[int, list[int]] = field(init=False)  # size -> batch sizes timed, ascending
    _median: dict[tuple[int, int], float] = field(init=False)  # (size, batch) -> median
    _step: int = field(init=False, default=0)
    _seen: int = field(init=False, default=0)  # steps observed, since the log
    _steady: int = field(init=False, default=0)  # of them timed (steady), since the log
    _chosen: dict[int, Counter] = field(init=False)  # batch -> sizes chosen, since the log
    _untimed: dict[str, list[float]] = field(init=False)  # kind -> intervals, since the log
    _steady_s: float = field(init=False, default=0.0)  # seconds of the timed ones, since the log
    _last_log: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        self.sizes = candidate_sizes(self.budget)
        self._accepted = {k: deque(maxlen=ACCEPT_WINDOW) for k in self.sizes if k > 0}
        self._last_tried = {}
        self._timed = set()
        self._tries = Counter()
        self._cost = {k: {} for k in self.sizes}
        self._batches = {k: [] for k in self.sizes}
        self._median = {}
        self._chosen = {}
        self._untimed = {kind: [] for kind in UNTIMED_KINDS}

    # vLLM's scheduler reads the size as dynamic_sd_lookup[num_requests].
    def __getitem__(self, num_reqs: int) -> int:
        return self.choose(num_reqs)

    def choose(self, num_reqs: int) -> int:
        self._step += 1
        scale = scale_of(num_reqs)
        tried = self._last_tried
        # Not yet timed at this scale: a try that gave no steady step (every step of it
        # had prompt tokens, as under a server's steady arrivals) does not count.
        # A scale whose steps never give a time stops being tried after UNTIMED_TRIES.
        untimed = [k for k in self.sizes if (scale, k) not in self._timed
                   and self._tries[(scale, k)] < UNTIMED_TRIES]
        if self._hold is not None:
            k, left = self._hold
            self._hold = (k, left - 1) if left > 1 else None
        elif untimed:  # the one tried least lately, the largest first
            k = self._try(min(untimed, key=lambda s: (tried.get((scale, s), 0), -s)))
            self._tries[(scale, k)] += 1
        else:
            k = self.best(num_reqs)
            due = [s for s in self.sizes if s != k and self._due(num_reqs, scale, s, k)]
            if due:
                k = self._try(min(due, key=lambda s: tried.get((scale, s), 0)))
        tried[(scale, k)] = self._step
        self._chosen.setdefault(num_reqs, Counter())[k] += 1
        return k

    def _try(self, k: int) -> int:
        """Holds size ``k`` for the next TRY_STEPS - 1 steps too."""
        self._hold = (k, TRY_STEPS - 1)
        return k

    def _due(self, num_reqs: int, scale: int, k: int, best: int) -> bool:
        """Whether size ``k`` should be tried again instead of ``best`` (module docstring)."""
        # A size timed at this scale without being chosen at it (a step's batch can
        # differ from the one its size was chosen for) counts as tried at the start.
        waited = self._step - self._last_tried.get((scale, k), 0)
        if waited < self.explore_every * (len(self.sizes) - 1):  # one try in explore_every
            return False
        t_k, t_best = self.step_time(num_reqs, k), self.step_time(num_reqs, best)
        if t_k is None or t_best is None:
            return True
        share = EXPLORE_SHARE / (len(self.sizes) - 1)  # each other size's part
        return waited * share * t_best >= TRY_STEPS * (t_k - t_best)

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
        seconds = self.step_time(num_reqs, k)
        if accepted is None or seconds is None:
            return None
        return num_reqs * (1.0 + accepted) / seconds

    def accepted(self, k: int) -> float | None:
        if k == 0:
            return 0.0
        seen = self._accepted[k]
        return sum(seen) / len(seen) if seen else None

    def step_time(self, num_reqs: int, k: int) -> float | None:
        """Seconds per steady step of ``num_reqs`` requests at size ``k``: the median
        where this batch size was timed, else linear between the nearest timed ones,
        flat below the smallest, and beyond the largest, ``n0``, shaped as the curve of
        the size that reaches furthest beyond ``n0`` (module docstring)."""
        known = self._batches[k]
        if not known:
            return None
        n0 = known[-1]
        if num_reqs <= n0:
            return self._interpolate(num_reqs, k)
        reach = [j for j in self.sizes if j != k and self._batches[j]
                 and self._batches[j][0] <= n0 < self._batches[j][-1]]
        if not reach:
            return self._median[(k, n0)] * num_reqs / n0
        j = max(reach, key=lambda j: (self._batches[j][-1], -abs(j - k), j))
        # j's own estimate beyond its largest batch is proportional: nothing reaches further.
        return (self._median[(k, n0)] * self._interpolate(num_reqs, j)
                / self._interpolate(n0, j))

    def _interpolate(self, num_reqs: int, k: int) -> float:
        """Size ``k``'s medians alone: linear between timed batch sizes, flat below the
        smallest, proportional beyond the largest (``k`` has been timed)."""
        known = self._batches[k]
        def median(n: int) -> float:
            return self._median[(k, n)]
        if num_reqs <= known[0]:
            return median(known[0])
        if num_reqs >= known[-1]:
            return median(known[-1]) * num_reqs / known[-1]
        i = bisect.bisect_left(known, num_reqs)
        hi = known[i]
        if hi == num_reqs:
            return median(hi)
        lo = known[i - 1]
        return median(lo) + (median(hi) - median(lo)) * (num_reqs - lo) / (hi - lo)

    def observe(self, drafts_and_accepted: Iterable[tuple[int, int]], num_reqs: int | None = None,
                verified: int | None = None, drafted: int | None = None,
                seconds: float | None = None, prompt: bool = False) -> None:
        """One step's outcome: ``(drafts verified, drafts accepted)`` per request, its
        duration (the interval since the last step's output) and, for a pure decode
        step, its batch size, the size every request verified and the size it drafted
        for the next step. The duration is a cost if the step is steady; otherwise it
        is only logged, by kind (UNTIMED_KINDS: ``prompt``, the step had prompt tokens;
        no ``num_reqs``, its requests verified different sizes; else it changed size)."""
        self._seen += 1
        for drafts, accepted in drafts_and_accepted:
            if drafts in self._accepted:
                self._accepted[drafts].append(accepted)
        if seconds is None or seconds <= 0:
            return
        if prompt or num_reqs is None or verified != drafted or verified not in self._cost:
            if seconds < IDLE_S:  # where the time not timed goes, for the log
                kind = 0 if prompt else 1 if num_reqs is None else 2
                self._untimed[UNTIMED_KINDS[kind]].append(seconds)
            return
        k = verified
        if num_reqs not in self._cost[k]:
            self._cost[k][num_reqs] = deque(maxlen=COST_WINDOW)
            bisect.insort(self._batches[k], num_reqs)
        self._cost[k][num_reqs].append(seconds)
        self._timed.add((scale_of(num_reqs), k))
        self._steady += 1
        self._steady_s += seconds
        # Kept here, once per sample: the scheduler reads step_time several times a step.
        self._median[(k, num_reqs)] = statistics.median(self._cost[k][num_reqs])

    def report(self, now: float | None = None) -> str | None:
        """A log line of the size chosen most often at each batch size since the last
        one, at most every LOG_EVERY_S, with the estimates behind the choice at the
        largest batch among them."""
        now = time.monotonic() if now is None else now
        if not self._chosen or now - self._last_log < LOG_EVERY_S:
            return None
        self._last_log = now
        chosen = ", ".join(f"{n} reqs: {sizes.most_common(1)[0][0]}"
                           for n, sizes in sorted(self._chosen.items()))
        widest = max(self._chosen)
        timed = f"{self._steady} of {self._seen} steps timed"
        if self._steady:
            timed += f" ({self._steady_s:.2f} s)"
        timed += "".join(f"; {kind} {len(t)} ({sum(t):.2f} s, median "
                         f"{statistics.median(t) * 1e3:.2f} ms, longest {max(t) * 1e3:.1f} ms)"
                         for kind, t in self._untimed.items() if t)
        self._chosen, self._seen, self._steady, self._steady_s = {}, 0, 0, 0.0
        self._untimed = {kind: [] for kind in self._untimed}
        means = ", ".join(
            f"{k}: {a:.2f}" for k in self.sizes if k and (a := self.accepted(k)) is not None
        )
        costs = ", ".join(
            f"{k}: {t * 1e3:.2f}" for k in self.sizes
            if (t := self.step_time(widest, k)) is not None
        )
        return (f"DDTree tree sizes chosen (batch: nodes) {chosen}; accepted drafts per "
                f"request by size {means}; step ms by size at {widest} reqs {costs} "
                f"(steady decode steps); {timed}")
