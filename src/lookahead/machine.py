"""This machine: where measurements, builds and model copies are cached, which CPU it is, and the one-line
notices of one-off waits."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path


def cache_root() -> Path:
    """Where dequantised models, cost curves, our kernels (and the tests' reference outputs) are cached, as an
    absolute path: $LOOKAHEAD_CACHE, or ~/.cache/lookahead where it is unset or empty (not the working folder)."""
    return Path(os.environ.get("LOOKAHEAD_CACHE") or Path.home() / ".cache" / "lookahead").expanduser().resolve()


@functools.cache
def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "flags", ...; empty where there is no such
    file): what names the CPU that our kernels are built for and cost curves are timed on."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return {}
    return {name.strip(): value.strip() for name, _, value in (line.partition(":") for line in first.splitlines())}


def notice(message: str) -> None:
    """One line on stderr before a one-off wait (timing the model's steps, building our kernels): without it a
    first call sits silent for seconds to minutes, and looks frozen."""
    print(f"lookahead: {message}", file=sys.stderr, flush=True)
