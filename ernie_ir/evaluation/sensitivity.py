"""Per-unit quantization sensitivity, and mixed precision chosen by a KL budget.

A unit is one quantizable weight as quantization rules select it (`find_targets`): a linear, or
the stacked routed experts of one projection of one MoE layer. Two measures of what quantizing a
unit alone costs, everything else float:

- exact: the KL(float || model) mean over the calibration windows, end to end (one forward of
  the whole model per unit);
- approximate: the unit's own relative output error on the calibration activations,
  ||X W - X Q(W)||^2 / ||X W||^2 with X the unit's inputs in the float model (one forward in all;
  for a stack of experts every expert on every token of the layer's input; the experts' down
  projections, whose inputs stay inside the MoE op, use X = I: the weight's own relative error).

`tune` chooses one format per unit (e.g. int4, int8 or float) to meet a KL budget with the
fewest weight bytes: a multiple-choice knapsack on the per-unit exact costs (assumed additive),
solved greedily by the best KL saved per byte added, then measured end to end; while the measured
KL is over the budget the assumed budget shrinks and the search repeats (up to 4 rounds). The
result is an ordinary QuantConfig (rules matching each quantized unit's path) that `compile
--quant-config` and `plan` accept; WINT8MIX (experts int4, the rest int8) is one point of the
search space.

`sensitivity --skip-top K --out quant.yaml` writes the seed's next step (PaddleFleetX's GPT QAT):
PaddleSlim's `Compress.Quantization` section, the qat-int8 recipe, with the K most sensitive
units in its `skip_tensor_map` (`skip_map_yaml`; the names are `ernie_ir.ir.paddleslim_quant`'s,
which `compile --quant-config` reads back).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.ir import Graph
from ernie_ir.ir.paddleslim_quant import quantization_section, skip_tensor_map
from ernie_ir.ops.quant_numerics import weight_dequantize, weight_quantize
from ernie_ir.passes import PassContext
from ernie_ir.passes.quant.annotate import QuantAnnotate
from ernie_ir.passes.quant.config import Algo, QuantConfig, QuantRule, WeightSite, find_targets
from ernie_ir.passes.quant.weight_only import WeightOnlyQuant
from ernie_ir.runtime import Interpreter

from .corpus import EvalError, check_window, read_corpus, windows
from .statistics import log_softmax

FORMATS: dict[str, Algo] = {"int4": Algo.WEIGHT_ONLY_INT4, "int8": Algo.WEIGHT_ONLY_INT8, "float": Algo.NONE}
"""Unit formats: weight-only int4 / int8 (per-channel scales), or float (as the checkpoint)."""
Progress = Callable[[str, int, int], None]
"""progress(stage, units done, units in the stage): "approximate", "exact", "unit costs", "presets"."""


@dataclass
class UnitCost:
    unit: str
    kind: str
    params: int
    approx: float = float("nan")
    kl: float = float("nan")


@dataclass
class SensitivityReport:
    format: str
    units: list[UnitCost]
    spearman: float | None
    """Rank correlation of the approximate and the exact costs (both measured), else None."""
    tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {"format": self.format, "tokens": self.tokens, "spearman": self.spearman,
                "units": [vars(u) for u in self.units]}


def _unit_bytes(params: int, fmt: str, float_bytes: int, out_features: int) -> float:
    if fmt == "float":
        return params * float_bytes
    bits = 4 if fmt == "int4" else 8
    return params * bits / 8 + out_features * 2  # bf16 per-channel scales


def weight_bytes(sites: Sequence[WeightSite], formats: dict[str, str]) -> float:
    """The bytes of the units' weights in `formats` (path -> int4 / int8 / float; int formats add
    bf16 per-channel scales, float is the param's own dtype)."""
    total = 0.0
    for s in sites:
        if s.param is None or s.path not in formats:
            continue
        shape = s.param.type.shape
        total += _unit_bytes(int(np.prod(shape)), formats[s.path], s.param.type.dtype.bits // 8,
                             int(shape[-1]) * max(s.experts, 1))
    return total


