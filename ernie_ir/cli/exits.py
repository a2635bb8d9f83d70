"""How `ernie-ir` ends: the exit codes and the one-line errors.

A user error (`ErnieIRError`) or a usage error (unknown command or option, missing
argument) prints one `error:` line on stderr and exits 2; a Python warning prints one
`warning:` line; Ctrl-C and SIGTERM clean up (as on KeyboardInterrupt) and exit 130 and
143; running out of memory or recursion depth is one line and exit 2 too. app.py's
`main` is `run_app(app, argv)`.
"""

from __future__ import annotations

import sys

import typer

from .common import err


def _usage_error(e: Exception) -> tuple[str, int] | None:
    """(message, exit code) of a command-line usage error raised by typer's click layer.

    Recognised by shape (`format_message()` and an int `exit_code`), because typer
    vendors click privately; anything else is not a usage error.
    """
    fmt = getattr(e, "format_message", None)
    code = getattr(e, "exit_code", None)
    if not callable(fmt) or not isinstance(code, int):
        return None
    ctx = getattr(e, "ctx", None)
    where = getattr(ctx, "command_path", None) or "ernie-ir"
    return f"{fmt()} (see `{where} --help`)", code


def _is_user_error(e: BaseException) -> bool:
    """An ErnieIRError; looked up, not imported: if the library's errors were never loaded, no
    command got as far as raising one (and `--bogus` should not pay for importing them)."""
    errors = sys.modules.get("ernie_ir.ir.errors")
    return errors is not None and isinstance(e, errors.ErnieIRError)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is so that it cleans up as on Ctrl-C (temp folders)."""


_signalled: list[int] = []


def _on_sigterm(signum: int, _frame: object) -> None:
    import signal

    signal.signal(signum, signal.SIG_IGN)  # a second SIGTERM must not interrupt the cleanup
    _signalled.append(signum)
    raise Terminated()


def _interrupted() -> int:
    """128 + the signal: 130 for Ctrl-C (SIGINT), 143 for SIGTERM."""
    return 128 + (_signalled[0] if _signalled else 2)


def run_app(app: typer.Typer, argv: list[str] | None) -> None:
    """Run `app` on `argv` (None: sys.argv) and exit: user and usage errors become one line
    and exit code 2; Ctrl-C and SIGTERM clean up and exit 130 and 143."""
    import signal
    import threading
    import warnings

    _signalled.clear()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    shown = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        _run(app, argv)
    finally:  # run in-process (tests call main()), it leaves the caller's handlers
        warnings.showwarning = shown
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: object = None, line: str | None = None) -> None:
    """A Python warning (ours or a library's) as one `warning:` line, never a multi-line dump."""
    err.print(f"warning: {' '.join(str(message).split())}", markup=False)


def _run(app: typer.Typer, argv: list[str] | None) -> None:
    try:
        code = app(args=argv, standalone_mode=False)  # typer returns 130 for a KeyboardInterrupt
        if _signalled:
            err.print("aborted", markup=False)
            sys.exit(_interrupted())
    except BrokenPipeError:
        sys.exit(0)
    except KeyboardInterrupt:
        err.print("aborted", markup=False)
        sys.exit(_interrupted())
    except MemoryError:  # numpy or Paddle could not allocate: one line, not a traceback
        err.print("[bold red]error:[/] out of memory: the model or the input is too large for this "
                  "machine; try --meta, a smaller model, fewer tokens or a smaller batch", markup=True)
        sys.exit(2)
    except RecursionError:  # a reader without its own depth check met a deeply nested input
        err.print("[bold red]error:[/] an input nests too deeply to read (thousands of brackets or "
                  "indents): check the files and options given", markup=True)
        sys.exit(2)
    except Exception as e:
        from rich.markup import escape

        if _is_user_error(e):
            # the error's own fields (flag, value, problem, fix) as one line; a name holding a
            # newline must not split it
            one_line = " ".join((e.one_line() if hasattr(e, "one_line") else str(e)).splitlines())
            err.print(f"[bold red]error:[/] {escape(one_line)}", markup=True)
            sys.exit(2)
        usage = _usage_error(e)
        if usage is None:
            if type(e).__name__ == "Abort":
                if isinstance(e.__cause__, EOFError):  # click turns any EOFError into Abort
                    why = escape(str(e.__cause__) or "end of file")
                    err.print(f"[bold red]error:[/] an input ended early ({why}): a file given is empty "
                              "or truncated", markup=True)
                    sys.exit(2)
                err.print("aborted", markup=False)
                sys.exit(_interrupted())
            raise
        message, status = usage
        if not message.startswith(" (see"):  # bare `ernie-ir`: the help was the answer
            err.print(f"[bold red]error:[/] {escape(message)}", markup=True)
        sys.exit(status)
    sys.exit(code if isinstance(code, int) else 0)
