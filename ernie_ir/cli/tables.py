"""Tables that never cut what identifies a row: the CLI's rich tables with a key column.

A `KeyTable`'s first column (the key: a unit, an op, a dtype) and its number columns are never
wrapped or cut (`ops` at 80 columns, or written to a file, printed "fake_quant…" for an op name);
its other text columns wrap, folding a word longer than the column. The table takes the console's
width (a terminal's, or 80 columns written to a file or a pipe), and more where the key, the
numbers and a few characters of each text column need it.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table

WIDE = 1 << 16
"""The width a table is measured at for its natural (unwrapped) width."""
TEXT_FLOOR = 10
"""The narrowest a text column is made on a narrow terminal (or its header's width)."""


class KeyTable(Table):
    """A rich Table of `key`, then `columns`; those named in `numbers` are right-justified."""

    def __init__(self, key: str, *columns: str, numbers: tuple[str, ...] = (), **options: Any) -> None:
        super().__init__(**options)
        self.add_column(key, no_wrap=True)
        for name in columns:
            if name in numbers:
                self.add_column(name, justify="right", no_wrap=True)
            else:
                self.add_column(name, overflow="fold")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        self.width = None
        wide = options.update_width(WIDE)
        need = self._extra_width + len(self.columns) * (self.padding[1] + self.padding[3])  # borders, padding
        for column in self.columns:
            cells = (column.header, *column.cells)
            widest = max(Measurement.get(console, wide, cell).maximum for cell in cells)
            if column.no_wrap:  # as wide as its widest cell: rich would cut it to fit otherwise
                column.min_width = widest
                need += widest
            else:
                column.min_width = max(Measurement.get(console, wide, column.header).maximum,
                                       min(widest, TEXT_FLOOR))
                need += column.min_width
        if need > options.max_width:
            self.width = need
        yield from super().__rich_console__(console, options)
