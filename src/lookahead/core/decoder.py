"""Per-sequence lookahead state: plans each step's input and turns the model's outputs into tokens.

Framework-free: the caller runs the model on `StepPlan.tokens` at `last_position + layout.offsets` with
`layout.allowed` as attention, and hands back the logits at `layout.logit_rows`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..config import LookaheadConfig
from ..arguments import integer
from .drafter import AcceptanceStats, RankedNodes, RowDemand, node_counts, rank_nodes, window_width
from .drafts import Draft, Proposer
from .layout import GuessTree, StepLayout, step_layout
from .pool import NGramPool, PoolProposer
from .recycle import RecycleProposer, SuccessorTable
from .suffix import Corpus, SuffixProposer
from .verify import ROOT, ChooseRule, Verdict, greedy_choice, top_tokens, verify_greedy, walk_tree
from .window import LookaheadWindow

# Scores a node's logits given the token ids before it ([1, L], [1, V] -> [1, V]), like a transformers
# LogitsProcessor; None leaves the logits as they are.
LogitsTransform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Relative cost of a step that feeds k tokens (k -> T(k) / T(1)).
StepCost = Callable[[int], float]
MAX_TREE_NODES = 64  # the most guess nodes a budgeted step feeds (the measured cost curve's range)


@dataclass(frozen=True)
class StepPlan:
    tokens: torch.Tensor  # [q] long, in layout row order
    layout: StepLayout
    tree: GuessTree
    drafts: list[Draft]  # every source's drafts this step, fed or not
    sources: tuple[str, ...]  # per tree node: the source it was fed for
    top: tuple[int, float] | None  # the likeliest draft node (a first token) and its estimated chance


@dataclass(frozen=True)
class Proposal:
    drafts: list[Draft]  # every source's drafts, in the order proposed
    nodes: RankedNodes  # their merged nodes, likeliest first


# A step without drafts: the last committed token alone (the window waits).
NO_PROPOSAL = Proposal([], RankedNodes([], [], []))


@dataclass(frozen=True)
class StepResult:
    tokens: list[int]  # committed this step, in order
    kept_rows: torch.Tensor  # rows of the step whose KV entries belong to the committed sequence
    # With `keep_scores`: per committed token, the float32 logits it was picked from and its scores (the
    # logits transformed as the decoding rule saw them), [len(tokens), vocab] each.
    logits: torch.Tensor | None = None
    scores: torch.Tensor | None = None


class LookaheadDecoder:
    """choose: how a node's next token is picked (None: argmax); transform: applied to each node's logits
    first, with the committed tokens before that node (None: none). corpus: earlier requests' text for the
    suffix source and their predictions for the recycle source. cost: the step cost curve that sizes the
    tree and the window when `config.budget` is set. proposers: more draft sources, after the pool, the
    suffix and the recycle sources. stats: acceptance statistics to learn from and add to (the engine's are
    shared by every request on its model); None: this sequence's own. context: the model's context in positions, past
    which no row of a step is placed (None: no limit). vocabulary: the model's token ids are below it; a draft of
    one of `proposers` outside it raises ValueError (None: unchecked). keep_scores: each step's result carries
    its committed tokens' logits and scores (the full float32 logits are then read, not their argmax alone)."""

    def __init__(
        self,
        config: LookaheadConfig,
        prompt: list[int],
        choose: ChooseRule | None = None,
        transform: LogitsTransform | None = None,
        corpus: Corpus | None = None,
        cost: StepCost | None = None,
        proposers: Sequence[Proposer] = (),
        stats: AcceptanceStats | None = None,
        context: int | None = None,
        vocabulary: int | None = None,
        keep_scores: bool = False,
    ) -> None:
        if config.budget and cost is None:
            raise ValueError("a budgeted config needs the step cost curve (cost=)")
        self.config = config
        self.context = context
        self.choose = choose
        self.transform = transform
        self.keep_scores = keep_scores
        self.cost = cost if config.budget else None
        self.pool = NGramPool(config.ngram, config.guesses)
        pool = PoolProposer(self.pool)
        suffix = [SuffixProposer(corpus)] if config.suffix else []
        self.recycle = (RecycleProposer(corpus.successors if corpus is not None else SuccessorTable(), config.recycle)
                        if config.recycle else None)
        recycle = [self.recycle] if self.recycle else []
        self.proposers: list[Proposer] = [pool, *suffix, *recycle, *proposers]
        self._own_sources = len(self.proposers) - len(proposers)
        self.vocabulary = vocabulary
        self._learn_from_prompt = [pool] * config.seed_from_prompt + self.proposers[1:]
        self._learn_from_output = [pool] * config.learn_from_output + self.proposers[1:]
        self.stats = stats if stats is not None else AcceptanceStats()
        self.accepted_by_source: Counter[str] = Counter()
        self.sequence = list(prompt)  # committed so far
        for proposer in self._learn_from_prompt:
            proposer.observe(self.sequence, len(self.sequence))
        width = window_width(self.cost, config.window, config.levels) if self.cost else config.window
        self.window = LookaheadWindow(random.Random(config.seed).choices(prompt, k=width), config.levels)

    @property
    def argmax_only(self) -> bool:
        """Whether this sequence reads its logits for their argmax alone (greedy, nothing transforms them); the
        recycle source's other top tokens are drafts, right or wrong."""
        return self.choose is None and self.transform is None and not self.keep_scores

    def propose(self) -> Proposal:
        """Every source's drafts for the next step, merged and ranked."""
        limit = max(self.config.ngram - 1, self.config.suffix)
        drafts = []
        for index, proposer in enumerate(self.proposers):
            proposed = proposer.propose(self.sequence, limit)
            if index >= self._own_sources:  # a caller's: its tokens reach the model
                proposed = _checked_drafts(proposed, getattr(proposer, "name", type(proposer).__name__),
                                           self.vocabulary)
            drafts += proposed
        return Proposal(drafts, rank_nodes(drafts, self.stats, MAX_TREE_NODES if self.cost else None))

    def base_rows(self, window: bool = True) -> int:
        """Rows of the next step before its guess tree: the last token, and the window if it is fed."""
        return 1 + (len(self.window.tokens) if window else 0)

    def demand(self, proposal: Proposal, window: bool = True, most: int | None = None) -> RowDemand:
        """The rows this sequence asks of the next step (`window`: feed the window; `most`: cap on rows)."""
        base = self.base_rows(window)
        scale = self.stats.calibration
        return RowDemand(base, [min(1.0, p * scale) for p in proposal.nodes.probabilities], self.cost is not None,
                         most if most is not None else base + len(proposal.nodes.prefixes))

    def window_fits(self) -> bool:
        """Whether every window row's position lies inside the model's context (positions past it have no
        embedding in a model with learned positions)."""
        reach = len(self.window.levels) + self.window.width - 1  # the last window row's offset
        return self.context is None or len(self.sequence) - 1 + reach < self.context

    def window_pays(self, cost: StepCost) -> bool:
        """Whether the window's rows are nearly free in a step of relative cost `cost` by height (always,
        unbudgeted)."""
        width = self.window.width
        return self.cost is None or window_width(cost, width, self.config.levels) == width

    def plan(self, proposal: Proposal | None = None, nodes: int | None = None, window: bool = True) -> StepPlan:
        """The next step's input: the last committed token, the window (unless `window` is False: it then
        waits, unchanged) and the tree of the `nodes` likeliest draft nodes. Without arguments: this
        sequence's own proposal, sized as a step of its own."""
        proposal = proposal or self.propose()
        window = window and self.window_fits()
        if nodes is None:
            nodes = node_counts([self.demand(proposal, window)], self.cost)[0]
        if self.context is not None:  # a node's depth is at most the count: the deepest stays inside the context
            nodes = min(nodes, self.context - len(self.sequence))
        merged = proposal.nodes.tree(nodes)
        window_tokens = self.window.tokens if window else []
        levels, width = (len(self.window.levels), self.window.width) if window_tokens else (0, 0)
        layout = step_layout(levels, width, merged.tree)
        tokens = torch.tensor([self.sequence[-1]] + window_tokens + merged.tree.tokens)
        top = (proposal.nodes.prefixes[0][0], proposal.nodes.probabilities[0]) if proposal.nodes.prefixes else None
        return StepPlan(tokens, layout, merged.tree, proposal.drafts, merged.sources, top)

    def update(self, plan: StepPlan, logits: torch.Tensor) -> StepResult:
        """Verify, commit and learn. logits: [len(plan.layout.logit_rows), vocab], the model's outputs at
        those rows in order."""
        top = top_tokens(logits, min(max(self.config.recycle, 1), logits.shape[-1]))
        if self.recycle is not None:
            self._recycle(plan, top)
        if self.argmax_only:
            return self._update_from_choices(plan, top[:, 0])
        width = plan.layout.window_rows.numel()
        verdict = walk_tree(plan.tree, lambda node, accepted: self._scores(
                                logits[0 if node == ROOT else 1 + width + node], accepted),
                            self.choose or greedy_choice, len(self.sequence))
        if not self.keep_scores:
            return self._commit(plan, verdict, top[1 : 1 + width, 0].tolist())  # greedy Jacobi
        # Each committed token came from the root's row, then from the row of the accepted node before it.
        rows = logits[[0] + [1 + width + node for node in verdict.nodes]].float()
        scores = torch.stack([self._scores(row, verdict.tokens[:i]) for i, row in enumerate(rows)])
        result = self._commit(plan, verdict, top[1 : 1 + width, 0].tolist())  # after scoring: it extends the sequence
        return StepResult(result.tokens, result.kept_rows, rows, scores)

    def choices(self, plan: StepPlan, logits: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
        """The token each of some logit rows leads to: `places` index `plan.layout.logit_rows`, `logits` holds
        those rows' outputs. At the root and at a tree node it is the token the decoding rule picks there
        (argmax, or the sample keyed by the position it would take); in the window, the argmax. Picks do
        not depend on which rows are verified, so rows may be picked apart (on different processes) and
        verified together (`update_from_choices`)."""
        picked = top_tokens(logits)[:, 0]
        if self.argmax_only:
            return picked
        width = plan.layout.window_rows.numel()
        for index, place in enumerate(places.tolist()):
            if 1 <= place <= width:
                continue
            node = ROOT if place == 0 else place - 1 - width
            accepted = _path_tokens(plan.tree.tokens, plan.tree.parents, node)
            scores = self._scores(logits[index], accepted)
            picked[index] = (self.choose or greedy_choice)(scores, [], len(self.sequence) + len(accepted))[0]
        return picked

    def update_from_choices(self, plan: StepPlan, picked: torch.Tensor) -> StepResult:
        """`update` from the token every logit row leads to ([len(plan.layout.logit_rows)], as `choices`
        gives): the accepted path follows the picked tokens down the tree. The recycle source learns the
        picked tokens as each row's one prediction."""
        if self.recycle is not None:
            self._recycle(plan, picked.view(-1, 1))
        return self._update_from_choices(plan, picked)

    def _recycle(self, plan: StepPlan, predicted: torch.Tensor) -> None:
        """The recycle source learns each logit row's predicted tokens ([rows, k], best first) after its input."""
        self.recycle.learn(plan.tokens[plan.layout.logit_rows].tolist(), predicted.tolist())

    def _update_from_choices(self, plan: StepPlan, picked: torch.Tensor) -> StepResult:
        width = plan.layout.window_rows.numel()
        verdict = verify_greedy(plan.tree, int(picked[0]), picked[1 + width :])
        return self._commit(plan, verdict, picked[1 : 1 + width].tolist())

    def _commit(self, plan: StepPlan, verdict: Verdict, window_outputs: list[int]) -> StepResult:
        if window_outputs:
            for ngram in self.window.advance(window_outputs):
                self.pool.add(ngram)
        self.stats.record(plan.drafts, verdict.tokens)
        if plan.top is not None:
            self.stats.record_top(plan.top[1], plan.top[0] == verdict.tokens[0])
        self.accepted_by_source.update(plan.sources[node] for node in verdict.nodes)
        self.sequence.extend(verdict.tokens)
        for proposer in self._learn_from_output:
            proposer.observe(self.sequence, len(verdict.tokens))
        kept = torch.tensor([0] + [plan.layout.tree_start + node for node in verdict.nodes], dtype=torch.long)
        return StepResult(verdict.tokens, kept)

    def _scores(self, row: torch.Tensor, accepted: list[int]) -> torch.Tensor:
        """A node's scores: its logits `row` in float32 (as transformers' `generate` hands them to its processors:
        a bfloat16 row would round what they compute), transformed given the committed tokens and `accepted`
        below it. A transform gets a copy: processors may write the scores they are handed, as they may in
        `generate`."""
        if self.transform is None:
            return row.float()
        row = row.to(torch.float32, copy=True)
        context = torch.tensor(self.sequence + accepted, device=row.device).view(1, -1)
        return self.transform(context, row.view(1, -1))[0]


def _path_tokens(tokens: list[int], parents: tuple[int, ...], node: int) -> list[int]:
    """The tokens from the root's first child down to `node` (none for the root)."""
    path = []
    while node != ROOT:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def _checked_drafts(proposed: object, source: str, vocabulary: int | None) -> list[Draft]:
    """A caller's drafts with their tokens as ints (a bool, True == 1, or a float would reach the model as
    another token than the one verified against it), counted under the source's name (under another, their
    acceptance would be learnt as another source's). Raises for anything else, naming the source."""
    if not isinstance(proposed, (list, tuple)) or not all(isinstance(d, Draft) for d in proposed):
        raise TypeError(f"draft source {source!r}: propose() must return a list of lookahead Drafts, got "
                        f"{proposed!r:.200}")
    return [_checked_draft(draft, source, vocabulary) for draft in proposed]


def _checked_draft(draft: Draft, source: str, vocabulary: int | None) -> Draft:
    tokens = draft.tokens.tolist() if hasattr(draft.tokens, "tolist") else draft.tokens  # an array's too
    if not isinstance(tokens, (list, tuple)):
        raise TypeError(f"draft source {source!r} proposed tokens={draft.tokens!r:.200}, not a sequence of token ids")
    context = integer(draft.context)
    if context is None or context < 0:
        raise ValueError(f"draft source {source!r} proposed a draft of context={draft.context!r}: the number of "
                         "the text's last tokens it matched must be an integer >= 0")
    ids = []
    for token in tokens:
        if (number := integer(token)) is None:
            raise ValueError(f"draft source {source!r} proposed {token!r} ({type(token).__name__}), not a token id "
                             "(an int)")
        if vocabulary is not None and not 0 <= number < vocabulary:
            raise ValueError(f"draft source {source!r} proposed token id {number}, outside the model's vocabulary "
                             f"[0, {vocabulary})")
        ids.append(number)
    return Draft(tuple(ids), source, context)
