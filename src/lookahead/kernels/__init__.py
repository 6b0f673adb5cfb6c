"""Our own linear kernels for CPU decoding steps, built at first use with the system's C compiler and loaded
through ctypes: no torch headers, so building them takes about a second.

- `linear_f32.c`, float32 weights. Why: oneDNN's packed linear, the fastest library path measured on our CPUs,
  spends ~10 us of each call outside the product (a one-row 8 x 576 linear: 11 us, against 1.5 us for the BLAS
  call), 120 calls a step on the default model, and reads the weights at ~41 GB/s across a layer's mixed shapes.
  This kernel, on 16-feature panels, read the 30 layers' weights of one-row steps in 0.81x oneDNN's time and was
  within 0.94-1.06x of it from 6 to 256 rows (2-core EPYC, session 27). Offered where the CPU has AVX-512 and a
  C compiler with OpenMP builds it; the cost curve (`costs.cost_curve`) then measures it beside the other
  linear paths and keeps the fastest.
- `linear_q4.c`, 4-bit weights in GGUF Q4_1's groups (`quant.Int4Linear`), on CPUs with AVX-512 BF16. Why:
  torch's int4 CPU kernel took 24 us for a one-row 576 x 1536 product (18 GB/s) and 2.2x that for 8 rows,
  4.6 ms of an 11.6 ms int4 step of the default model; this one 9.7 us and 2.7x that for 8 rows (hot caches),
  4.0 ms of the step (session 28).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch
from filelock import FileLock

from ..models import cache_root

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
PANEL = 16  # output features per panel of a packed weight


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, loaded; None where it cannot run here (no AVX-512, no compiler, or the build failed)."""
    cpu = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpu.is_file():
        return None
    flags = next((line for line in cpu.read_text().splitlines() if line.startswith("flags")), "")
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if "avx512f" not in flags.split() or compiler is None:
        return None
    # Built for this CPU (-march=native): its flags, the compiler and the sources name the build.
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.blake2b("\n".join([*(source.read_text() for source in SOURCES), flags, version]).encode(),
                          digest_size=12).hexdigest()
    built = cache_root() / "kernels" / f"linear-{key}.so"
    built.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(built.with_name(f".{built.name}.lock")):
        if not built.is_file():
            partial = built.with_name(f"{built.name}.{os.getpid()}.partial")
            result = subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                                     *map(str, SOURCES), "-o", str(partial)], capture_output=True, text=True)
            if result.returncode != 0:
                partial.unlink(missing_ok=True)
                return None
            os.replace(partial, built)
    try:
        lib = ctypes.CDLL(str(built))
    except OSError:  # built, yet not loadable here (its OpenMP runtime missing, say)
        return None
    lib.linear_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.linear_f32.restype = None
    if hasattr(lib, "linear_q4"):  # built only where the compiler targets AVX-512 BF16 (-march=native)
        lib.linear_q4.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
        lib.linear_q4.restype = None
    return lib


def runs_q4() -> bool:
    """Whether the 4-bit kernel runs here (built, on a CPU with AVX-512 BF16)."""
    lib = library()
    return lib is not None and hasattr(lib, "linear_q4")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [n, k] laid out in panels of 16 features, [ceil(n / 16), k, 16], zero past feature n."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, features: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for float32 `x` of any leading shape, `packed = pack(weight)`. Inside a
    compiled forward, an opaque op of the graph (`linear_op`), which inductor calls as it is."""
    if torch.compiler.is_compiling():
        return linear_op(x, packed, bias, features)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], features, dtype=torch.float32)
    library().linear_f32(rows.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
                         rows.shape[0], features, rows.shape[1], torch.get_num_threads())
    return out.view(*x.shape[:-1], features)


@torch.library.custom_op("lookahead::linear_f32", mutates_args=())
def linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, features: int) -> torch.Tensor:
    """`linear` as an op of torch's: compiled forwards call our kernel through it (eager ones call it directly,
    2 us a call less)."""
    return linear(x, packed, bias, features)


@linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], features)


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit kernel's layout (`linear_q4.c`) of a weight w = scale * (code - 8) + zero: codes [n, k] in 0..15,
    scale and zero bfloat16 [n, k / 32] per group of 32 inputs (n a multiple of 16, k of 32). Returns the codes,
    [n / 16, k / 4, 32] bytes, and the scales and zeros, bfloat16 [n / 16, k / 32, 2, 16]."""
    n, k = codes.shape
    # Element 2i + j of a pair of inputs: feature i's code for input j; byte t of a block of 4 inputs holds element t
    # of its first pair and element t of its second.
    elements = codes.to(torch.uint8).view(n // PANEL, PANEL, k // 4, 2, 2).permute(0, 2, 3, 1, 4)
    elements = elements.reshape(n // PANEL, k // 4, 2, 2 * PANEL)
    packed = (elements[:, :, 0] | (elements[:, :, 1] << 4)).contiguous()
    pairs = torch.stack([scale, zero], dim=-1).to(torch.bfloat16)  # [n, groups, 2]
    return packed, pairs.view(n // PANEL, PANEL, k // 32, 2).permute(0, 2, 3, 1).contiguous()


def linear_q4(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The 4-bit linear (`pack_q4`'s layout; a float32 bias or None) for float32 `x` of any leading shape. Inside a
    compiled forward, an opaque op of the graph (`linear_q4_op`)."""
    if torch.compiler.is_compiling():
        return linear_q4_op(x, codes, scales, bias)
    features, inputs = codes.shape[0] * PANEL, codes.shape[1] * 4
    rows = x.reshape(-1, inputs).float().contiguous()
    out = torch.empty(rows.shape[0], features)
    library().linear_q4(rows.data_ptr(), codes.data_ptr(), scales.data_ptr(), 0 if bias is None else bias.data_ptr(),
                        out.data_ptr(), rows.shape[0], features, inputs, torch.get_num_threads())
    return out.view(*x.shape[:-1], features)


@torch.library.custom_op("lookahead::linear_q4", mutates_args=())
def linear_q4_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
    """`linear_q4` as an op of torch's, for compiled forwards."""
    return linear_q4(x, codes, scales, bias)


@linear_q4_op.register_fake
def _(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], codes.shape[0] * PANEL, dtype=torch.float32)
