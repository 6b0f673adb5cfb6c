"""Step prices: the measured cost curve corrected by the step times the engine observes, the drafting
overhead, and the decision to stop proposing drafts where they do not pay."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from conftest import reference_greedy

from lookahead import generate
from lookahead.config import AUTO_CONFIG
from lookahead.core.drafts import Draft
from lookahead.core.prices import StepPrices


def linear_curve(slope: float):
    """A measured curve whose every row beyond the first costs `slope` one-row steps, at any batch size."""
    return lambda batch: (lambda height: 1.0 + slope * (height - 1))


def test_a_drafted_step_comes_first_then_a_one_row_step_to_price_the_others():
    prices = StepPrices(linear_curve(0.1))
    assert prices.drafts(4) is True  # nothing known yet: drafts
    prices.record(4, 6, 0.015, 0.002, drafted=True, expected_tokens=8.0)
    assert prices.drafts(4) is False  # a one-row step, for the price of the rows and of drafting
    prices.record(4, 1, 0.010, 0.001, drafted=False)
    assert prices.drafts(4) is True  # expected 2 tokens a sequence at a price below 2: drafts pay
    assert prices.drafts(8) is True  # another batch size learns apart


def test_rows_and_drafting_cost_what_the_steps_took():
    prices = StepPrices(linear_curve(0.1))
    prices.record(4, 1, 0.010, 0.004 * 0.5, drafted=False)  # 0.5 ms a sequence outside a plain step
    prices.record(4, 5, 0.018, 0.004 * 2.0, drafted=True)  # 2 ms a sequence outside a drafted step
    cost = prices.cost(4)
    # Rows: 4 extra rows took 0.8 one-row forwards where the curve said 0.4 (twice dearer). Outside the
    # forward: 4 sequences x 2 ms over a 10 ms one-row forward.
    assert cost(5) == pytest.approx(1.0 + 0.4 * 2.0 + 0.8)
    assert cost(1) == pytest.approx(1.8)
    assert StepPrices(linear_curve(0.1)).cost(4)(5) == pytest.approx(1.4)  # the curve alone before any step
    # A drafted step is worth its expected tokens over its cost in plain steps (1 + 4 x 0.5 / 10 = 1.2 each):
    # here 10% short of paying.
    prices.record(4, 5, 0.018, 0.004 * 2.0, drafted=True, expected_tokens=0.9 * 4 * 2.6 / 1.2)
    assert prices.drafts(4) is False


def test_drafts_pause_where_they_were_not_expected_to_pay_and_are_tried_again():
    prices = StepPrices(linear_curve(0.5))
    prices.record(2, 1, 0.010, 0.0, drafted=False)
    choices = []
    for _ in range(60):
        drafted = prices.drafts(2)
        choices.append(drafted)
        if drafted:  # 3 rows each for 1.2 tokens a sequence where they cost 2 one-row steps
            prices.record(2, 3, 0.020, 0.0, drafted=True, expected_tokens=2.4)
        else:
            prices.record(2, 1, 0.010, 0.0, drafted=False)
    tried = [step for step, drafted in enumerate(choices) if drafted]
    assert tried == [0, 9, 26, 59]  # pauses of 8, 16 and 32 plain steps, each ended by a try


def test_drafts_are_kept_where_they_pay_and_a_one_row_step_refreshes_the_prices_now_and_then():
    prices = StepPrices(linear_curve(0.1))
    choices = []
    for _ in range(200):
        drafted = prices.drafts(1)
        choices.append(drafted)
        prices.record(1, 4 if drafted else 1, 0.013 if drafted else 0.010, 0.0, drafted, 2.0 if drafted else None)
    assert choices.count(False) == 1 + 200 // (StepPrices.REFRESH_AFTER + 1)


class Oracle:
    """Drafts the next 3 tokens of a known output, right every time."""

    name = "oracle"

    def __init__(self, output: list[int]) -> None:
        self.output = output

    def propose(self, text: list[int], limit: int) -> list[Draft]:
        following = self.output[len(text) : len(text) + min(limit, 3)]
        return [Draft(tuple(following), self.name)] if following else []

    def observe(self, text: list[int], new: int) -> None:
        pass


@pytest.mark.parametrize("step_seconds, row_seconds, drafts_pay", [(0.03, 0.0, True), (0.01, 0.03, False)])
def test_the_engine_stops_proposing_where_its_timed_steps_show_that_drafts_do_not_pay(
        llama_tiny, monkeypatch, step_seconds, row_seconds, drafts_pay):
    """Drafts that are always right, and a forward made to take 30 ms a step whatever its height (drafts
    are then nearly free) or 10 ms plus 30 ms a row beyond the first (3 drafted tokens cost 10 one-row
    steps): the engine keeps drafting in the first case and stops in the second, exact in both."""
    from lookahead.hf import HFModelRunner

    forward = HFModelRunner.forward

    def timed(self, store, batch):
        logits = forward(self, store, batch)
        time.sleep(step_seconds + row_seconds * (batch.height - 1))
        return logits

    monkeypatch.setattr(HFModelRunner, "forward", timed)
    prompt = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    expected = reference_greedy(llama_tiny, prompt, 48)
    config = dataclasses.replace(AUTO_CONFIG, window=0)  # the oracle's drafts alone decide the height
    out = generate(llama_tiny, prompt, max_new_tokens=48, config=config, proposers=[Oracle(expected[0].tolist())])
    assert out.sequences.tolist() == expected.tolist()
    if drafts_pay:
        assert out.stats.undrafted_steps <= 1 and out.stats.tokens_per_step > 2.5
    else:
        assert out.stats.undrafted_steps > out.stats.steps / 2
