"""Step prices: the measured cost curve corrected by the step times the engine observes, the drafting
overhead, and the decision to stop proposing drafts where they do not pay."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from conftest import reference_greedy

from lookahead import LookaheadConfig, generate
from lookahead.config import AUTO_CONFIG
from lookahead.core.drafts import Draft
from lookahead.core.prices import StepPrices


def linear_curve(slope: float):
    """A measured curve whose every row beyond the first costs `slope` one-row steps, at any batch size."""
    return lambda batch: (lambda height: 1.0 + slope * (height - 1))


def test_a_drafted_step_comes_first_then_a_one_row_step_to_price_the_others():
    prices = StepPrices(linear_curve(0.1))
    assert prices.drafts(4) is True  # nothing known yet: drafts
    prices.record(4, 6, 0.015, 0.002, drafted=True, tokens=8)
    assert prices.drafts(4) is False  # a one-row step, for the price of the rows and of drafting
    prices.record(4, 1, 0.010, 0.001, drafted=False)
    assert prices.drafts(4) is True  # too few drafted steps to judge whether drafts pay
    assert prices.drafts(8) is True  # another batch size learns apart


@pytest.mark.parametrize("tokens, pays", [(9, False), (10, True)])
def test_rows_and_drafting_cost_what_the_steps_took(tokens, pays):
    prices = StepPrices(linear_curve(0.1))
    prices.record(4, 1, 0.010, 0.004 * 0.5, drafted=False)  # 0.5 ms a sequence outside a plain step
    prices.record(4, 5, 0.018, 0.004 * 2.0, drafted=True)  # 2 ms a sequence outside a drafted step
    cost = prices.cost(4)
    # Rows: 4 extra rows took 0.8 one-row forwards where the curve said 0.4 (twice dearer). Outside the
    # forward: 4 sequences x 2 ms over a 10 ms one-row forward.
    assert cost(5) == pytest.approx(1.0 + 0.4 * 2.0 + 0.8)
    assert cost(1) == pytest.approx(1.8)
    assert StepPrices(linear_curve(0.1)).cost(4)(5) == pytest.approx(1.4)  # the curve alone before any step
    # A drafted step is worth the tokens it committed over its cost in plain steps (1 + 4 x 0.5 / 10 = 1.2
    # each): 9 tokens of 4 sequences at 2.6 / 1.2 plain steps beat plain steps by 3.8%, short of PAYS_ABOVE;
    # 10 tokens by 15%. Judged once JUDGED_AFTER drafted steps were seen, not before.
    for _ in range(StepPrices.JUDGED_AFTER - 1):
        prices.record(4, 5, 0.018, 0.004 * 2.0, drafted=True, tokens=tokens)
        assert prices.drafts(4) is True
    prices.record(4, 5, 0.018, 0.004 * 2.0, drafted=True, tokens=tokens)
    assert prices.drafts(4) is pays
    assert prices.cost(4)(5) == pytest.approx(2.6)  # the same steps: the same prices


def test_drafts_pause_where_they_did_not_pay_and_are_judged_again_after_each_pause():
    prices = StepPrices(linear_curve(0.5))
    prices.record(2, 1, 0.010, 0.0, drafted=False)
    choices = []
    for _ in range(200):
        drafted = prices.drafts(2)
        choices.append(drafted)
        if drafted:  # 3 rows each for 1 token a sequence where they cost 2 one-row steps
            prices.record(2, 3, 0.020, 0.0, drafted=True, tokens=2)
        else:
            prices.record(2, 1, 0.010, 0.0, drafted=False)
    # Judged after JUDGED_AFTER drafted steps, then pauses of 8, 16, 32 and 64 plain steps, each followed by
    # JUDGED_AFTER drafted steps judged afresh.
    judged, expected = StepPrices.JUDGED_AFTER, []
    for pause in (8, 16, 32, 64):
        expected += [True] * judged + [False] * pause
    assert choices == (expected + [True] * judged)[:200]


@pytest.mark.parametrize("proposing_ms, pauses", [(1.0, False), (3.0, True)])
def test_steps_that_fed_nothing_pause_drafts_only_where_proposing_is_dear(proposing_ms, pauses):
    """A stretch of drafted steps that found nothing worth feeding (one row, one token each) costs only the
    proposing: at 1 ms over a 20 ms step (5%) drafting goes on, since the next stretch may copy; at 3 ms
    (15%, above PROPOSING_SHARE) it pauses."""
    prices = StepPrices(linear_curve(0.1))
    prices.record(1, 1, 0.020, 0.0, drafted=False)
    for _ in range(StepPrices.JUDGED_AFTER):
        assert prices.drafts(1) is True
        prices.record(1, 1, 0.020, proposing_ms / 1000, drafted=True, tokens=1)
    assert prices.drafts(1) is not pauses


@pytest.mark.parametrize("offered", [False, True])
def test_steps_whose_budget_priced_out_every_draft_on_offer_pause_drafts(offered):
    """Sixteen sequences whose drafts the budget priced out step after step (one row each, proposing at 4% of
    a step, under PROPOSING_SHARE): after JUDGED_AFTER such steps drafting pauses, as nothing but proposing
    happened; where nothing was on offer (a stretch with nothing to copy) drafting goes on."""
    prices = StepPrices(linear_curve(0.5))
    prices.record(16, 1, 0.030, 0.016 * 0.1e-3, drafted=False)
    for _ in range(StepPrices.JUDGED_AFTER):
        assert prices.drafts(16) is True
        prices.record(16, 1, 0.030, 0.016 * 0.1e-3 + 0.0012, drafted=True, tokens=16, offered=offered)
    assert prices.drafts(16) is not offered
    if offered:  # a drafted step that fed a draft ends such a run
        fed = StepPrices(linear_curve(0.5))
        fed.record(16, 1, 0.030, 0.0, drafted=False)
        for step in range(StepPrices.JUDGED_AFTER):
            fed.drafts(16)
            height = 2 if step == StepPrices.JUDGED_AFTER - 1 else 1
            fed.record(16, height, 0.030, 0.0012, drafted=True, tokens=16 + (height - 1) * 16, offered=True)
        assert fed.drafts(16) is True


def test_drafts_are_kept_where_they_pay_and_a_one_row_step_refreshes_the_prices_now_and_then():
    prices = StepPrices(linear_curve(0.1))
    choices = []
    for _ in range(200):
        drafted = prices.drafts(1)
        choices.append(drafted)
        prices.record(1, 4 if drafted else 1, 0.013 if drafted else 0.010, 0.0, drafted, 2.0 if drafted else None)
    assert choices.count(False) == 1 + 200 // (StepPrices.REFRESH_AFTER + 1)


class Oracle:
    """Drafts the next `length` tokens of a known output, right every time."""

    name = "oracle"

    def __init__(self, output: list[int], length: int = 3) -> None:
        self.output, self.length = output, length

    def propose(self, text: list[int], limit: int) -> list[Draft]:
        following = self.output[len(text) : len(text) + min(limit, self.length)]
        return [Draft(tuple(following), self.name)] if following else []

    def observe(self, text: list[int], new: int) -> None:
        pass


@pytest.mark.parametrize("step_seconds, row_seconds, drafts_pay", [(0.03, 0.0, True), (0.03, 0.2, False)])
def test_the_engine_stops_proposing_where_its_timed_steps_show_that_drafts_do_not_pay(
        llama_tiny, monkeypatch, step_seconds, row_seconds, drafts_pay):
    """Drafts of one token that are always right, and a forward made to take 30 ms a step whatever its height
    (drafts are then nearly free) or 30 ms plus 200 ms for the draft's row (a drafted token costs 7 one-row
    steps): the engine keeps drafting in the first case and pauses drafting, for longer each time it finds the
    same, in the second; exact in both. A step sleeps what is left of its time after the real forward, so that a
    busy machine's slower forwards make rows no cheaper (drafts pay only where a one-row step takes 115 ms)."""
    from lookahead.hf import HFModelRunner

    forward = HFModelRunner.step_logits  # every forward of the engine's

    def timed(self, store, batch, argmax_only=False):
        start = time.perf_counter()
        logits = forward(self, store, batch, argmax_only)
        if batch.height <= 2:  # decoding steps (the oracle's token at most); not the prompt's or a cost probe's
            time.sleep(max(0.0, step_seconds + row_seconds * (batch.height - 1) - (time.perf_counter() - start)))
        return logits

    monkeypatch.setattr(HFModelRunner, "step_logits", timed)
    prompt = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    expected = reference_greedy(llama_tiny, prompt, 100, eos_token_id=[])  # no stop: enough drafted steps to judge
    # The oracle's drafts alone decide the height (the suffix source's, on this repetitive output, made steps of
    # up to 128 rows, each slept through: 29 s).
    config = dataclasses.replace(AUTO_CONFIG, window=0, guesses=0, suffix=0, recycle=0)
    out = generate(llama_tiny, prompt, max_new_tokens=100, config=config,
                   proposers=[Oracle(expected[0].tolist(), length=1)], eos_token_id=[])
    assert out.sequences.tolist() == expected.tolist()
    if drafts_pay:
        # a step or two without a draft (the last, with one token to go, has no room for one)
        assert out.stats.undrafted_steps <= 2 and out.stats.tokens_per_step > 1.8
    else:  # judged over 16 drafted steps (32 tokens), paused for 8; judged again, paused for 16: 88 tokens
        assert out.stats.undrafted_steps >= 8 + 16


