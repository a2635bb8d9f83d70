"""'Did you mean': the known names nearest a mistyped one, for one-line refusals.

Every place that resolves a name the user typed (a quantization preset, a built-in model, a
target, an op, a pass, a rewrite rule) appends `did_you_mean(name, known)` to its refusal, so a
typo reads the same everywhere: `unknown target 'cdua' (did you mean cuda?): choose one of ...`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

CUTOFF = 0.6
"""difflib's similarity ratio a known name must reach to be offered (its own default)."""


def close_names(name: str, known: Iterable[str], n: int = 1) -> list[str]:
    """Up to `n` names of `known` nearest `name`, best first (one by default: the likeliest
    reading of a typo, not a list to choose from); case is ignored, the names are returned as
    `known` spells them."""
    by_lower: dict[str, str] = {}
    for k in known:
        by_lower.setdefault(k.lower(), k)
    return [by_lower[c] for c in difflib.get_close_matches(name.strip().lower(), list(by_lower), n=n,
                                                          cutoff=CUTOFF)]


def did_you_mean(name: str, known: Iterable[str], n: int = 1) -> str:
    """` (did you mean wint8mix?)` for the names of `known` nearest `name`; "" when none is near
    (or `name` is itself known)."""
    known = list(known)
    if name in known:
        return ""
    close = close_names(name, known, n)
    return f" (did you mean {', '.join(close)}?)" if close else ""
