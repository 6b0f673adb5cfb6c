import time, torch
torch.set_num_threads(2)
from lookahead.attention import RaggedLayout, _ragged_attention, _masks, _MASKS, _stacked_attention
dt = torch.bfloat16
sizes = [1, 3, 2, 5, 1, 4, 2, 3]
cached = [300, 340, 280, 390, 310, 350, 320, 305]
B, H, KV, D = 8, 9, 3, 64
h = max(sizes); L = max(c + s for c, s in zip(cached, sizes))
N = sum(sizes)
layout = RaggedLayout.of(sizes, cached, torch.device("cpu"))
print("parts", len(layout.parts), [p.rows.shape for p in layout.parts])
q = torch.randn(1, H, N, D, dtype=dt)
k = torch.randn(B, KV, L, D, dtype=dt); v = torch.randn(B, KV, L, D, dtype=dt)
mask = torch.zeros(B, 1, h, L, dtype=torch.bool)
for b in range(B):
    mask[b, 0, :, : cached[b]] = True
    for r in range(h):
        mask[b, 0, r, cached[b]: cached[b] + r + 1] = True
class M: pass
mod = M()
def run():
    return _ragged_attention(mod, q, k, v, mask, layout, 0.0, None)
for _ in range(20): run()
n = 300
t = time.perf_counter()
for _ in range(n): run()
tr = (time.perf_counter() - t) / n
# the plain step: 8 one-row sequences, stacked path
q1 = torch.randn(B, H, 1, D, dtype=dt); m1 = mask[:, :, :1]
reps = _masks(m1, 3)[0]
for _ in range(20): _stacked_attention(q1, k, v, reps, 0.0, None)
t = time.perf_counter()
for _ in range(n): _stacked_attention(q1, k, v, reps, 0.0, None)
t1 = (time.perf_counter() - t) / n
# padded: all sequences padded to h rows in one stacked call
qp = torch.randn(B, H, h, D, dtype=dt); rp = _masks(mask, 3)[0]
for _ in range(20): _stacked_attention(qp, k, v, rp, 0.0, None)
t = time.perf_counter()
for _ in range(n): _stacked_attention(qp, k, v, rp, 0.0, None)
tp = (time.perf_counter() - t) / n
print(f"ragged {tr*1e6:.0f} us  plain 1-row {t1*1e6:.0f} us  padded-to-{h} {tp*1e6:.0f} us  (x30 layers: {tr*30e3:.1f} / {t1*30e3:.1f} / {tp*30e3:.1f} ms)")
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for _ in range(100): run()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(8)
import torch.nn.functional as F
stacked = qp.reshape(B, KV, -1, D)
def tm(f, n=300):
    for _ in range(20): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e6
add = torch.zeros(rp.shape, dtype=dt).masked_fill(~rp, float("-inf"))
addf = torch.zeros(rp.shape, dtype=torch.float32).masked_fill(~rp, float("-inf"))
print("bool mask", tm(lambda: F.scaled_dot_product_attention(stacked, k, v, attn_mask=rp)))
print("bf16 additive", tm(lambda: F.scaled_dot_product_attention(stacked, k, v, attn_mask=add)))
print("f32 additive", tm(lambda: F.scaled_dot_product_attention(stacked, k, v, attn_mask=addf)))
print("no mask", tm(lambda: F.scaled_dot_product_attention(stacked, k, v)))
from torch.nn.attention import sdpa_kernel, SDPBackend
with sdpa_kernel(SDPBackend.MATH):
    print("math bool", tm(lambda: F.scaled_dot_product_attention(stacked, k, v, attn_mask=rp)))
# manual: scores = q k^T, masked softmax, @ v
def manual():
    s = torch.matmul(stacked, k.transpose(-1, -2)) * 0.125
    s = s + add
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(dt)
    return torch.matmul(p, v)
print("manual", tm(manual))
s1 = q1.reshape(B, KV, -1, D); r1 = reps
print("1-row bool", tm(lambda: F.scaled_dot_product_attention(s1, k, v, attn_mask=r1)))
print("1-row nomask", tm(lambda: F.scaled_dot_product_attention(s1, k, v)))
