# The 4-bit kernel against a float64 reference (bfloat16 inputs; outputs rounded to bfloat16), each row alone, and its speed (hot caches).
import torch, timeit
from lookahead import kernels as K
torch.set_num_threads(2)
print("runs_q4", K.runs_q4())
def reference(x, codes, scale, minimum, bias):
    n, k = codes.shape; G = k // 32
    xg = x.to(torch.bfloat16).double().view(x.shape[0], G, 32)
    dot = torch.einsum("mgj,ngj->mng", xg, codes.view(n, G, 32).double())
    out = (dot * scale.double()[None]).sum(-1) + (minimum.double()[None] * xg.sum(-1)[:, None, :]).sum(-1)
    return out + (0 if bias is None else bias.double())
g = torch.Generator().manual_seed(0)
for n, k, m in [(64, 96, 1), (48, 64, 3), (1536, 576, 5), (576, 1536, 9), (32, 32, 17)]:
    codes = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.01).bfloat16().float(); minimum = (-torch.rand(n, k // 32, generator=g) * 0.05).bfloat16().float()
    bias = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    pc, ps = K.pack_q4(codes, scale, minimum + 8 * scale)
    minimum = (minimum + 8 * scale).bfloat16().float() - 8 * scale
    out = K.linear_q4(x, pc, ps, bias)
    ref = reference(x, codes, scale, minimum, bias)
    alone = torch.cat([K.linear_q4(x[i:i+1], pc, ps, bias) for i in range(m)])
    print(n, k, m, "max rel err", ((out.double() - ref).abs() / ref.abs().clamp(min=1e-3)).max().item(), "rows alone equal", torch.equal(alone, out))
codes = torch.randint(0, 16, (1536, 576), generator=g); scale = torch.rand(1536, 18); minimum = torch.rand(1536, 18)
codes2 = torch.randint(0, 16, (576, 1536), generator=g); pc2, ps2 = K.pack_q4(codes2, torch.rand(576, 48), torch.rand(576, 48))
for m in (1, 2, 4, 8, 16):
    x = torch.randn(m, 1536)
    print(m, "down 576x1536 ours", min(timeit.repeat(lambda: K.linear_q4(x, pc2, ps2, None), number=300, repeat=5))/300*1e6, "us")
