"""The `--summary` view of a graph: node counts by op, params and bytes by dtype."""

from __future__ import annotations

from collections import Counter

from rich.table import Table

from ernie_ir.ir import Graph

from .numbers import count
from .tables import KeyTable


def summary_tables(graph: Graph) -> list[Table]:
    ops = Counter(n.op for n in graph)
    t1 = KeyTable("op", "count", numbers=("count",), title=f"{graph.name}: {count(len(graph))} nodes")
    for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])):
        t1.add_row(op, count(n))
    by_dtype: dict[str, list[int]] = {}
    symbolic = 0
    for p in graph.params.values():
        row = by_dtype.setdefault(str(p.type.dtype), [0, 0, 0])
        row[0] += 1
        if p.type.is_static:
            row[1] += int(p.type.numel())  # type: ignore[arg-type]
            row[2] += p.type.nbytes()
        else:
            symbolic += 1
    t2 = KeyTable("dtype", "params", "elements", "bytes", numbers=("params", "elements", "bytes"),
                  title=f"{count(len(graph.params))} params")
    total = [0, 0, 0]
    for dtype, (n, el, nb) in sorted(by_dtype.items()):
        t2.add_row(dtype, count(n), count(el), _human(nb))
        total = [total[0] + n, total[1] + el, total[2] + nb]
    t2.add_row("total", count(total[0]), count(total[1]), _human(total[2]), style="bold")
    return [t1, t2]


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)