def quantize_units(graph: Graph, formats: dict[str, str]) -> Graph:
    """`graph` with the units named in `formats` (path -> int4 / int8) quantized, in place."""
    rules = tuple(QuantRule(match=re.escape(path), algo=FORMATS[fmt]) for path, fmt in formats.items()
                  if fmt != "float")
    if not rules:
        return graph
    ctx = PassContext()
    QuantAnnotate({"config": QuantConfig(name="units", rules=rules)}).run(graph, ctx)
    WeightOnlyQuant().run(graph, ctx)
    return graph


def config_for(formats: dict[str, str], name: str = "tuned") -> QuantConfig:
    """The QuantConfig that quantizes each unit of `formats` as given (float units left out)."""
    rules = tuple(QuantRule(match=re.escape(path), algo=FORMATS[fmt]) for path, fmt in formats.items()
                  if fmt != "float")
    if not rules:
        raise EvalError("every unit stays float: there is nothing to quantize")
    return QuantConfig(name=name, rules=rules)


def load_float(model: str | Path) -> Graph:
    """A fresh graph of `model` (units are quantized in place, one copy each)."""
    from ernie_ir.load import load_input

    graph = load_input(str(model))
    if graph.metadata.get("quantization"):
        raise EvalError(f"{model} is already quantized: measure sensitivity on the float model")
    return graph


class _Calibration:
    """The float model's log-probabilities on the calibration windows, and a KL meter."""

    def __init__(self, model: str | Path, data: str | Path, seq_len: int, max_tokens: int) -> None:
        from ernie_ir.frontends.tokenizer import load_tokenizer
        from ernie_ir.load import tokenizer_folder

        graph = load_float(model)
        self.name = graph.inputs[0].name
        self.out = graph.output_names[0]
        vocab = graph.outputs[0].type.shape[-1]
        folder = tokenizer_folder(model)
        tok = load_tokenizer(folder) if folder is not None else None
        corpus = read_corpus(data, tok.encode if tok is not None else None,
                             vocab if isinstance(vocab, int) else None, max_tokens)
        check_window(seq_len, seq_len, None, corpus)
        self.windows = [(np.asarray([w], np.int64), first) for d in corpus.documents
                        for w, first in windows(d, seq_len, seq_len)]
        self.tokens = sum(w.shape[1] - f for w, f in self.windows)
        self.float_graph = graph
        it = Interpreter(graph)
        # (log p, p) of the float model per window: every unit's KL is measured against them
        self.reference = []
        for w, f in self.windows:
            lr = log_softmax(it.run({self.name: w})[self.out][0, f - 1:-1])
            self.reference.append((lr, np.exp(lr)))

    def kl(self, graph: Graph) -> float:
        it = Interpreter(graph)
        total = 0.0
        for (w, f), (lr, pr) in zip(self.windows, self.reference, strict=True):
            lp = log_softmax(it.run({self.name: w})[self.out][0, f - 1:-1])
            total += float(np.maximum((pr * (lr - lp)).sum(axis=-1), 0).sum())
        return total / self.tokens


def _site_inputs(graph: Graph, sites: Sequence[WeightSite], windows_: list[tuple[np.ndarray, int]],
                 name: str) -> dict[int, list[np.ndarray]]:
    """Each site's activation input (flattened to [tokens, K]) on the calibration windows."""
    found: dict[int, list[np.ndarray]] = {i: [] for i in range(len(sites))}
    readers: dict[int, list[int]] = {}  # id of an activation value -> the sites reading it
    for i, s in enumerate(sites):
        readers.setdefault(id(s.node.inputs[0]), []).append(i)

    def observe(node: Any, results: list[np.ndarray]) -> None:
        for v, arr in zip(node.outputs, results, strict=True):
            for i in readers.get(id(v), ()):
                found[i].append(arr.reshape(-1, arr.shape[-1]).astype(np.float32))

    it = Interpreter(graph)
    for w, _ in windows_:
        it.run({name: w}, observer=observe)
    return found