def test_a_flat_curve_still_learns_what_tall_steps_cost():
    """A curve that prices extra rows at nothing (flat where rows are nearly free, or flattened by one fast time
    at its tallest step) would leave nothing for the correction to scale: rows are priced at a floor, and
    64-row steps found to take twice a one-row step come to be priced so."""
    prices = StepPrices(lambda batch: (lambda height: 1.0))
    prices.record(1, 1, 0.010, 0.0, drafted=False)
    for _ in range(200):
        prices.record(1, 64, 0.020, 0.0, drafted=True, tokens=1, offered=True)
        prices.record(1, 1, 0.010, 0.0, drafted=False)
    assert prices.cost(1)(64) == pytest.approx(2.0, rel=0.05)
    assert StepPrices(linear_curve(0.1)).cost(1)(5) == pytest.approx(1.4)  # a curve above the floor, as it says


def test_a_budgeted_request_beside_one_of_a_fixed_config_keeps_drafting(llama_tiny, monkeypatch):
    """Beside a request of a fixed config every step carries its drafts and is taller than one row, so the step
    prices never see the plain steps they judge drafts by: such a batch is priced by the measured curve alone.
    (Before, the budgeted request stopped drafting for good after its first step.)"""
    from lookahead.engine import Engine, RequestParams

    prompt = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(0))
    expected = reference_greedy(llama_tiny, prompt.view(1, -1), 60, eos_token_id=[])[0].tolist()
    engine = Engine(llama_tiny, max_batch=2, max_length=100)
    monkeypatch.setattr(engine, "_cost", lambda batch: (lambda height: 1.0 + 0.001 * (height - 1)))  # rows ~free
    budgeted = engine.add_request(prompt, RequestParams(max_new_tokens=60, eos_token_id=[],
                                                        proposers=[Oracle(expected)]))
    fixed = engine.add_request(prompt, RequestParams(max_new_tokens=60, eos_token_id=[], config=LookaheadConfig()))
    outputs, stats = {budgeted: [], fixed: []}, {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] += output.tokens
            if output.finished:
                stats[output.request_id] = output.stats
    assert outputs[budgeted] == outputs[fixed] == expected[20:]
    assert stats[budgeted].undrafted_steps == 0 and stats[budgeted].tokens_per_step > 2.5


