"""Memory sizes as people write them (`80GiB`, `80G`, `80GB`, `512MiB`) and back.

Device memory is sized in binary units (an "80 GB" H100/A100 reports 81920 MiB or a little
less; HBM comes in powers of two), so every prefix is binary whether written `G`, `GB` or `GiB`:
`80G` = `80GB` = `80GiB` = 80 * 2**30 bytes; `B` alone is bytes (`85899345920B`). A string needs
its unit: a bare `80` is refused rather than read as 80 bytes, which is never what was meant (an
API caller passes a byte count as an int). Anything else is a `MemorySizeError` (one line, the
CLI's exit 2).
"""

from __future__ import annotations

import math
import re

from ernie_ir.ir import ErnieIRError

_PREFIX = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*"
                   r"(?:([KMGTP])(?:I?B)?|(B))?\s*", re.IGNORECASE | re.ASCII)  # ASCII: no KELVIN SIGN for K


class MemorySizeError(ErnieIRError):
    """A memory size that cannot be read (e.g. `80XB`)."""


def parse_memory(text: str, *, option: str = "--device-memory") -> int:
    """Bytes of a memory size: `80GiB`, `80G`, `80GB`, `80 gib`, `1.5T`, `512MiB`, `81920M` or
    bytes (`85899345920B`, `8e10B`). Every prefix is binary (G = 2**30); a number without a unit
    is refused (see the module doc)."""
    m = _SIZE.fullmatch(str(text))
    if m is None:
        raise MemorySizeError(f"{option} {text!r}: not a memory size; write a number with K, M, G or T "
                              "(optionally followed by B or iB; all binary: 80G = 80GB = 80GiB = 80 * 2^30 "
                              "bytes), e.g. 80GiB, or bytes with B")
    if m.group(3) is None and m.group(4) is None:
        number = str(text).strip()
        # a long number is cut, not echoed in thousands of digits
        shown, example = (number, number) if len(number) <= 16 else (f"{number[:12]}...", "80")
        raise MemorySizeError("a memory size needs a unit", flag=option, value=shown,
                              fix=f"give one, e.g. {example}GiB (or {example}B for bytes)")
    prefix = (m.group(3) or "").upper()
    try:
        number = float(m.group(1)) * (10.0 ** int(m.group(2)) if m.group(2) else 1)
        value = number * 1024 ** _PREFIX[prefix]
    except (OverflowError, ValueError):  # 1e400: no float holds it
        value = math.inf
    if value > 1 << 70:
        raise MemorySizeError(f"{option} {text!r}: more than a zebibyte is no memory size: check the number")
    if not math.isfinite(value) or value < 1:
        raise MemorySizeError(f"{option} {text!r}: a memory size must be at least one byte")
    return int(value)


def format_bytes(n: int | float) -> str:
    """`85899345920` -> `80.00 GiB` (binary units, as parse_memory reads them)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
