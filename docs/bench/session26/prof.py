import sys, torch, time
torch.set_num_threads(2)
exec(open("docs/bench/session26/ragged.py").read().split("orig = att.RaggedLayout.of")[0])
from torch.profiler import profile
for name in ("1x8", "3+1x7"):
    sizes = cases[name]
    batch = pack_steps(range(B), [ctx]*B, [causal_step(torch.randint(40000, (k,), generator=g), logits=k) for k in sizes])
    for _ in range(3): r.forward(store, batch)
    with profile() as p:
        for _ in range(5): r.forward(store, batch)
    print(name)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