def test_one_row_times_are_a_running_mean_with_a_slow_step_counted_at_one_and_a_half_usual_ones():
    prices = StepPrices(linear_curve(0.1))
    prices.record(1, 1, 2.0, 0.0, drafted=False)
    assert prices._bucket(1).one_row == 2.0  # the first time as it is
    prices.record(1, 1, 6.0, 0.0, drafted=False)  # a busy moment: counted as 1.5 times the usual
    assert prices._bucket(1).one_row == pytest.approx(0.8 * 2.0 + 0.2 * 3.0)
    prices.record(1, 1, 1.0, 0.0, drafted=False)  # faster: counted as it is
    assert prices._bucket(1).one_row == pytest.approx(0.8 * 2.2 + 0.2 * 1.0)


def test_batch_sizes_share_their_prices_from_a_power_of_two_to_the_next():
    prices = StepPrices(linear_curve(0.1))
    assert prices._bucket(5) is prices._bucket(4) is prices._bucket(7)
    assert len({id(prices._bucket(batch)) for batch in (1, 2, 3, 4, 8, 15, 16)}) == 5
    prices.record(4, 1, 2.0, 0.4, drafted=True)
    assert prices._bucket(6).one_row == 2.0 and prices._bucket(6).overhead == {True: 0.1}  # per sequence
    assert prices._bucket(8).one_row is None and prices._bucket(2).overhead == {}


