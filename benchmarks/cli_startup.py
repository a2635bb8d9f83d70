"""Startup cost of `ernie-ir --version` and `ernie-ir --help` against a bare typer + rich.

Each command runs as a fresh `python -c ...` subprocess of the same interpreter,
best of N (default 10) for wall time and for CPU time (user + system, from
`resource.getrusage(RUSAGE_CHILDREN)`); the baseline is a Python that imports only
typer and rich. The target (issue 13) is a ratio of at most 2 for both commands.

    python benchmarks/cli_startup.py [--runs 10] [--importtime]

`--importtime` also prints the ten slowest imports (cumulative) of `--version`.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

BASELINE = "import typer, rich"
CLI = "import sys; from ernie_ir.cli.app import main; sys.argv = ['ernie-ir', {arg!r}]; main([{arg!r}])"


def measure(code: str, runs: int) -> tuple[float, float]:
    """(best wall seconds, best CPU seconds) of `python -c code` over `runs` runs."""
    best_wall = best_cpu = float("inf")
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "COLUMNS": "80"})
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
    return best_wall, best_cpu


def importtime_top(code: str, n: int = 10) -> list[tuple[int, str]]:
    """The `n` largest cumulative import times (microseconds, module) of `python -X importtime -c code`."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], check=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    return sorted(rows, reverse=True)[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--importtime", action="store_true")
    args = parser.parse_args()
    base_wall, base_cpu = measure(BASELINE, args.runs)
    print(f"baseline `python -c '{BASELINE}'`: wall {base_wall * 1e3:.1f} ms, cpu {base_cpu * 1e3:.1f} ms")
    worst = 0.0
    for arg in ("--version", "--help"):
        wall, cpu = measure(CLI.format(arg=arg), args.runs)
        ratio_wall, ratio_cpu = wall / base_wall, cpu / max(base_cpu, 1e-9)
        worst = max(worst, ratio_wall, ratio_cpu)
        print(f"ernie-ir {arg:<9}: wall {wall * 1e3:.1f} ms ({ratio_wall:.2f}x), "
              f"cpu {cpu * 1e3:.1f} ms ({ratio_cpu:.2f}x)")
    print(f"worst ratio {worst:.2f}x (target <= 2x) over best of {args.runs}")
    if args.importtime:
        print("slowest imports of `ernie-ir --version` (cumulative):")
        for us, name in importtime_top(CLI.format(arg="--version")):
            print(f"  {us / 1e3:8.1f} ms  {name}")


if __name__ == "__main__":
    main()
