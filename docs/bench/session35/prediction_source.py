import time, torch
from lookahead.models import load_model
from lookahead import generate
from lookahead.core.suffix import SuffixAutomaton, MatchCursor, continuation
from lookahead.core.drafts import Draft
from lookahead.prompts import encode_messages

class Prediction:
    name = "prediction"
    def __init__(self, tokens):
        self.automaton = SuffixAutomaton(tokens)
        self.cursor = MatchCursor(self.automaton)
        self.start = None
    def observe(self, text, new):
        if self.start is None:
            self.start = len(text); return
        self.cursor.feed(text[len(text)-new:])
    def propose(self, text, limit):
        if len(text) == self.start:
            return [Draft(tuple(self.automaton.tokens[:limit]), self.name, 1)]
        return [Draft(d, self.name, length) for length, end in self.cursor.matches(1)
                if (d := continuation(self.automaton.tokens, end, limit))]

m, t = load_model()
code = open("/work/main/src/lookahead/core/pool.py").read()[:1500]
question = "Rename the variable `ngram` to `size` everywhere in this code and give the whole code back:\n\n" + code
ids = encode_messages(t, [{"role": "user", "content": question}])
plain = generate(m, ids, max_new_tokens=200, eos_token_id=None)
out_text = t.decode(plain.sequences[0, ids.shape[1]:])
print(out_text[:600])
pred = t(code, add_special_tokens=False)["input_ids"]
for rounds in range(2):
    for name, props in (("auto", []), ("prediction", [Prediction(pred)])):
        s = time.perf_counter()
        o = generate(m, ids, max_new_tokens=200, proposers=props)
        dt = time.perf_counter() - s
        assert torch.equal(o.sequences, plain.sequences)
        print(name, f"{dt:.2f}s", "tok/step", round(o.stats.tokens_per_step, 2), o.stats.accepted_by_source)
