"""Fuzz soak: the strategies of tests/fuzz, run for minutes instead of seconds.

Runs every reader (IR text and .ir files, pipeline text and YAML, --quant-config YAML, config.json
dicts and files, safetensors files, graph folders, --device-memory / --tokens / --quant strings,
.npy token files, quant patterns) on inputs drawn by hypothesis from a random seed (printed, and
accepted back with --seed), in rounds until the time or example budget is spent. It never stops
at a failure: it counts every input, every non-project exception (the goal is 0; each distinct one
is listed with a shortened input, and --save writes it whole), and reports the slowest input and
its time.

    python benchmarks/fuzz_soak.py [--minutes 3] [--examples N] [--seed S] [--only ir,config]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fuzz"))

import _fuzz_strategies as fz
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

SAVE: Path | None = None


@dataclass
class Stats:
    inputs: int = 0
    accepted: int = 0
    slowest: float = 0.0
    slowest_input: str = ""
    bugs: dict[str, tuple[int, str]] = field(default_factory=dict)  # where -> (count, input)


def _where(e: BaseException) -> str:
    """Exception type and the innermost ernie_ir frame: one key per distinct bug."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "ernie_ir" in f.filename]
    last = frames[-1] if frames else traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__} at {Path(last.filename).name}:{last.lineno} ({str(e)[:80]!r})"


def _short(arg: Any) -> str:
    text = repr(arg)
    return text if len(text) <= 300 else text[:200] + f"... ({len(text)} chars) ..." + text[-60:]


TRACED = {"config", "safetensors", "graph-folder", "npy-tokens"}
"""Targets whose readers allocate arrays: their peak allocation is bounded (tracemalloc)."""


def targets(tmp: Path) -> dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], None]]]:
    seed_file = fz.safetensors_seed(str(tmp))
    graph_text = fz.print_graph(fz.seed_graph(), with_hashes=True)
    folder = tmp / "graph"
    folder.mkdir()
    cfg_folder = tmp / "model"
    cfg_folder.mkdir()
    st_path = tmp / "fuzz.safetensors"
    return {
        "ir": (fz.ir_texts(), fz.parse_ir_property),
        "ir-paths": (fz.ir_texts(), fz.parse_ir_both_paths),
        "ir-file": (fz.ir_files(), lambda raw: fz.ir_file_property(tmp / "g.ir", raw)),
        "ir-attrs": (fz.ir_attr_swaps(), fz.parse_ir_property),
        "attrs": (fz.swapped_attrs(), lambda case: fz.make_attrs_property(*case)),
        "pipeline-text": (fz.pipeline_texts(), fz.pipeline_text_property),
        "pipeline-yaml": (fz.pipeline_yamls(), fz.pipeline_yaml_property),
        "config": (fz.config_dicts(), fz.config_property),
        "config-file": (fz.config_texts(), lambda raw: fz.config_file_property(cfg_folder, raw)),
        "safetensors": (fz.safetensors_files(seed_file),
                        lambda raw: fz.safetensors_property(st_path, raw)),
        "graph-folder": (fz.safetensors_files(seed_file),
                         lambda raw: fz.graph_folder_property(folder, graph_text, raw)),
        "memory": (fz.MEMORY_TEXTS, fz.memory_property),
        "tokens": (fz.TOKEN_TEXTS, fz.tokens_property),
        "npy-tokens": (fz.npy_files(), lambda raw: fz.npy_tokens_property(tmp / "ids.npy", raw)),
        "quant": (fz.QUANT_TEXTS, fz.quant_property),
        "pattern": (fz.PATTERN_TEXTS, fz.pattern_property),
        "quant-config": (fz.quant_config_texts(),
                         lambda text: fz.quant_config_property(tmp / "q.yaml", text)),
    }


def run_round(name: str, strategy: st.SearchStrategy[Any], prop: Callable[[Any], None], stats: Stats,
              examples: int, round_seed: int) -> None:
    @hseed(round_seed)
    @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(arg: Any) -> None:
        stats.inputs += 1
        try:
            elapsed, accepted = fz.check_total(prop, arg, trace_memory=name in TRACED)
            stats.accepted += accepted
        except (Exception, fz.FuzzHang) as e:
            key = _where(e)
            count, first = stats.bugs.get(key, (0, _short(arg)))
            stats.bugs[key] = (count + 1, first)
            if count == 0 and SAVE is not None:
                SAVE.mkdir(parents=True, exist_ok=True)
                (SAVE / f"{name}-{len(stats.bugs)}.repr").write_text(repr(arg) + "\n" + key + "\n")
            return
        if elapsed > stats.slowest:
            stats.slowest, stats.slowest_input = elapsed, _short(arg)

    one()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="time budget (default 3)")
    ap.add_argument("--examples", type=int, default=0, help="stop after this many inputs in all")
    ap.add_argument("--round", type=int, default=100, help="inputs per target per round")
    ap.add_argument("--seed", type=int, default=None, help="seed (default: random, printed)")
    ap.add_argument("--only", default="", help="comma-separated targets (default: all)")
    ap.add_argument("--save", type=Path, default=None, help="write the first input of each bug here")
    args = ap.parse_args()
    global SAVE
    SAVE = args.save
    base_seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"seed {base_seed} (rerun with --seed {base_seed})", flush=True)
    with tempfile.TemporaryDirectory(prefix="ernie-ir-fuzz-") as tmp:
        table = targets(Path(tmp))
        chosen = [t for t in args.only.split(",") if t] or list(table)
        stats = {name: Stats() for name in chosen}
        deadline = time.monotonic() + args.minutes * 60
        t0 = time.monotonic()
        rnd = 0
        while time.monotonic() < deadline:
            for name in chosen:
                strategy, prop = table[name]
                run_round(name, strategy, prop, stats[name], args.round, base_seed + rnd)
                if time.monotonic() >= deadline:
                    break
            rnd += 1
            total = sum(s.inputs for s in stats.values())
            if args.examples and total >= args.examples:
                break
        wall = time.monotonic() - t0
    total = sum(s.inputs for s in stats.values())
    bugs = sum(c for s in stats.values() for c, _ in s.bugs.values())
    print(f"\n{total} inputs in {wall:.0f} s ({rnd} rounds), non-project exceptions: {bugs}")
    print(f"{'target':<15}{'inputs':>8}{'accepted':>10}{'bugs':>6}{'slowest':>10}")
    for name, s in stats.items():
        n_bugs = sum(c for c, _ in s.bugs.values())
        print(f"{name:<15}{s.inputs:>8}{s.accepted:>10}{n_bugs:>6}{s.slowest * 1000:>8.1f}ms")
    worst = max(stats.items(), key=lambda kv: kv[1].slowest)
    print(f"slowest input: {worst[1].slowest * 1000:.1f} ms ({worst[0]}): {worst[1].slowest_input}")
    for name, s in stats.items():
        for where, (count, first) in sorted(s.bugs.items()):
            print(f"BUG {name}: {count} x {where}\n    first input: {first}")
    sys.exit(1 if bugs else 0)


if __name__ == "__main__":
    main()