def _approx_error(weight: np.ndarray, x: np.ndarray, bits: int) -> float:
    """||x W - x Q(W)||^2 / ||x W||^2 (for a stack [E, K, N]: summed over the experts)."""
    w = weight.astype(np.float32)
    q, scale = weight_quantize(w, bits)
    dq = weight_dequantize(q, scale)
    if w.ndim == 2:
        w, dq = w[None], dq[None]
    if x.shape[-1] != w.shape[-2]:  # the experts' down projection: its input is inside the op
        x = np.eye(w.shape[-2], dtype=np.float32)
    num = den = 0.0
    for we, de in zip(w, dq, strict=True):
        y = x @ we
        num += float(np.square(x @ (we - de)).sum())
        den += float(np.square(y).sum())
    return num / den if den > 0 else 0.0


def _spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    if len(a) < 3:
        return None
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def sensitivity(model: str | Path, data: str | Path, *, fmt: str = "int4", seq_len: int = 128,
                max_tokens: int = 512, mode: str = "both", skip_top: int | None = None,
                progress: Progress | None = None) -> SensitivityReport:
    """Each unit's cost when it alone is quantized to `fmt` (`mode`: exact, approx or both).

    `model`: a float MODEL (checkpoint folder, built-in, graph folder); its tokenizer reads text.
    `skip_top`: the K the caller will skip (`skip_map_yaml`), checked against the units before
    anything is measured."""
    if fmt not in ("int4", "int8"):
        raise EvalError(f"unknown --format {fmt!r}: choose int4 or int8")
    if mode not in ("exact", "approx", "both"):
        raise EvalError(f"unknown --mode {mode!r}: choose exact, approx or both")
    cal = _Calibration(model, data, seq_len, max_tokens)
    sites = find_targets(cal.float_graph)
    if not sites:
        raise EvalError("the model has no quantizable linear or expert weight")
    if skip_top is not None:
        check_skip_top(skip_top, len(sites))
        skip_tensor_map(s.path for s in sites)  # every unit nameable, or one line before measuring
    units = [UnitCost(s.path, s.kind, int(np.prod([d for d in (s.param.type.shape if s.param else ())])))
             for s in sites]
    if mode in ("approx", "both"):
        xs = _site_inputs(cal.float_graph, sites, cal.windows, cal.name)
        for i, (s, u) in enumerate(zip(sites, units, strict=True)):
            if s.param is None or not xs[i]:
                continue
            bits = 4 if fmt == "int4" else 8
            u.approx = _approx_error(np.asarray(s.param.read()), np.concatenate(xs[i]), bits)
            if progress is not None:
                progress("approximate", i + 1, len(units))
    if mode in ("exact", "both"):
        for i, u in enumerate(units):
            u.kl = cal.kl(quantize_units(load_float(model), {u.unit: fmt}))
            if progress is not None:
                progress("exact", i + 1, len(units))
    both = [u for u in units if not math.isnan(u.kl) and not math.isnan(u.approx)]
    rho = _spearman([u.kl for u in both], [u.approx for u in both]) if mode == "both" else None
    key = (lambda u: u.kl) if mode != "approx" else (lambda u: u.approx)
    units.sort(key=key, reverse=True)
    return SensitivityReport(fmt, units, rho, cal.tokens)


def check_skip_top(top: int, units: int | None = None) -> None:
    """EvalError (one line) unless 1 <= `top` <= `units` (None: before the units are known)."""
    if top < 1:
        raise EvalError(f"--skip-top must be 1 or more (the units kept float), not {top}")
    if units is not None and top > units:
        raise EvalError(f"--skip-top {top} is more than the model's {units} units: give at most {units}")


