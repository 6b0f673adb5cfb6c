"""Our own linear kernels for CPU decoding steps, built at first use with the system's C and C++ compilers
against the installed torch (about 10 seconds, then cached), and registered as torch operators (`ops.cpp`):
`torch.ops.lookahead.linear_f32` and `linear_q4`, which eager steps call and compiled graphs call as ops of theirs.

- `linear_f32.c`, float32 weights. Why: oneDNN's packed linear, the fastest library path measured on our CPUs,
  spends ~10 us of each call outside the product (a one-row 8 x 576 linear: 11 us, against 1.5 us for the BLAS
  call), 120 calls a step on the default model, and reads the weights at ~41 GB/s across a layer's mixed shapes.
  This kernel, on 16-feature panels, read the 30 layers' weights of one-row steps in 0.81x oneDNN's time and was
  within 0.94-1.06x of it from 6 to 256 rows (2-core EPYC, session 27). Offered where the CPU has AVX-512 and the
  compilers (with OpenMP) build it; the cost curve (`costs.cost_curve`) then measures it beside the other
  linear paths and keeps the fastest.
- `linear_q4.c`, 4-bit weights in GGUF Q4_1's groups (`quant.Int4Linear`), on CPUs with AVX-512 BF16. Why:
  torch's int4 CPU kernel took 24 us for a one-row 576 x 1536 product (18 GB/s) and 2.2x that for 8 rows,
  4.6 ms of an 11.6 ms int4 step of the default model; this one 9.7 us and 2.7x that for 8 rows (hot caches),
  4.0 ms of the step (session 28).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from filelock import FileLock

from ..machine import cache_root, cpu_fields, notice

KERNEL_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
OPERATORS_SOURCE = Path(__file__).parent / "ops.cpp"
SOURCES = [*KERNEL_SOURCES, OPERATORS_SOURCE]
PANEL = 16  # output features per panel of a packed weight


@functools.cache
def library() -> Path | None:
    """The built kernels, loaded into torch; None where they cannot run here (no AVX-512, no compilers, no
    writable cache folder, or the build failed: then with a warning that shows the compiler's error)."""
    with _LOADING:  # threads meeting it first at once: one builds, loads and registers
        return _built_and_loaded()


_LOADING = threading.Lock()
BUILD_TIMEOUT = 300  # seconds a compiler step may take; a slower one counts as failed


def _built_and_loaded() -> Path | None:
    missing = [source.name for source in SOURCES if not source.is_file()]
    if missing or not KERNEL_SOURCES:  # an install that left them out: run, on torch's linears
        warnings.warn(f"lookahead's kernels not built: their sources are missing from {OPERATORS_SOURCE.parent} "
                      f"({', '.join(missing) or '*.c'}); steps run on torch's linears", RuntimeWarning, stacklevel=3)
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = cpu_fields().get("flags", "")
    if "avx512f" not in flags.split():
        return None
    compilers = [_compiler(name, default) for name, default in (("CC", "cc"), ("CXX", "c++"))]
    if None in compilers:
        return None
    # Built for this CPU (-march=native) and this torch: the CPU's flags, the compilers and the commands that
    # build with them, torch's version and the sources name the build.
    versions = [subprocess.run([*c, "--version"], capture_output=True, text=True).stdout for c in compilers]
    commands = _commands(*compilers, Path("WORK"), Path("OUT"))
    key = hashlib.blake2b("\n".join([*(source.read_text() for source in SOURCES), flags, *versions,
                                     *map(" ".join, commands), torch.__version__]).encode(), digest_size=12).hexdigest()
    built = cache_root() / "kernels" / f"kernels-{key}.so"
    try:
        built.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(built.with_name(f".{built.name}.lock")):
            if not built.is_file():
                notice(f"building our CPU kernels for this processor and torch (about 10 s), once; kept in {built.parent}")
                if not _build(*compilers, built):
                    return None
    except OSError as error:  # a cache folder we cannot write: run without our kernels
        warnings.warn(f"lookahead's kernels not built, {built.parent} is not writable ({error}); steps run on "
                      "torch's linears (set LOOKAHEAD_CACHE to a writable folder)", RuntimeWarning, stacklevel=3)
        return None
    if not hasattr(torch.ops.lookahead, "linear_f32"):  # a process loads the operators once
        try:
            torch.ops.load_library(str(built))
        except OSError:  # built, yet not loadable here (its OpenMP runtime missing, say)
            return None
        _register_fakes()
    return built


def _compiler(variable: str, default: str) -> list[str] | None:
    """The command $`variable` names (words: `ccache cc` too), its program found on the PATH; None where it is
    not (with a warning where the variable named it: the user asked for that compiler)."""
    words = shlex.split(os.environ.get(variable) or default)
    program = shutil.which(words[0]) if words else None
    if program is None:
        if os.environ.get(variable):
            warnings.warn(f"lookahead's kernels not built: {variable}={os.environ[variable]!r} names no program "
                          "found on the PATH; steps run on torch's linears", RuntimeWarning, stacklevel=4)
        return None
    return [program, *words[1:]]


def _commands(cc: list[str], cxx: list[str], work: Path, output: Path) -> list[list[str]]:
    """The compiler calls that build `output` in the folder `work`: each C kernel to an object, then the
    operators (`ops.cpp`) linked with them against torch's headers and libraries (found beside torch itself, as
    torch.utils.cpp_extension finds them)."""
    torch_dir = Path(torch.__file__).parent
    torch_lib = torch_dir / "lib"
    objects = [str(work / f"{source.stem}.o") for source in KERNEL_SOURCES]
    commands = [[*cc, "-O3", "-march=native", "-fopenmp", "-fPIC", "-c", str(source), "-o", obj]
                for source, obj in zip(KERNEL_SOURCES, objects)]
    commands.append([*cxx, "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
                     f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                     f"-I{torch_dir / 'include'}", str(OPERATORS_SOURCE),
                     *objects, f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu",
                     "-o", str(output)])
    return commands


def _build(cc: list[str], cxx: list[str], built: Path) -> bool:
    """Build `built` (`_commands`); False, with a warning that quotes the compiler, where a step fails. A
    process that dies mid-build leaves only its own `.partial` file, which no other process reads."""
    partial = built.with_name(f"{built.name}.{os.getpid()}.partial")
    with tempfile.TemporaryDirectory() as work:
        for command in _commands(cc, cxx, Path(work), partial):
            try:
                run = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
                failure = run.stderr.strip().splitlines()[-3:] if run.returncode else None
            except subprocess.TimeoutExpired:
                failure = [f"no result after {BUILD_TIMEOUT} s"]
            if failure is not None:
                partial.unlink(missing_ok=True)
                warnings.warn(f"lookahead's kernels did not build ({Path(command[0]).name} failed: "
                              f"{' / '.join(failure) or 'no message'}); steps run on torch's linears",
                              RuntimeWarning, stacklevel=4)
                return False
    os.replace(partial, built)
    return True


def _register_fakes() -> None:
    """The operators' output shapes, for compiled graphs to trace them."""
    @torch.library.register_fake("lookahead::linear_f32")
    def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, features: int) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], features)

    if hasattr(torch.ops.lookahead, "linear_q4"):
        @torch.library.register_fake("lookahead::linear_q4")
        def _(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return x.new_empty(*x.shape[:-1], codes.shape[0] * PANEL, dtype=torch.float32)


def runs_q4() -> bool:
    """Whether the 4-bit kernel runs here (built, on a CPU with AVX-512 BF16)."""
    return library() is not None and hasattr(torch.ops.lookahead, "linear_q4")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [n, k] laid out in panels of 16 features, [ceil(n / 16), k, 16], zero past feature n.
    Loads the kernels (`library`), which raises where they do not run here."""
    if library() is None:
        raise RuntimeError("lookahead's float32 kernel does not run here (see kernels.library)")
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, features: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for float32 `x` of any leading shape, `packed = pack(weight)`; a float32 bias."""
    return torch.ops.lookahead.linear_f32.default(x, packed, bias, features)


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
    """The 4-bit linear (`pack_q4`'s layout; a float32 bias or None) for `x` of any leading shape (taken as
    float32); a float32 output."""
    return torch.ops.lookahead.linear_q4.default(x, codes, scales, bias)
