"""Numbers as the CLI prints them for people: counts with thousands separators, measures in fixed
point with separators, and scientific notation once a value is too large (or too small) for its
digits to mean anything in fixed point (a perplexity of 7.2531e+20, not 725306064334739734528.0000).

`--json` output keeps the raw numbers; only what is printed for reading goes through here.
"""

from __future__ import annotations

import math

HUGE = 1e6
"""From here on up a measure prints in scientific notation: digits past the sixth mean nothing."""
TINY = 1e-4
"""Below this a nonzero `sig` value prints in scientific notation (fixed point would show 0.0000)."""


def count(n: int) -> str:
    """A count: 1,234,567."""
    return f"{int(n):,}"


def fixed(x: float, decimals: int = 4) -> str:
    """A measure with `decimals` places and separators (12,345.6789), or `decimals` places of
    scientific notation from HUGE on (7.2531e+20); nan and inf as Python writes them."""
    if not math.isfinite(x):
        return str(x)
    if abs(x) >= HUGE:
        return f"{x:.{decimals}e}"
    return f"{x:,.{decimals}f}"


def sig(x: float, digits: int = 4) -> str:
    """A measure to `digits` significant digits: fixed point with separators between TINY and
    HUGE (0.01234, 12,345), scientific notation outside (1.235e-07, 7.253e+20); 0 as 0."""
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    rounded = float(f"{x:.{digits - 1}e}")  # 9.9996 -> 10.00: the digits after rounding count
    if TINY <= abs(rounded) < HUGE:
        decimals = max(digits - 1 - math.floor(math.log10(abs(rounded))), 0)
        return f"{rounded:,.{decimals}f}"
    return f"{x:.{digits - 1}e}"