@pytest.mark.parametrize("drafted_overhead, pauses", [(0.3, False), (0.5, True)])
def test_proposing_is_what_drafted_steps_spend_outside_the_forward_beyond_plain_ones(drafted_overhead, pauses):
    """Drafted steps that committed less than they cost pause drafts where proposing is dear: 0.3 s a step
    against 0.25 for a plain one is 5% of a one-row forward (under PROPOSING_SHARE), 0.5 is 25%."""
    prices = StepPrices(linear_curve(0.1))
    prices.record(1, 1, 1.0, 0.25, drafted=False)
    for _ in range(StepPrices.JUDGED_AFTER):  # one token a step, as a plain step makes, at a higher cost
        prices.record(1, 1, 1.0, drafted_overhead, drafted=True, tokens=1)
    assert prices._bucket(1).drafted.below(StepPrices.PAYS_ABOVE, StepPrices.JUDGED_AFTER)
    assert prices.drafts(1) is not pauses


def test_drafted_steps_that_commit_exactly_the_bar_still_pay():
    """`below` is strict: steps that committed exactly PAYS_ABOVE tokens per unit of cost are not below it."""
    from lookahead.core.prices import _Gain

    judged = StepPrices.JUDGED_AFTER
    assert not _Gain(committed=StepPrices.PAYS_ABOVE, spent=1.0, steps=judged).below(StepPrices.PAYS_ABOVE, judged)
    assert _Gain(committed=1.0, spent=1.0, steps=judged).below(StepPrices.PAYS_ABOVE, judged)
    assert not _Gain(committed=1.0, spent=1.0, steps=judged - 1).below(StepPrices.PAYS_ABOVE, judged)


def test_rows_found_dearer_than_four_times_the_curve_are_priced_at_four():
    """6 extra rows' worth where the curve says 0.4 (15 times dearer): the correction is capped at 4; 0.1 of
    the curve's price (0.04) is raised to half of it."""
    prices = StepPrices(linear_curve(0.1))
    prices.record(1, 1, 0.010, 0.0, drafted=False)
    prices.record(1, 5, 0.010 * (1.0 + 6.0), 0.0, drafted=False)
    assert prices.cost(1)(5) == pytest.approx(1.0 + 0.4 * 4.0)
    cheap = StepPrices(linear_curve(0.1))
    cheap.record(1, 1, 0.010, 0.0, drafted=False)
    cheap.record(1, 5, 0.010 * (1.0 + 0.04), 0.0, drafted=False)
    assert cheap.cost(1)(5) == pytest.approx(1.0 + 0.4 * 0.5)


def test_a_flat_curve_prices_each_row_beyond_the_first_at_the_floor():
    prices = StepPrices(lambda batch: (lambda height: 1.0))
    for height in (1, 2, 5, 64):
        assert prices.cost(1)(height) == pytest.approx(1.0 + StepPrices.ROW_FLOOR * (height - 1))


def test_proposing_exactly_the_share_of_a_step_does_not_pause_drafts():
    """Proposing at exactly PROPOSING_SHARE of a one-row forward (1 s over 10 s) is not dear: drafted steps
    that fed nothing and committed less than they cost go on; at a little more they pause."""
    for drafted_overhead, pauses in ((1.0, False), (1.01, True)):
        prices = StepPrices(linear_curve(0.1))
        prices.record(1, 1, 10.0, 0.0, drafted=False)
        for _ in range(StepPrices.JUDGED_AFTER):
            prices.record(1, 1, 10.0, drafted_overhead, drafted=True, tokens=1)
        assert prices._bucket(1).drafted.below(StepPrices.PAYS_ABOVE, StepPrices.JUDGED_AFTER)
        assert prices.drafts(1) is not pauses


def test_drafts_found_to_pay_after_a_pause_reset_the_pauses_to_the_first():
    """Drafts that did not pay pause for 8 steps; judged again after the pause over exactly JUDGED_AFTER
    drafted steps, they pay, and the next finding that they do not pauses for 8 steps again, not 16."""
    prices = StepPrices(linear_curve(0.5))
    prices.record(2, 1, 0.010, 0.0, drafted=False)
    for _ in range(StepPrices.JUDGED_AFTER):  # 3 rows (2 one-row steps) for 1 token a sequence: no gain
        assert prices.drafts(2) is True
        prices.record(2, 3, 0.020, 0.0, drafted=True, tokens=2)
    for _ in range(8):
        assert prices.drafts(2) is False
        prices.record(2, 1, 0.010, 0.0, drafted=False)
    for _ in range(StepPrices.JUDGED_AFTER):  # now 3 tokens a sequence at the same price
        assert prices.drafts(2) is True
        prices.record(2, 3, 0.020, 0.0, drafted=True, tokens=6)
    assert prices.drafts(2) is True  # judged over JUDGED_AFTER drafted steps: they pay
    prices.record(2, 64, 0.010 * 32.5, 0.0, drafted=True, tokens=0)  # one 64-row step that committed nothing
    pause = 0
    while not prices.drafts(2):
        pause += 1
        prices.record(2, 1, 0.010, 0.0, drafted=False)
    assert pause == 8


