"""Argument checks shared by the policy, the scorers and the entry points: one ``ValueError``
naming the field, at construction, instead of a ``TypeError`` or a NaN deep inside the compute.

``bool`` is refused where a number is expected (``True`` is an ``int`` in Python), a float is
refused where an integer is expected (``2.5`` tokens, also ``2.0``: a float there is a typo or
a computation that should round explicitly), and NaN and the infinities are refused everywhere.
"""

from __future__ import annotations

import math
import numbers


def _describe_range(minimum, maximum, above, below) -> str:
    parts = []
    if minimum is not None:
        parts.append(f">= {minimum}")
    if above is not None:
        parts.append(f"> {above}")
    if maximum is not None:
        parts.append(f"<= {maximum}")
    if below is not None:
        parts.append(f"< {below}")
    return " and ".join(parts)


def is_number(value) -> bool:
    """Whether ``value`` is a real number: a Python or numpy integer or float (``np.int64(0)``,
    ``np.float32(0.5)``), not a bool (nor numpy's ``bool_``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def check_integer(name: str, value, *, minimum: int | None = None, odd: bool = False) -> int:
    """``value`` as an ``int`` when it is an integer (not a bool or a float) ``>= minimum`` (odd if asked)."""
    what = "an integer" if minimum is None else ("a positive integer" if minimum == 1 else f"an integer >= {minimum}")
    if odd:
        what = what.replace("integer", "odd integer")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    if (minimum is not None and value < minimum) or (odd and value % 2 == 0):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


def check_number(
    name: str,
    value,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
) -> float:
    """``value`` as a ``float`` when it is a finite real number (not a bool) in the given range."""
    bounds = _describe_range(minimum, maximum, above, below)
    what = "a finite number" + (f" {bounds}" if bounds else "")
    if not is_number(value):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    number = float(value)
    if (
        not math.isfinite(number)
        or (minimum is not None and number < minimum)
        or (maximum is not None and number > maximum)
        or (above is not None and number <= above)
        or (below is not None and number >= below)
    ):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return number


def check_flag(name: str, value) -> bool:
    """``value`` when it is a ``bool`` (``"no"`` or ``0`` would silently mean something else)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value
