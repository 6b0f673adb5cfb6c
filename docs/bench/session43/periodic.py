"""The suffix source's own drafts continued past the text's end where the text loops (periodic, session 43; not
kept) against stopping there (before): the automatic config, one engine per method, acceptance statistics fresh for each run,
rounds with the order rotated. Usage: PYTHONPATH=src python periodic.py DATASET PROMPTS ROUNDS DTYPE (DATASET: mt_bench, humaneval, ...)"""
import sys
import time

import torch

import lookahead.core.suffix as S
import lookahead.engine as E
from lookahead.cli import _workload
from lookahead.config import AUTO_CONFIG
from lookahead.engine import Engine, RequestParams
from lookahead.models import load_model
from lookahead.prompts import encode_prompt

torch.set_num_threads(2)
dataset, count, rounds, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model, tokenizer = load_model(dtype=dtype)
prompts = [encode_prompt(tokenizer, p.turns[0])[0] for p in _workload(dataset, 1, False, None, count)]
engines: dict[str, Engine] = {}
before = S.SuffixProposer.propose


def periodic_continuation(tokens, end, limit, length):
    """The variant measured (not kept): where the match covers a whole period (the text's end repeats itself), its
    continuation goes on past the text's end as the loop does, to `limit` tokens rather than one period."""
    period = len(tokens) - 1 - end
    if not 0 < period <= length:
        return S.continuation(tokens, end, limit)
    return tuple(tokens[end + 1 + k % period] for k in range(limit))


def periodic(self, text, limit):
    """`SuffixProposer.propose` with the text's own matches continued by `periodic_continuation`."""
    if self.corpus is not None:
        self._rematched(text)
    drafts, seen = [], set()
    found = [(self.own.tokens, length, end, "suffix") for length, end in self.own.earlier_matches(self.branches)]
    if self._cursor is not None:
        found += [(self._cursor.automaton.tokens, length, end, "corpus") for length, end in self._cursor.matches(self.branches)]
    for tokens, length, end, source in sorted(found, key=lambda f: -f[1]):
        draft = S.continuation(tokens, end, limit) if source == "corpus" else periodic_continuation(tokens, end, limit, length)
        if draft and draft not in seen:
            seen.add(draft)
            drafts.append(S.Draft(draft, source, length))
    return drafts


def run(method: str) -> tuple[int, float, int, int, list[list[int]]]:
    S.SuffixProposer.propose = periodic if method == "periodic" else before
    E._ACCEPTANCE.clear()
    engine = engines.setdefault(method, Engine(model, max_batch=1, max_length=max(p.numel() for p in prompts) + 300))
    params = RequestParams(max_new_tokens=256, config=AUTO_CONFIG, eos_token_id=model.generation_config.eos_token_id)
    tokens, steps, fed, start, outputs = 0, engine.stats.steps, engine.stats.tokens_fed, time.perf_counter(), []
    for prompt in prompts:
        engine.add_request(prompt, params)
        out = []
        while engine.has_unfinished():
            for o in engine.step():
                out += o.tokens
        outputs.append(out)
        tokens += len(out)
    return tokens, time.perf_counter() - start, engine.stats.steps - steps, engine.stats.tokens_fed - fed, outputs


methods = ["before", "periodic"]
totals = {m: [0, 0.0, 0, 0] for m in methods}
texts: dict[str, list] = {}
for r in range(rounds):
    for method in methods[r % 2:] + methods[: r % 2]:
        n, seconds, steps, fed, outputs = run(method)
        texts.setdefault(method, outputs)
        for i, v in enumerate((n, seconds, steps, fed)):
            totals[method][i] += v
        print(f"round {r} {method}: {n / seconds:.1f} tokens/s {n / steps:.2f} tokens/step, {fed / steps:.1f} fed a step",
              flush=True)
base = totals["before"][0] / totals["before"][1]
for method in methods:
    n, seconds, steps, fed = totals[method]
    print(f"TOTAL {method}: {n / seconds:.1f} tokens/s ({n / seconds / base:.3f}x before) {n / steps:.2f} tokens/step, "
          f"{fed / steps:.1f} fed a step")
print("outputs identical:", texts["before"] == texts["periodic"])
