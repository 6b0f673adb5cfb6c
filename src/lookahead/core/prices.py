"""What steps cost as they run: the measured cost curve, corrected by the step times observed, plus the time
spent proposing and verifying drafts; and whether drafts pay at all at a batch size.

The curve is timed once per machine over a short cache, with nothing else in the step; a running engine
meets longer caches (on a 2-core Xeon in bfloat16, 16 sequences of 4 rows cost 1.37x 16 of one row over
128 cached tokens, 1.60x over 400), the machine's drift, and per-sequence work outside the forward
(proposing, ranking, verifying: 10-15 ms a step at 16 sequences). Priced on the curve alone, drafts
slowed batches of 8 and more by 5-27%.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .decoder import StepCost


@dataclass
class _Gain:
    """Decaying sums over some drafted steps: the tokens per sequence they committed, and their costs in plain
    steps."""

    committed: float = 0.0
    spent: float = 0.0
    steps: int = 0

    def add(self, tokens: float, cost: float, decay: float) -> None:
        self.committed = self.committed * decay + tokens
        self.spent = self.spent * decay + cost
        self.steps += 1

    def below(self, bar: float, after: int) -> bool:
        """Whether these steps committed less than `bar` tokens per unit of cost, once `after` were seen."""
        return self.steps >= after and self.committed < bar * self.spent


@dataclass
class _Bucket:
    """Running estimates for steps of one range of batch sizes (a power of two up to the next)."""

    one_row: float | None = None  # forward seconds of a step of one row per sequence
    one_row_age: int = 0  # steps since `one_row` was last observed
    # Decaying sums over taller steps: what their rows beyond the first cost (in one-row steps), and what the
    # curve said they would.
    rows_found: float = 0.0
    rows_priced: float = 0.0
    overhead: dict[bool, float] = field(default_factory=dict)  # drafted? -> seconds per sequence outside the forward
    drafted: _Gain = field(default_factory=lambda: _Gain())  # every drafted step
    fed: _Gain = field(default_factory=lambda: _Gain())  # the drafted steps that fed rows beyond the last tokens
    declined: int = 0  # drafted steps in a row that fed none of the drafts on offer (the budget priced them out)
    plain_left: int = 0  # steps still to run without drafts before they are tried again
    retry_after: int = 0  # steps without drafts after the next finding that they do not pay

    @property
    def extra_rows(self) -> float:
        """What rows beyond the first cost, over what the curve says (1 until measured)."""
        return self.rows_found / self.rows_priced if self.rows_priced > 0 else 1.0



def _running(old: float | None, new: float, decay: float) -> float:
    return new if old is None else decay * old + (1.0 - decay) * new


class StepPrices:
    """Prices steps of B sequences by height for the budget (`cost`), learning from every step the engine
    runs (`record`): the forward time of one-row steps, how much dearer than the curve's prediction the
    extra rows came out (one factor per batch bucket, learnt from every height fed), and the seconds per
    sequence that drafted and plain steps spend outside the forward. Drafts are skipped (`drafts`) for 8
    steps wherever recent drafted steps committed, at these prices, less than `PAYS_ABOVE` times the tokens
    per unit of cost of plain steps (see PROPOSING_SHARE for which steps count), then 16, 32 and 64 steps
    while each retry finds the same; likewise where the budget fed none of the drafts on offer for
    JUDGED_AFTER drafted steps in a row and those steps did not pay (proposing was all they did: 16 sequences
    on 2 cores, float32, proposed at 5% of each step and fed nothing for 64 steps). A one-row step is run
    where none was seen for `REFRESH_AFTER` steps, so that the prices follow growing caches."""

    DECAY = 0.8  # weight of the past in the running times: about the last five observations count
    # Sums over more steps: a drafted step's worth swings from nothing (no draft worth feeding) to several
    # tokens, and steps timed on a busy machine swing by tens of per cent.
    SUM_DECAY = 0.95
    # Whether drafts pay is judged over about the last hundred drafted steps, and not before JUDGED_AFTER of
    # them (again after each pause): text runs in stretches with nothing to draft between stretches of long
    # copies. Judged over twenty steps, from the first one, and after a pause from its one retry, such stretches
    # paused drafting for up to 64 steps at a time and lost the copies after them (one sequence, float32,
    # MT-bench: 1.10-1.16x our plain loop against 1.26-1.30x never pausing).
    GAIN_DECAY = 0.99
    JUDGED_AFTER = 16
    # Drafts pause where the steps that fed drafts did not pay for their rows; and where proposing alone
    # (finding, ranking, verifying drafts) costs more than PROPOSING_SHARE of a one-row step, also where all
    # drafted steps together, those that found nothing worth feeding too, did not pay. Proposing costs 2-4% of
    # a step at one sequence (float32, 2 cores), 10-15 ms of 80 at sixteen.
    PROPOSING_SHARE = 0.1
    # Drafted steps must beat plain ones by this much: their costs are priced, not timed one by one, and near
    # even a drafted step gains nothing worth its risk.
    PAYS_ABOVE = 1.05
    RETRY_AFTER = (8, 64)  # steps without drafts once they were found not to pay: the first pause, the longest
    REFRESH_AFTER = 64
    # Rows beyond the first are priced at least this share of a one-row step each, before the correction: the
    # correction scales the curve's price of the extra rows, and a curve that prices them at nothing (flat on a
    # device where rows are nearly free, or flattened by one fast time at its tallest step) would never learn
    # what they were found to cost.
    ROW_FLOOR = 0.005

    def __init__(self, curve: Callable[[int], StepCost]) -> None:
        self._curve = curve  # batch size -> the measured relative cost by height
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch: int) -> _Bucket:
        return self._buckets.setdefault(1 << (batch.bit_length() - 1), _Bucket())

    def cost(self, batch: int) -> StepCost:
        """The relative cost of a drafted step of `batch` sequences by height (a one-row forward costs 1): the
        curve with its extra rows scaled by what they were found to cost, plus the time spent outside the
        forward (proposing, ranking, verifying)."""
        curve, seen = self._curve(batch), self._bucket(batch)
        outside = self._outside(seen, batch, drafted=True)
        extra_rows = min(max(seen.extra_rows, 0.5), 4.0)  # a few early steps on a busy machine say little
        return lambda height: 1.0 + self._rows_priced(curve, height) * extra_rows + outside

    def _rows_priced(self, curve: StepCost, height: int) -> float:
        """What the rows of a step beyond its first cost by the curve, in one-row steps (at least ROW_FLOOR each)."""
        return max(curve(height) - 1.0, self.ROW_FLOOR * (height - 1))

    @staticmethod
    def _outside(seen: _Bucket, batch: int, drafted: bool) -> float:
        """Time a step spends outside the forward, in one-row forwards (0 until both were seen)."""
        overhead = seen.overhead.get(drafted)
        return batch * overhead / seen.one_row if overhead is not None and seen.one_row else 0.0

    def drafts(self, batch: int) -> bool:
        """Whether the next step of `batch` sequences should propose drafts at all."""
        seen = self._bucket(batch)
        seen.one_row_age += 1
        if seen.plain_left > 0:  # a pause: after it, drafts are judged afresh over JUDGED_AFTER drafted steps
            seen.plain_left -= 1
            if seen.plain_left == 0:
                seen.drafted, seen.fed, seen.declined = _Gain(), _Gain(), 0
            return seen.plain_left == 0
        proposing = self._outside(seen, batch, drafted=True) - self._outside(seen, batch, drafted=False)
        declining = seen.declined >= self.JUDGED_AFTER or proposing > self.PROPOSING_SHARE
        if seen.fed.below(self.PAYS_ABOVE, self.JUDGED_AFTER) or (
                declining and seen.drafted.below(self.PAYS_ABOVE, self.JUDGED_AFTER)):
            first, last = self.RETRY_AFTER
            seen.retry_after = min(max(2 * seen.retry_after, first), last)
            seen.plain_left = seen.retry_after
            return False
        if seen.drafted.steps >= self.JUDGED_AFTER:  # judged, and found to pay
            seen.retry_after = 0
        # A plain step for the price of every other: once drafts have been tried, then now and then.
        unpriced = seen.one_row is None or False not in seen.overhead
        return not (True in seen.overhead and unpriced or seen.one_row_age > self.REFRESH_AFTER)

    def record(self, batch: int, height: int, forward_seconds: float, overhead_seconds: float,
               drafted: bool, tokens: int | None = None, offered: bool = False) -> None:
        """A step of `batch` sequences padded to `height` rows: its forward's seconds, the seconds spent
        outside it (planning, verifying), whether it carried drafts and, if it did, the tokens its sequences
        committed; `offered`: whether its sequences had drafts on offer."""
        seen, curve = self._bucket(batch), self._curve(batch)
        if height == 1:  # a step slowed by something else on the machine counts as at most 1.5 of the usual
            usual = min(forward_seconds, 1.5 * seen.one_row) if seen.one_row else forward_seconds
            seen.one_row, seen.one_row_age = _running(seen.one_row, usual, self.DECAY), 0
        elif seen.one_row is not None:
            seen.rows_found = seen.rows_found * self.SUM_DECAY + forward_seconds / seen.one_row - 1.0
            seen.rows_priced = seen.rows_priced * self.SUM_DECAY + self._rows_priced(curve, height)
        seen.overhead[drafted] = _running(seen.overhead.get(drafted), overhead_seconds / batch, self.DECAY)
        if drafted and tokens is not None:
            plain = 1.0 + self._outside(seen, batch, drafted=False)  # what a plain step costs, likewise
            cost = self.cost(batch)(height) / plain
            seen.drafted.add(tokens / batch, cost, self.GAIN_DECAY)
            if height > 1:
                seen.fed.add(tokens / batch, cost, self.GAIN_DECAY)
            seen.declined = seen.declined + 1 if height == 1 and offered else 0
