"""Two requests over the same document: what a corpus shared between them gives the second one."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..core.suffix import Corpus
from ..generation import GenerationStats, generate
from ..prompts import encode_prompt
from ..workloads import CORPUS_PAIRS


@dataclass(frozen=True)
class CorpusRun:
    document: str
    first: GenerationStats  # the first request (an empty corpus)
    second_alone: GenerationStats  # the second request without a corpus
    second_shared: GenerationStats  # the second request with the first one's prompt and output in the corpus
    identical: bool  # the second request's output is the same either way (greedy)


def corpus_runs(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, documents: dict[str, str], max_new_tokens: int,
    pair: str = "summaries",
) -> list[CorpusRun]:
    if pair not in CORPUS_PAIRS:
        raise ValueError(f"pair must be one of {', '.join(CORPUS_PAIRS)}, got {pair!r}")
    runs = []
    for name, text in documents.items():
        first_ids, second_ids = (encode_prompt(tokenizer, f"{instruction}\n\n{text}") for instruction in CORPUS_PAIRS[pair])
        corpus = Corpus()
        greedy = {"max_new_tokens": max_new_tokens, "do_sample": False}
        first = generate(model, first_ids, corpus=corpus, **greedy)
        shared = generate(model, second_ids, corpus=corpus, **greedy)
        alone = generate(model, second_ids, **greedy)
        runs.append(CorpusRun(name, first.stats, alone.stats, shared.stats, torch.equal(alone.sequences, shared.sequences)))
    return runs


def corpus_table(runs: list[CorpusRun]) -> str:
    lines = [
        "| document | first: tokens/step | second alone | second, shared corpus | shared / first | shared / alone | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.document} | {r.first.tokens_per_step:.2f} | {r.second_alone.tokens_per_step:.2f} | "
            f"{r.second_shared.tokens_per_step:.2f} | {r.second_shared.tokens_per_step / r.first.tokens_per_step:.2f}x | "
            f"{r.second_shared.tokens_per_step / r.second_alone.tokens_per_step:.2f}x | {r.identical} |"
        )

    def pooled(attribute: str) -> float:
        stats = [getattr(r, attribute) for r in runs]
        return sum(s.new_tokens for s in stats) / sum(s.steps for s in stats)

    first, alone, shared = pooled("first"), pooled("second_alone"), pooled("second_shared")
    lines.append(f"| all | {first:.2f} | {alone:.2f} | {shared:.2f} | {shared / first:.2f}x | {shared / alone:.2f}x | "
                 f"{all(r.identical for r in runs)} |")
    return "\n".join(lines)