def skip_map_yaml(report: SensitivityReport, top: int, model: str | Path) -> str:
    """PaddleSlim's `Compress.Quantization` section (the qat-int8 recipe: PaddleFleetX's GPT-345M
    QAT) with the `top` most sensitive units of `report` in `skip_tensor_map`, as YAML text whose
    comment lines name those units and their costs."""
    import yaml  # only the written file needs it

    check_skip_top(top, len(report.units))
    chosen = report.units[:top]
    recipe = QuantConfig.preset("qat-int8")
    section = quantization_section(recipe.rules[0].annotation(), recipe.freeze_embedding,
                                   skip_tensor_map(u.unit for u in chosen))
    measure = "KL" if not all(math.isnan(u.kl) for u in report.units) else "output error"
    where = " ".join(str(model).splitlines())  # a comment is one line
    lines = [f"# ernie-ir sensitivity {where} --format {report.format}: the {top} most sensitive of "
             f"{len(report.units)} units stay float in QAT ({measure} when one unit alone is "
             f"{report.format}, over {report.tokens} tokens)"]
    lines += [f"#   {u.unit}: {u.kl if measure == 'KL' else u.approx:.6g}" for u in chosen]
    return "\n".join(lines) + "\n" + yaml.safe_dump(section, sort_keys=False, default_flow_style=None)


@dataclass
class TuneResult:
    budget: float
    formats: dict[str, str]
    kl: float
    """Measured end to end."""
    weight_bytes: float
    float_bytes: float
    points: list[dict[str, Any]] = field(default_factory=list)
    """Bytes and measured KL of the fixed presets (wint4, wint8mix, wint8) on the same data."""

    def as_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "kl": self.kl, "weight_bytes": self.weight_bytes,
                "float_bytes": self.float_bytes, "formats": self.formats, "presets": self.points}


def tune(model: str | Path, data: str | Path, *, budget: float,
         formats: Sequence[str] = ("int4", "int8", "float"), seq_len: int = 128, max_tokens: int = 512,
         progress: Progress | None = None) -> TuneResult:
    """The per-unit formats that meet `budget` (mean KL per token) with the fewest weight bytes.

    The presets (wint4, WINT8MIX, wint8, as far as `formats` allows) are measured too: they are
    points of the same search, and reported (`TuneResult.points`)."""
    if not budget > 0 or not math.isfinite(budget):
        raise EvalError(f"--budget must be a KL above 0 (got {budget})")
    order = [f for f in ("int4", "int8", "float") if f in formats]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not order:
        raise EvalError(f"unknown format {unknown[0] if unknown else ''!r}: choose from int4, int8, float")
    cal = _Calibration(model, data, seq_len, max_tokens)
    sites = [s for s in find_targets(cal.float_graph) if s.param is not None]
    nbytes = {(s.path, f): weight_bytes([s], {s.path: f}) for s in sites for f in order}

    def size(fmts: dict[str, str]) -> float:
        return sum(nbytes[p, f] for p, f in fmts.items())

    cost: dict[tuple[str, str], float] = {}
    todo = [(s.path, f) for s in sites for f in order if f != "float"]
    for i, (path, f) in enumerate(todo):
        cost[path, f] = cal.kl(quantize_units(load_float(model), {path: f}))
        if progress is not None:
            progress("unit costs", i + 1, len(todo))
    for s in sites:
        cost[s.path, "float"] = 0.0

    def solve(limit: float) -> dict[str, str]:
        chosen = {s.path: order[0] for s in sites}
        total = sum(cost[p, f] for p, f in chosen.items())
        while total > limit:
            best = None
            for p, f in chosen.items():
                i = order.index(f)
                if i + 1 == len(order):
                    continue
                g = order[i + 1]
                saved = cost[p, f] - cost[p, g]
                score = saved / max(nbytes[p, g] - nbytes[p, f], 1e-9)
                if best is None or score > best[0]:
                    best = (score, p, g)
            if best is None:
                break
            total += cost[best[1], best[2]] - cost[best[1], chosen[best[1]]]
            chosen[best[1]] = best[2]
        return chosen

    def prune(chosen: dict[str, str], limit: float) -> dict[str, str]:
        """Step units back down where the assumed total stays within `limit` (bytes saved first)."""
        total = sum(cost[p, f] for p, f in chosen.items())
        moves = []
        for p, f in chosen.items():
            i = order.index(f)
            if i:
                g = order[i - 1]
                moves.append(((nbytes[p, f] - nbytes[p, g]) / max(cost[p, g] - cost[p, f], 1e-12), p, g))
        for _, p, g in sorted(moves, reverse=True):
            extra = cost[p, g] - cost[p, chosen[p]]
            if total + extra <= limit:
                chosen[p], total = g, total + extra
        return chosen

    presets = _preset_formats(sites, order)
    points = []
    for i, (name, f) in enumerate(presets.items()):
        kl = cal.kl(quantize_units(load_float(model), f))
        points.append({"config": name, "weight_bytes": size(f), "kl": kl})
        if progress is not None:
            progress("presets", i + 1, len(presets))
    limit = budget
    candidates: list[tuple[float, float, dict[str, str]]] = []
    for _ in range(4):
        chosen = prune(solve(limit), limit)
        measured = cal.kl(quantize_units(load_float(model), chosen))
        if measured <= budget:
            candidates.append((size(chosen), measured, chosen))
            break
        limit *= 0.5 * budget / measured
    for point in points:  # a preset that meets the budget in fewer bytes wins (one point of the space)
        if point["kl"] <= budget:
            candidates.append((point["weight_bytes"], point["kl"], presets[point["config"]]))
    if not candidates:
        best = {s.path: order[-1] for s in sites}
        floor = cal.kl(quantize_units(load_float(model), best))
        raise EvalError(f"no configuration of {', '.join(order)} meets --budget {budget:g}: the smallest KL "
                        f"reached is {floor:.6g} (every unit {order[-1]}); raise the budget or allow more "
                        "formats")
    total, measured, chosen = min(candidates, key=lambda c: (c[0], c[1]))
    return TuneResult(budget, dict(chosen), measured, total, size({s.path: "float" for s in sites}), points)


