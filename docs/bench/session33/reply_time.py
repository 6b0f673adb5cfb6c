import time, sys
from lookahead.models import load_model
from lookahead.serve import _Reply
m, tok = load_model()
text = open("README.md").read()
ids = tok(text)["input_ids"][:4000]
for steps in (1, 2):
    reply = _Reply(tok, ["</s>", "\n\nUser:"])
    t = time.perf_counter()
    out = "".join(reply.add(ids[i:i + steps], finished=i + steps >= len(ids)) for i in range(0, len(ids), steps))
    print(len(ids), "tokens,", steps, "a step:", round(time.perf_counter() - t, 3), "s", out == tok.decode(ids, skip_special_tokens=True))