def test_a_step_that_drafted_one_row_is_followed_by_a_plain_one_to_price_plain_steps():
    """A drafted one-row step gives the one-row time but not what plain steps spend outside the forward:
    the next step runs without drafts to learn it; a plain step taller than one row gives the overhead but
    not the one-row time: likewise."""
    prices = StepPrices(linear_curve(0.1))
    prices.record(4, 1, 0.010, 0.004, drafted=True, tokens=4)
    assert prices._bucket(4).one_row == 0.010
    assert prices.drafts(4) is False
    prices.record(4, 1, 0.010, 0.002, drafted=False)
    assert prices.drafts(4) is True
    other = StepPrices(linear_curve(0.1))
    other.record(4, 3, 0.012, 0.002, drafted=False)
    other.record(4, 3, 0.012, 0.004, drafted=True, tokens=4)
    assert other.drafts(4) is False


def test_a_one_row_step_is_run_after_exactly_refresh_after_drafted_steps():
    prices = StepPrices(linear_curve(0.1))
    prices.record(1, 1, 0.010, 0.0, drafted=False)
    prices.record(1, 4, 0.013, 0.0, drafted=True, tokens=2)
    choices = []
    for _ in range(2 * StepPrices.REFRESH_AFTER + 2):
        drafted = prices.drafts(1)
        choices.append(drafted)
        prices.record(1, 4 if drafted else 1, 0.013 if drafted else 0.010, 0.0, drafted, 2 if drafted else None)
    period = [True] * StepPrices.REFRESH_AFTER + [False]  # the ages count calls to `drafts`, not records
    assert choices == period + period


def test_what_steps_spend_outside_the_forward_is_a_running_mean_per_sequence():
    prices = StepPrices(linear_curve(0.1))
    prices.record(4, 1, 1.0, 0.4, drafted=False)
    prices.record(4, 1, 1.0, 0.8, drafted=False)
    prices.record(4, 3, 1.2, 1.2, drafted=True, tokens=4)
    assert prices._bucket(4).overhead == pytest.approx({False: 0.8 * 0.1 + 0.2 * 0.2, True: 0.3})


def test_a_two_row_drafted_step_counts_as_one_that_fed_a_draft():
    """Drafted steps of two rows (the last token and one node) that did not pay pause drafts, even where
    proposing is cheap and the budget fed every step something."""
    prices = StepPrices(linear_curve(0.5))
    prices.record(2, 1, 0.010, 0.0, drafted=False)
    for _ in range(StepPrices.JUDGED_AFTER):
        assert prices.drafts(2) is True
        prices.record(2, 2, 0.015, 0.0, drafted=True, tokens=2, offered=True)
    assert prices._bucket(2).fed.steps == StepPrices.JUDGED_AFTER
    assert prices.drafts(2) is False


def test_drafts_pause_after_exactly_judged_after_declined_steps_in_a_row():
    """A fed step, then declined steps (drafts on offer, none fed), proposing cheap and nothing gained: 15
    declined in a row are not yet a run of JUDGED_AFTER, 16 are."""
    prices = StepPrices(linear_curve(0.5))
    prices.record(16, 1, 0.030, 0.0, drafted=False)
    assert prices.drafts(16) is True
    prices.record(16, 2, 0.045, 0.0012, drafted=True, tokens=16, offered=True)
    for _ in range(StepPrices.JUDGED_AFTER - 1):
        assert prices.drafts(16) is True
        prices.record(16, 1, 0.030, 0.0012, drafted=True, tokens=16, offered=True)
    assert prices._bucket(16).drafted.below(StepPrices.PAYS_ABOVE, StepPrices.JUDGED_AFTER)
    assert prices.drafts(16) is True  # 15 declined in a row
    prices.record(16, 1, 0.030, 0.0012, drafted=True, tokens=16, offered=True)
    assert prices.drafts(16) is False  # 16
