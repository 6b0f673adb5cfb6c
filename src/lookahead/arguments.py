"""Checks of the arguments callers pass, shared by every layer. An integer may come as a Python int, a numpy
integer or a one-element integer tensor, each taken as the Python int it holds; never a bool (True == 1 is no
count), nor a float (3.0). A number is any real but a bool."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable


def integer(value: object) -> int | None:
    """`value` as a Python int where it is an integer, else None (whatever it raises when asked: a tensor on the
    meta device, an `__index__` of its own that fails)."""
    try:
        if isinstance(value, bool) or str(getattr(value, "dtype", "")).endswith("bool"):
            return None
        return operator.index(value)
    except Exception:  # noqa: BLE001 - not an integer we can take, whatever the reason
        return None


def checked_int(name: str, value: object, minimum: int, maximum: int | None = None, allowed: str | None = None) -> int:
    """`value` as a Python int; ValueError naming `name` unless it is an integer in [minimum, maximum] (`allowed`:
    what the message says is allowed; by default the range)."""
    number = integer(value)
    if number is None or number < minimum or (maximum is not None and number > maximum):
        if allowed is None:
            allowed = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return number


def checked_number(name: str, value: object, valid: Callable[[float], bool], allowed: str) -> None:
    """ValueError naming `name` unless `value` is a real number (not a bool) for which `valid` holds (`allowed`:
    what the message says is allowed)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not valid(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