def _preset_formats(sites: Sequence[WeightSite], order: Sequence[str]) -> dict[str, dict[str, str]]:
    """wint4, WINT8MIX (experts int4, the rest int8) and wint8 as per-unit formats (those `order` allows)."""
    out = {}
    for preset in ("wint4", "wint8mix", "wint8"):
        fmts = {s.path: "int4" if preset == "wint4" or (preset == "wint8mix" and s.experts) else "int8"
                for s in sites}
        if set(fmts.values()) <= set(order):
            out[preset] = fmts
    return out


def preset_points(model: str | Path, data: str | Path, *, seq_len: int = 128,
                  max_tokens: int = 512) -> list[dict[str, Any]]:
    """Weight bytes and measured KL of wint4, WINT8MIX and wint8 (as `tune` reports them)."""
    cal = _Calibration(model, data, seq_len, max_tokens)
    sites = [s for s in find_targets(cal.float_graph) if s.param is not None]
    out = []
    for name, fmts in _preset_formats(sites, ("int4", "int8")).items():
        kl = cal.kl(quantize_units(load_float(model), fmts))
        out.append({"config": name, "weight_bytes": weight_bytes(sites, fmts), "kl": kl})
    return out


def svg_bars(report: SensitivityReport, width: int = 720) -> str:
    """A horizontal bar chart of the units' costs (exact where measured, else approximate)."""
    exact = not all(math.isnan(u.kl) for u in report.units)
    values = [u.kl if exact else u.approx for u in report.units]
    top = max(values) if values and max(values) > 0 else 1.0
    row, label = 18, 330
    height = row * len(values) + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             'font-family="monospace" font-size="11">',
             f'<text x="4" y="14">{"KL" if exact else "relative output error"} when one unit is '
             f'{report.format} (others float), {report.tokens} tokens</text>']
    for i, (u, v) in enumerate(zip(report.units, values, strict=True)):
        y = 24 + i * row
        w = 0 if math.isnan(v) else (width - label - 90) * v / top
        name = u.unit if len(u.unit) < 52 else "..." + u.unit[-49:]
        parts.append(f'<text x="4" y="{y + 12}">{_escape(name)}</text>')
        parts.append(f'<rect x="{label}" y="{y + 2}" width="{w:.1f}" height="{row - 6}" fill="#4477aa"/>')
        parts.append(f'<text x="{label + w + 4:.1f}" y="{y + 12}">{v:.3g}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
