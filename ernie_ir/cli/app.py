"""The typer application behind the `ernie-ir` console script: the command tree.

This module only assembles the commands, which live in one module per group:
show, explain, passes and ops in inspect_cmds.py; compile, export and verify in
compile_cmds.py; run and train in run_cmds.py; plan in plan_cmd.py; golden in
golden_cmds.py. What they share (consoles, option types, the pipeline flags) is
common.py. User errors (`ErnieIRError`) and usage errors (unknown command or option,
missing argument) become one line on stderr and exit code 2: exits.py, behind `main`.

Importing the CLI loads typer and nothing of the library: each command imports what
it uses, so `--version` and `--help` start in about the time typer and rich take
(benchmarks/cli_startup.py; tests/test_cli_startup.py keeps numpy, pydantic,
networkx, onnx and paddle out of them). Annotations that typer reads stay builtins
and `Path`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from . import compile_cmds, eval_cmd, generate_cmd, golden_cmds, inspect_cmds, plan_cmd, run_cmds
from .common import TargetsInHelp
from .exits import run_app

# Plain (click) help: typer's rich help imports markdown-it, pygments and most of rich, which
# alone doubles the startup of `--help` (benchmarks/cli_startup.py).
app = typer.Typer(
    name="ernie-ir",
    help="A declarative graph compiler for ERNIE and GPT models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
golden_app = typer.Typer(help="Check or update golden-graph files.", no_args_is_help=True,
                         rich_markup_mode=None)
app.add_typer(golden_app, name="golden")


def _version(value: bool) -> None:
    if value:
        from ernie_ir import __version__

        print(f"ernie-ir {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """A declarative graph compiler for ERNIE and GPT models."""


# In this order in `ernie-ir --help`.
app.command()(inspect_cmds.show)
app.command()(run_cmds.run)
app.command()(generate_cmd.generate)
app.command("eval")(eval_cmd.eval_cmd)
app.command("sensitivity")(eval_cmd.sensitivity_cmd)
app.command("tune")(eval_cmd.tune_cmd)
app.command(cls=TargetsInHelp)(compile_cmds.compile)
app.command("export")(compile_cmds.export_cmd)
app.command()(run_cmds.train)
app.command("verify")(compile_cmds.verify_cmd)
app.command()(inspect_cmds.passes)
app.command("ops")(inspect_cmds.ops_cmd)
app.command()(inspect_cmds.explain)
app.command(cls=TargetsInHelp)(plan_cmd.plan)
golden_app.command("check")(golden_cmds.golden_check)
golden_app.command("update")(golden_cmds.golden_update)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: user and usage errors become one line and exit code 2;
    Ctrl-C and SIGTERM clean up and exit 130 and 143."""
    run_app(app, argv)


if __name__ == "__main__":  # pragma: no cover
    main()

__all__ = ["app", "main"]
