# A plain int4 step of the default model with our 4-bit layers run as they are and stacked (packer q4), interleaved.
import torch, time, sys
sys.path.insert(0, "/work/main/tests")
from conftest import reference_greedy
from lookahead import generate
from lookahead.config import PLAIN_CONFIG
from lookahead.models import load_model
from lookahead.prompts import encode_prompt
torch.set_num_threads(2)
model, tok = load_model(dtype="int4")
ids = encode_prompt(tok, "Write a short story about a robot who learns to paint.")
ref = generate(model, ids, max_new_tokens=128, config=PLAIN_CONFIG, packed_linear=False).sequences
for r in range(3):
    for packed in (False, True):
        s = time.perf_counter(); o = generate(model, ids, max_new_tokens=128, config=PLAIN_CONFIG, packed_linear=packed); t = time.perf_counter() - s
        print("q4 stacked" if packed else "unstacked ", f"{t*1e3/o.stats.steps:.2f} ms/step", torch.equal(o.sequences, ref))
