"""Which FastDeploy folders FastDeploy's own loader reads: every quantization preset x tp 1/2/4 x
dense / MoE, compiled with `--emit fastdeploy` and read by the harness (tests/reference), one
markdown row per model and preset (docs/targets.md, "Which folders FastDeploy loads").

A cell is `ok` (FastDeploy's loader reads every tensor: name, shape, dtype), `ok (bf16, quantized
at load)` (the bf16 form: the harness's only remark is that the folder is not pre-quantized),
`N mismatches`, or the compile's refusal (one line; abbreviated in the table, whole with -v).

The models: ERNIE 4.5 checkpoint folders with the `@tiny` layer pattern and sizes every linear
packs at sm80 on 1, 2 and 4 ranks (hidden 256, 8 heads of 32, 4 KV heads, expert width 512),
generated weights (names, shapes and dtypes are what is checked).

    python scripts/fastdeploy_matrix.py [--presets wint8,...] [--tp 1,2,4] [--arch 80] [-v]

Needs the `fd` reference environment (bash tests/reference/install_envs.sh fd). About 15 minutes
on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reference"), str(ROOT / "tests" / "parallel")]

from _parallel_testkit import tiny_config, write_paddle_checkpoint  # noqa: E402
from fastdeploy_loader import available, fastdeploy_load  # noqa: E402

from ernie_ir.ir import ErnieIRError  # noqa: E402
from ernie_ir.targets import CompileOptions, compile_model  # noqa: E402

PRESETS = ("wint8", "wint4", "wint8mix", "wint8mix-erniekit", "w4a8c8", "wint2", "fp8")
SIZES = {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 32, "vocab_size": 1024}
MODELS = {"dense": ("ernie-4.5-0.3b", SIZES),
          "MoE": ("ernie-4.5-21b-a3b", {**SIZES, "moe_intermediate_size": 512, "moe_num_shared_experts": 1,
                                        "moe_num_experts": 8, "moe_k": 2})}


def cell(src: Path, preset: str, tp: int, arch: int, work: Path, verbose: bool) -> str:
    out = work / f"{src.name}-{preset}-tp{tp}"
    arch = 90 if preset == "fp8" else arch  # FP8 kernels: Hopper
    try:
        compile_model(str(src), "cuda", CompileOptions(quant=preset, tp=tp, cuda_arch=arch, emit="fastdeploy",
                                                       out=out))
    except ErnieIRError as e:
        line = e.one_line() if hasattr(e, "one_line") else str(e)
        return f"refused: {line}" if verbose else "refused: " + line.split(":", 2)[-1].strip()[:90]
    bf16 = json.loads((out / "config.json").read_text())["ernie_ir"]["format"] == "fastdeploy-bf16-on-grid"
    result = fastdeploy_load(out, work, load_choices="default" if tp == 1 else "default_v1", arch=arch)
    if bf16 and result.loads_at_load_time():
        return "ok (bf16, quantized at load)"
    if result.last == "ok":
        return "ok"
    kinds = sorted({m["kind"] for m in result.findings()})
    return f"{result.last} ({', '.join(kinds)})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--arch", type=int, default=80)
    ap.add_argument("-v", "--verbose", action="store_true", help="whole refusal lines")
    a = ap.parse_args()
    why = available()
    if why:
        print(why, file=sys.stderr)
        return 2
    tps = [int(t) for t in a.tp.split(",")]
    print("| model | preset | " + " | ".join(f"tp {t}" for t in tps) + " |")
    print("|---|---|" + "---|" * len(tps))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for kind, (name, sizes) in MODELS.items():
            src = work / kind
            write_paddle_checkpoint(src, {**tiny_config(name), **sizes})
            for preset in a.presets.split(","):
                cells = [cell(src, preset, tp, a.arch, work, a.verbose) for tp in tps]
                print(f"| {kind} | {preset} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
