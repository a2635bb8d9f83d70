"""What quantization costs, as bytes against KL: wint4, WINT8MIX, wint8 and `tune`d configs.

For two MoE models with seeded generated weights (the built-in ernie-4.5-21b-a3b@tiny, and the
same architecture larger: hidden 256, 4 layers, 32 experts top-4 with 2 shared, expert width
256, vocabulary 4096, untied head), on a calibration corpus of random token ids (--docs documents of --tokens
tokens; generated weights give no text a meaning), each row is a configuration's weight bytes
(the quantizable linears and experts: int4 / int8 plus bf16 per-channel scales, float as stored)
and its measured KL(float || quantized), mean per token, end to end. `tune` runs at two budgets,
given as multiples of WINT8MIX's measured KL (--budgets 0.5,2: half of it, and twice), with
formats int4, int8, float.

Measured (2 cores, 2026-12-01, --docs 2 --tokens 96 --seq-len 48), docs/quantization.md
"Measuring the damage" has the table.

    python benchmarks/quant_damage.py [--budgets 0.5,2] [--docs 2] [--tokens 96] [--seq-len 48]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from ernie_ir.evaluation.sensitivity import preset_points, tune
from ernie_ir.frontends.builtins import TINY_SEED, builtin_config
from ernie_ir.frontends.config import parse_config
from ernie_ir.frontends.loader import GeneratedWeights, _finish, build_graph
from ernie_ir.ir.storage import save_graph


def larger_moe(folder: Path) -> str:
    config = builtin_config("ernie-4.5-21b-a3b", "meta")
    config.update({"num_hidden_layers": 4, "vocab_size": 4096, "hidden_size": 256, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768, "moe_k": 4,
                   "moe_num_experts": 32, "moe_intermediate_size": 256, "moe_num_shared_experts": 2,
                   "moe_layer_start_index": 1, "moe_layer_end_index": 3, "num_nextn_predict_layers": 0,
                   "tie_word_embeddings": False})
    cfg = parse_config(config, "ernie-4.5-moe-larger")
    graph = _finish(build_graph(cfg, GeneratedWeights(TINY_SEED), name="ernie-4.5-moe-larger"), cfg,
                    {"source": "quant_damage", "weights": "generated"})
    save_graph(graph, folder)
    return str(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="0.5,2", help="KL budgets as multiples of WINT8MIX's KL")
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seq-len", type=int, default=48)
    args = ap.parse_args()
    factors = [float(b) for b in args.budgets.split(",")]
    work = Path(tempfile.mkdtemp(prefix="quant-damage-"))
    rows = []
    for label, model, vocab in (("ernie-4.5-21b-a3b@tiny", "ernie-4.5-21b-a3b@tiny", 1024),
                                ("larger MoE (h256, 32 experts)", None, 4096)):
        if model is None:
            model = larger_moe(work / "larger")
        rng = np.random.default_rng(0)
        data = work / f"{len(rows)}.jsonl"
        data.write_text("".join(json.dumps({"input_ids": rng.integers(0, vocab, args.tokens).tolist()}) + "\n"
                                for _ in range(args.docs)))
        points = preset_points(model, data, seq_len=args.seq_len)
        mix_kl = next(p["kl"] for p in points if p["config"] == "wint8mix")
        for factor in factors:
            budget = factor * mix_kl
            t0 = time.perf_counter()
            result = tune(model, data, budget=budget, seq_len=args.seq_len)
            seconds = time.perf_counter() - t0
            if factor == factors[0]:
                for p in points:
                    rows.append((label, p["config"], p["weight_bytes"], p["kl"], result.float_bytes))
            counts = {f: list(result.formats.values()).count(f) for f in ("int4", "int8", "float")}
            mix = f"{counts['int4']}/{counts['int8']}/{counts['float']} int4/int8/float"
            name = f"tuned, budget {budget:.3g} = {factor:g} x WINT8MIX's ({mix})"
            rows.append((label, name, result.weight_bytes, result.kl, result.float_bytes))
            print(f"# {label}: tune at {budget:g} took {seconds:.1f} s", flush=True)
    print("\n| model | configuration | weight MB | of float | KL mean |\n|---|---|---|---|---|")
    for label, name, nbytes, kl, total in rows:
        print(f"| {label} | {name} | {nbytes / 1e6:.3f} | {nbytes / total:.1%} | {kl:.3g} |")
    print(json.dumps([{"model": r[0], "config": r[1], "weight_bytes": r[2], "kl": r[3]} for r in rows]))


if __name__ == "__main__":
    main()
