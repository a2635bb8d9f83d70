"""`export_checkpoint`: a MODEL as a published float checkpoint folder (the library behind
`ernie-ir export`), its LoRA adapter merged: what ERNIEKit's export hands to FastDeploy.

    ernie-ir export BASE --lora-adapter DIR --out merged/
    ernie-ir compile merged/ --target cuda --quant wint8mix --tp 2      # or serve merged/ itself

The folder is the published Paddle layout of ERNIE 4.5 (`formats.fastdeploy.published_tensors`,
`write_checkpoint_files`: one writer for this format): `config.json` (the source's,
without `quantization_config`), `model.safetensors` (`ernie.` keys, weights [in, out], one key per
routed expert, every tensor in the model's own dtype: bf16 stays bf16) and the source's tokenizer
files, plus `ernie_ir_export.json` (where it came from: source model and sha256, pipeline, the
adapter's files and sha256). The multi-token-prediction head (`ernie.mtp_*`) is not part of the
graph and is not written; config.json says so (`num_nextn_predict_layers: 0`). FastDeploy serves
it (quantizing and splitting at load), paddleformers loads it, and `ernie-ir compile` /
`load_input` read it back bit for bit.

The adapter is merged as `lora-merge` does (`W' = dtype(f32(W) + (f32(A) @ f32(B)) * scale)`,
one rounding to the weight's dtype), before anything else: no quantization, no split. A model
whose graph already holds adapters (a graph folder made with the `lora` pass) has them merged.
The folder is written atomically (a failure leaves nothing behind) and replaces an existing one
only with `force`, and only a folder this function wrote (or an empty one).

MODEL may also be a full-parameter training artifact (`compile --mode training` without LoRA or
QAT, then `ernie-ir train`): what it learned is written, from its newest checkpoint or the one
`checkpoint` names (`load.load_trained`: every trained float32 param rounded once to its declared
dtype, bf16 for ERNIE 4.5; the untrained ones, e.g. the MoE correction bias and `--freeze`d
params, as the source stores them). `layout="pt"` writes the `-PT` layout instead, the one
transformers loads (`formats.pt_checkpoint`: `model.` keys, split q/k/v and gate/up, [out, in]),
for ERNIE 4.5 only. LoRA training artifacts still export as their source model with
`--lora-adapter` (the run's checkpoint folder); QAT ones compile (`qat-convert`).

`erniekit_export_plan` maps ERNIEKit's `erniekit export CONFIG.yaml` (read by
`training.erniekit_config.erniekit_export`) onto these arguments: `output_dir` is the run to export
(the artifact `ernie-ir train CONFIG.yaml` wrote, or ERNIEKit's own folder of `checkpoint-N`), a
LoRA run's newest adapter is merged into `model_name_or_path`, a full-parameter run's newest
weights are written.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ernie_ir.artifacts.manifest import read_manifest
from ernie_ir.artifacts.publish import artifact_lock
from ernie_ir.formats.fastdeploy import published_tensors, source_config, write_checkpoint_files
from ernie_ir.formats.pt_checkpoint import check_pt_layout, pt_config, pt_tensors
from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.storage import replace_folder
from ernie_ir.load import CHECKPOINTS, load_input, load_trained, tokenizer_folder, training_checkpoints
from ernie_ir.passes.infra.base import graph_properties
from ernie_ir.passes.infra.pipeline import load_pipeline
from ernie_ir.passes.quant.cli_flags import pipeline_for
from ernie_ir.targets.compile import adapter_provenance, params_by_dtype, source_info
from ernie_ir.targets.registry import TargetError
from ernie_ir.training.erniekit_config import ErnieKitExport, model_path

EXPORT_RECORD = "ernie_ir_export.json"
EXPORT_FORMAT = "ernie-ir-export"
"""`format` of EXPORT_RECORD: marks a folder `--force` may replace."""
LAYOUTS = ("paddle", "pt")
"""`--layout`: the published Paddle layout (`-Paddle` checkpoints, FastDeploy, paddleformers) or the
`-PT` one (transformers)."""


@dataclass
class ExportReport:
    """What `export_checkpoint` wrote. `params`: dtype -> {"count", "bytes"} of the graph written."""

    model: str
    out: str
    pipeline: str
    tensors: int
    params: dict[str, dict[str, int]]
    lora_adapter: str | None
    merged: int
    """How many adapted layers (linears or expert stacks) were merged."""
    layout: str = "paddle"
    checkpoint: str | None = None
    """A training artifact's checkpoint written (`training/checkpoints/run-K-step-N/...`), else None."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_checkpoint(model: str, out: str | os.PathLike[str], *, lora_adapter: str | Path | None = None,
                      pipeline: str | None = None, layout: str = "paddle", checkpoint: str | None = None,
                      force: bool = False, trust_pickle: bool = False,
                      progress: Callable[[str, int, int], None] | None = None) -> ExportReport:
    """Write `model` (its adapter `lora_adapter` merged, after `pipeline`; a full-parameter training
    artifact: its `checkpoint`, None the newest) to the folder `out` as a published float
    checkpoint in `layout` (see the module docstring). Every bad input raises an ErnieIRError
    subclass with one line, before any file is written. `progress(stage, done, total)` reports
    the tensors written."""
    layout = layout.strip().lower()
    if layout not in LAYOUTS:
        raise TargetError(f"--layout {layout!r}: unknown; choose paddle (the published -Paddle layout, the "
                          "default) or pt (the -PT layout transformers loads)")
    dest = check_export_out(out, force)
    trained = _training_artifact(model, checkpoint, lora_adapter)
    lora_text = pipeline_for(None, None, None, None, None, Path(lora_adapter), merge_lora=True) \
        if lora_adapter is not None else ""
    graph = (load_input(model, trust_pickle=trust_pickle) if trained is None
             else load_trained(model, checkpoint))
    if layout == "pt":
        check_pt_layout(graph, model)  # before any pass runs
    parts = [pipeline] if pipeline else []
    if lora_text:
        parts.append(lora_text)
    elif _has_lora(graph):
        parts.append("lora-merge")
    text = ",".join(parts)
    merged = 0
    if text:
        resolved = load_pipeline(text, initial=graph_properties(graph))
        split = next((p for p in resolved if p.fans_out), None)
        if split is not None:
            raise TargetError(f"--pipeline holds {split.spec()}: export writes the whole model (FastDeploy "
                              "and compile split it themselves); drop it")
        from ernie_ir.formats.paddleformers_adapter import read_adapter
        from ernie_ir.passes import run_pipeline
        from ernie_ir.runtime import Interpreter

        result = run_pipeline(graph, resolved, evaluator=Interpreter, adapter_reader=read_adapter)
        merged = sum(counts.get("merged", 0) for key, counts in result.stats.items()
                     if key.endswith(":lora-merge"))
        text = str(resolved)
    if _has_lora(graph):
        raise TargetError("the model still holds LoRA adapters after --pipeline (a pass after the merge "
                          "added them): the published checkpoint has no adapters")
    # both refuse quantized, QAT, FP8 and meta graphs before writing
    tensors = published_tensors(graph) if layout == "paddle" else pt_tensors(graph)
    config = source_config(model, graph)
    if "num_nextn_predict_layers" in config or "moe_num_experts" in config:
        config = {**config, "num_nextn_predict_layers": 0}  # the graph has no MTP head: none is written
    if layout == "pt":
        config = pt_config(config)
    source = source_info(model, graph)
    # the training artifact's copy of the tokenizer; else the folder's, or a built-in's generated one
    folder = (Path(model) / trained if trained else None) if trained is not None else tokenizer_folder(model)
    record: dict[str, Any] = {
        "format": EXPORT_FORMAT, "format_version": 1, "ernie_ir_version": _version(), "source": source,
        "layout": layout, "pipeline": text,
        "lora_adapter": adapter_provenance(lora_adapter, merged=True) if lora_adapter is not None else None,
    }

    def on_tensor(_name: str, done: int, total: int) -> None:
        if progress is not None:
            progress("weights", done, total)

    def fill(tmp: Path) -> None:
        record["files"] = write_checkpoint_files(tmp, config, tensors, folder, on_tensor)
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")

    with artifact_lock(dest, parents=True):  # one writer at a time, as for an artifact
        check_export_out(dest, force)  # again, under the lock: what is there now
        replace_folder(dest, fill)
    ckpt = (graph.metadata.get("trained") or {}).get("checkpoint") if trained is not None else None
    return ExportReport(model=model, out=str(dest), pipeline=text, tensors=len(tensors),
                        params=params_by_dtype(graph),
                        lora_adapter=(record["lora_adapter"] or {}).get("path"), merged=merged,
                        layout=layout, checkpoint=ckpt)


