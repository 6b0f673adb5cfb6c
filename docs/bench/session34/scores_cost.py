"""What asking for the scores costs: `generate` on the default model with and without output_logits, in turn."""

import time

from lookahead import generate, load_model
from lookahead.prompts import encode_prompt
from lookahead.workloads import load_workload

model, tokenizer = load_model()
prompts = [encode_prompt(tokenizer, p.turns[0]) for p in load_workload("mt_bench")[::20]]  # 4 prompts
generate(model, prompts[0], max_new_tokens=16)  # warm-up
totals = {False: [0.0, 0], True: [0.0, 0]}
for round_ in range(2):
    for asked in (False, True) if round_ % 2 == 0 else (True, False):
        for ids in prompts:
            start = time.perf_counter()
            out = generate(model, ids, max_new_tokens=128, output_logits=asked)
            totals[asked][0] += time.perf_counter() - start
            totals[asked][1] += out.stats.new_tokens
for asked, (seconds, tokens) in totals.items():
    print(f"output_logits={asked}: {tokens / seconds:.1f} tokens/s")
print(f"ratio: {totals[True][1] / totals[True][0] / (totals[False][1] / totals[False][0]):.3f}")
