"""Plain compiled decoding, 256 new tokens, three calls (the first compiles): ms a step and in the forward for the
last two. DTYPE: float32 (default) or int4 (sessions 29, 30)."""
import os

import torch

from lookahead import generate
from lookahead.config import PLAIN_CONFIG
from lookahead.models import load_model

torch.set_num_threads(2)
model, tokenizer = load_model(dtype=os.environ.get("DTYPE", "float32"))
ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short story about a robot learning to paint."}],
                                    add_generation_prompt=True, return_tensors="pt")
ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
for call in range(3):
    stats = generate(model, ids, max_new_tokens=256, config=PLAIN_CONFIG, compile=True).stats
    if call:
        print(f"ms/step {stats.seconds / stats.steps * 1e3:.2f} forward ms/step {stats.forward_seconds / stats.steps * 1e3:.2f}")
