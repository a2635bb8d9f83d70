"""The typer application behind the `ernie-ir` console script.

Every command parses its options, calls the library and prints. User errors
(`ErnieIRError`) become one line on stderr and exit code 2; usage errors are
typer's own (also exit 2).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

import ernie_ir
from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.printer import print_graph

from .inputs import load_input
from .summary import summary_tables

app = typer.Typer(
    name="ernie-ir",
    help="A declarative graph compiler for ERNIE and GPT models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console(highlight=False, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        print(f"ernie-ir {ernie_ir.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """A declarative graph compiler for ERNIE and GPT models."""


@app.command()
def show(
    model: Annotated[str, typer.Argument(help="An .ir file, a graph folder, a model folder or a built-in name.")],
    summary: Annotated[bool, typer.Option("--summary", help="Print counts instead of the IR.")] = False,
    hashes: Annotated[bool, typer.Option("--hashes", help="Print a content hash per param.")] = False,
    trust_pickle: Annotated[
        bool, typer.Option("--trust-pickle", help="Allow loading pickle-based .pdparams checkpoints.")
    ] = False,
) -> None:
    """Print a model's IR (exactly the text format, so it can be parsed back)."""
    graph = load_input(model, trust_pickle=trust_pickle)
    from ernie_ir.ir.verifier import verify

    verify(graph)
    if summary:
        for table in summary_tables(graph):
            out.print(table)
        return
    sys.stdout.write(print_graph(graph, with_hashes=hashes))


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the app and maps user errors to exit code 2."""
    try:
        app(args=argv)  # typer handles --help, usage errors (exit 2) and Exit itself
    except ErnieIRError as e:
        err.print(f"[bold red]error:[/] {e}", markup=True, highlight=False, soft_wrap=True)
        sys.exit(2)
    except BrokenPipeError:
        sys.exit(0)


if __name__ == "__main__":  # pragma: no cover
    main()

__all__ = ["app", "main"]