def _training_artifact(model: str, checkpoint: str | None, lora_adapter: str | Path | None) -> str | None:
    """None when MODEL is no artifact; for a full-parameter training artifact with a checkpoint, the
    folder (relative to it) holding its tokenizer ("" when it has none). TargetError, one line,
    for any other artifact, one never trained, and options that do not apply."""
    if not (Path(model) / "manifest.json").is_file():
        if checkpoint is not None:
            raise TargetError(f"--checkpoint picks a checkpoint of a training artifact, and {model} is not "
                              "one: drop --checkpoint")
        return None
    manifest = read_manifest(Path(model))
    if manifest.mode != "training":
        raise TargetError(f"{model} is a compiled artifact, not a model: export its source model "
                          f"{(manifest.source or {}).get('model', '')!s}".rstrip() + " instead")
    try:
        recipe = json.loads((Path(model) / "training" / "train.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        recipe = {}
    if _trains_lora(recipe):
        raise TargetError(f"{model} is a LoRA training artifact: export its source model "
                          f"{(manifest.source or {}).get('model', '')!s} with --lora-adapter naming the "
                          "adapter (a training run's checkpoint folder holds it in adapter/)")
    if isinstance(recipe, dict) and recipe.get("qat_state"):
        raise TargetError(f"{model} was trained with QAT: compile it (`ernie-ir compile {model} --target T` "
                          "converts it to int8 weights with its learned scales); export writes float "
                          "checkpoints")
    if lora_adapter is not None:
        raise TargetError(f"{model} is a full-parameter training artifact: it holds its trained weights; "
                          "--lora-adapter merges an adapter into a model: drop it")
    if not training_checkpoints(manifest):
        raise TargetError(f"{model} has no training checkpoint under {CHECKPOINTS}/ (it was never trained): "
                          f"run `ernie-ir train {model} --steps N` first, then export it")
    return manifest.tokenizer or ""


def _trains_lora(recipe: Any) -> bool:
    """Whether a training recipe (training/train.json) trains LoRA adapters."""
    trainable = [str(n) for n in recipe.get("trainable", [])] if isinstance(recipe, dict) else []
    return any(n.endswith((".lora_A", ".lora_B")) for n in trainable)


@dataclass(frozen=True)
class ErnieKitExportPlan:
    """`export_checkpoint`'s arguments for an ERNIEKit export config, and its notes: the config's
    (keys accepted without effect) and one per choice made where ERNIEKit's layout differs."""

    model: str
    lora_adapter: Path | None
    out: Path
    notes: tuple[str, ...] = ()


_ERNIEKIT_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def erniekit_export_plan(kit: ErnieKitExport,
                         out: str | os.PathLike[str] | None = None) -> ErnieKitExportPlan:
    """What `erniekit export` with `kit`'s keys exports, as `export_checkpoint`'s arguments:

    - output_dir an ernie-ir training artifact: a LoRA one's newest checkpoint (its `adapter/`)
      merged into model_name_or_path; a full-parameter one's newest trained weights;
    - output_dir ERNIEKit's own folder (LoRA only, as erniekit export): the adapter in it, else in
      its newest `checkpoint-N`, merged into model_name_or_path.

    The folder written is `out`, else ERNIEKit's `output_dir/export`; for an artifact (whose files
    its manifest hashes) `OUTPUT_DIR-export` beside it, and a note says so. TargetError /
    ErnieKitConfigError, one line, where the run and `lora` / `fine_tuning` disagree or nothing
    was trained."""
    root = kit.output_dir
    notes = list(kit.notes)
    if not root.is_dir():
        raise TargetError(f"output_dir {root} does not exist: give output_dir=DIR, the folder the run to "
                          "export was trained in (ernie-ir train CONFIG.yaml's output_dir)")
    said = "lora=True" if kit.lora else "lora=False (or fine_tuning: Full)"
    if (root / "manifest.json").is_file():
        manifest = read_manifest(root)
        if manifest.mode != "training":
            raise TargetError(f"output_dir {root} is a compiled inference artifact, not a training run: give "
                              "the output_dir ernie-ir train CONFIG.yaml trained in")
        try:
            recipe = json.loads((root / "training" / "train.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            recipe = {}
        lora = _trains_lora(recipe)
        if kit.lora is not None and kit.lora != lora:
            kind = "LoRA adapters" if lora else "every weight (fine_tuning: Full)"
            raise TargetError(f"output_dir {root} trained {kind}, and the config says {said}: give "
                              f"lora={lora} (or drop lora and fine_tuning)")
        runs = training_checkpoints(manifest)
        if not runs:
            raise TargetError(f"output_dir {root} has no training checkpoint (it was never trained): run "
                              "ernie-ir train CONFIG.yaml first, then export it")
        if out is None:
            out = root.parent / f"{root.name}-export"
            notes.append(f"the model is written to {out}, beside output_dir (ERNIEKit writes "
                         "output_dir/export, but output_dir is an artifact whose files its manifest "
                         "hashes); --out DIR chooses")
        if not lora:
            if kit.model_name is not None:
                notes.append("model_name_or_path: a full-parameter run holds its own weights: no effect")
            return ErnieKitExportPlan(str(root), None, Path(out), tuple(notes))
        adapter = root / Path(runs[-1].file).parent
        if adapter == root / CHECKPOINTS:
            raise TargetError(f"output_dir {root}: its newest checkpoint {runs[-1].name} has no adapter "
                              "folder: train it again with this ernie-ir")
        return ErnieKitExportPlan(str(model_path(kit.model_name)), adapter, Path(out), tuple(notes))
    if kit.lora is False:
        raise TargetError(f"output_dir {root} is no ernie-ir training artifact, and exporting a "
                          "full-parameter run from ERNIEKit's folder is not built (erniekit export merges "
                          "LoRA only): its weights are a checkpoint folder already; give lora=True for a "
                          "LoRA run")
    if (root / "lora_config.json").is_file():
        adapter = root
    else:
        steps = sorted((int(m[1]), p) for p in root.iterdir()
                       if p.is_dir() and (m := _ERNIEKIT_CHECKPOINT.match(p.name)))
        if not steps:
            raise TargetError(f"output_dir {root} holds neither a LoRA adapter (lora_config.json) nor a "
                              "checkpoint-N folder: give the output_dir the run was trained in")
        adapter = steps[-1][1]
    return ErnieKitExportPlan(str(model_path(kit.model_name)), adapter,
                              Path(out) if out is not None else root / "export", tuple(notes))


def check_export_out(out: str | os.PathLike[str], force: bool) -> Path:
    """The export destination, or TargetError (one line) when it may not be written: an existing
    path without `force`; with `force`, anything but an empty folder or one that
    `export_checkpoint` wrote (`ernie_ir_export.json`); the current folder or one above it; a
    folder inside an artifact."""
    dest = Path(out)
    real, cwd = dest.resolve(), Path.cwd().resolve()
    if real == cwd or real in cwd.parents or not dest.name or dest.name == "..":
        raise TargetError(f"--out {out} is the current folder or one above it: name a new folder for the "
                          "checkpoint, e.g. --out exported/model")
    for parent in real.parents:
        if (parent / "manifest.json").is_file():
            try:
                read_manifest(parent)
            except ErnieIRError:
                continue  # someone else's manifest.json
            raise TargetError(f"--out {out} is inside the artifact {parent} (it would add files to it and "
                              "break its hashes): choose a folder outside it")
    if not os.path.lexists(dest):
        return dest
    if not force:
        raise TargetError(f"{dest} already exists: pass --force to replace it")
    if dest.is_symlink() or not dest.is_dir():
        raise TargetError(f"{dest} is not a folder: --force replaces only a folder ernie-ir export wrote; "
                          "choose another --out")
    if any(dest.iterdir()) and not _is_export(dest):
        raise TargetError(f"{dest} holds files but no {EXPORT_RECORD}, so ernie-ir export did not write it: "
                          "--force replaces only such folders; choose another --out")
    return dest


def _is_export(folder: Path) -> bool:
    try:
        record = json.loads((folder / EXPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(record, dict) and record.get("format") == EXPORT_FORMAT


def _has_lora(graph: Graph) -> bool:
    return any(n.op in ("lora", "moe_experts_lora") for n in graph)


def _version() -> str:
    from ernie_ir import __version__

    return __version__
