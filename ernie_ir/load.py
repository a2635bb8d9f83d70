"""Resolving a MODEL argument (CLI, golden cases) into a Graph.

MODEL may be an IR text file (`*.ir`), an artifact folder (`manifest.json`:
its hashes are checked and its rank-0 graph loaded), a graph folder
(`graph.ir` + `weights.safetensors`), a checkpoint folder, or a built-in model
name such as `ernie-4.5-0.3b@tiny`; the last two are the frontends' business.

`load_trained` reads what a training artifact (`compile --mode training`, then `ernie-ir
train`) has learned: its global graph with a checkpoint's params, in inference form; `compile`
takes a training artifact as its MODEL through it (docs/quantization.md 9.1).

Layer (docs/architecture.md): above `frontends` and the artifact format, below
`targets` (`compile_model` takes a MODEL as the CLI does), so targets reach the
frontends through `load_input` only.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.ir import DType, ErnieIRError, Graph
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.storage import GRAPH_FILE, load_graph
from ernie_ir.ir.weights import WeightSource


def load_input(spec: str, *, trust_pickle: bool = False, meta: bool = False) -> Graph:
    """The graph MODEL names (see the module docstring); ErnieIRError with one line otherwise.

    `meta`: a checkpoint folder or built-in read as its full-size graph without weights."""
    path = Path(spec)
    if meta and (path.is_file() or (path / "manifest.json").is_file() or (path / GRAPH_FILE).is_file()):
        raise ErnieIRError(f"--meta reads a checkpoint folder's config.json or a built-in name; {spec} is "
                           "an IR file, an artifact or a graph folder: drop --meta")
    if path.is_file():
        if path.suffix != ".ir":
            raise ErnieIRError(f"{spec}: expected an IR text file (*.ir) or a model folder")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ErnieIRError(f"{spec}: not a text file (IR files are UTF-8 text)") from None
        return parse_graph(text, source=spec)
    if path.suffix == ".ir" and not path.exists():
        raise ErnieIRError(f"{spec}: no such IR file: check the path")
    if path.is_dir() and (path / "manifest.json").is_file():
        from ernie_ir.artifacts import load_artifact

        return load_artifact(path)  # verifies every hash first
    if path.is_dir() and (path / "rank0" / GRAPH_FILE).is_file():
        # an artifact's rank graphs without the manifest that lists and hashes them: never read
        # as a bare graph folder (its global graph has no weights: "a meta graph" misleads)
        raise ErnieIRError(f"{spec} is laid out as a compiled artifact (rank0/) but has no manifest.json, so "
                           "its files cannot be checked: remove the folder and compile it again (ernie-ir "
                           f"compile MODEL --target TARGET --out {spec})")
    if path.is_dir() and (path / GRAPH_FILE).is_file():
        return load_graph(path)
    from ernie_ir.frontends import load_model

    return load_model(spec, trust_pickle=trust_pickle, meta=meta)


GENERATION_CONFIG = "generation_config.json"


def read_tokenizer(folder: str | Path) -> object | None:
    """The tokenizer of `folder` (None: it has none); ErnieIRError for files that cannot be read."""
    from ernie_ir.frontends.tokenizer import load_tokenizer

    return load_tokenizer(folder)


def tokenizer_folder(spec: str | Path) -> Path | None:
    """Where the tokenizer files of MODEL `spec` are: the folder itself, a built-in `@tiny` /
    `@small` model's generated tokenizer (frontends.builtin_tokenizer), else None."""
    from ernie_ir.frontends.builtin_tokenizer import builtin_tokenizer_folder

    return Path(spec) if Path(spec).is_dir() else builtin_tokenizer_folder(spec)


def copy_tokenizer(spec: str, dest: Path, *, tokenizer_json: bool = False) -> list[str]:
    """Copy the tokenizer files (and generation_config.json) of checkpoint folder `spec` (or a
    built-in's, `tokenizer_folder`) into `dest`; the names copied or written, [] when `spec` has
    no tokenizer.

    `tokenizer_json`: the folder must also hold a tokenizer.json + tokenizer_config.json that
    onnxruntime-genai's tokenizer reads: written from the tokenizer where the checkpoint has
    none (a bare SentencePiece model). Bad tokenizer files: ErnieIRError naming the file."""
    from ernie_ir.frontends.tokenizer import load_tokenizer, tokenizer_files, write_hf_tokenizer_json

    src = tokenizer_folder(spec)
    if src is None:
        return []
    tokenizer = load_tokenizer(src)  # reads (and so checks) the files before any is copied
    if tokenizer is None:
        return []
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for f in [*tokenizer_files(src), src / GENERATION_CONFIG]:
        if f.is_file():
            shutil.copyfile(f, dest / f.name)
            names.append(f.name)
    if tokenizer_json and "tokenizer.json" not in names:
        names += [p.name for p in write_hf_tokenizer_json(tokenizer, dest) if p.name not in names]
    return names


# -- a trained training artifact -------------------------------------------------------------------

CHECKPOINTS = "training/checkpoints"
"""Where `ernie-ir train` writes the checkpoints of a training artifact (one per run)."""
GLOBAL_CHECKPOINT_FILES = ("params.safetensors", "merged.safetensors")
"""In a run folder `run-K-step-N/`, the file holding every trained param under its global name and
shape: `params.safetensors`, or `merged.safetensors` (the multi-rank merge of older artifacts)."""
CHECKPOINT_FORMAT = "ernie-ir-training-checkpoint"
LOWERED_LAYOUT_KEYS = ("cuda_layout", "device_layout")
"""Param annotations of weights a target re-laid out for its kernels (targets.legalize)."""
_RUN_NAME = re.compile(r"^run-(\d+)-step-(\d+)$")


@dataclass(frozen=True)
class TrainingCheckpoint:
    """One run's checkpoint of a training artifact."""

    name: str
    """`run-K-step-N`."""
    file: str
    """The safetensors file of global params, relative to the artifact (as its manifest lists it)."""
    run: int
    steps: int


def training_checkpoints(manifest: dict[str, Any]) -> list[TrainingCheckpoint]:
    """The checkpoints a training artifact's manifest lists, oldest run first: a single-rank run's
    `run-K-step-N.safetensors`, or a run folder's `params.safetensors` / `merged.safetensors`
    (rank files beside them hold slices and are skipped)."""
    found: dict[str, tuple[int, TrainingCheckpoint]] = {}
    prefix = CHECKPOINTS + "/"
    for rel in manifest.files:
        if not rel.startswith(prefix):
            continue
        parts = rel[len(prefix):].split("/")
        if len(parts) == 1 and parts[0].endswith(".safetensors"):
            name, rank = parts[0].removesuffix(".safetensors"), 0
        elif len(parts) == 2 and parts[1] in GLOBAL_CHECKPOINT_FILES:
            name, rank = parts[0], GLOBAL_CHECKPOINT_FILES.index(parts[1])
        else:
            continue
        m = _RUN_NAME.match(name)
        if m is None or (name in found and found[name][0] <= rank):
            continue
        found[name] = (rank, TrainingCheckpoint(name, rel, int(m[1]), int(m[2])))
    return sorted((c for _, c in found.values()), key=lambda c: (c.run, c.steps))


def resolve_checkpoint(root: Path, manifest: dict[str, Any], checkpoint: str | None) -> TrainingCheckpoint:
    """The checkpoint `checkpoint` names in the training artifact `root`: None or "latest" (the
    newest run), a run name (`run-002-step-30`), or a path (the file or its run folder) inside
    the artifact; ErnieIRError, one line, for anything else (a missing run, a file of another
    artifact, an artifact never trained)."""
    runs = training_checkpoints(manifest)
    listed = ", ".join(c.name for c in runs) or "none"
    text = "latest" if checkpoint is None else checkpoint.strip()
    if not runs:
        raise ErnieIRError(f"{root} has no training checkpoint (it was never trained): run `ernie-ir train "
                           f"{root} --steps N` first, then compile it")
    if text == "latest":
        return runs[-1]
    by_name = {c.name: c for c in runs}
    name = text.removesuffix(".safetensors")
    if name in by_name and "/" not in text:
        return by_name[name]
    here = Path(text)
    candidates = [here] if here.is_absolute() else [here, root / here]
    path = next((p for p in candidates if p.exists()), None)
    if path is None:
        raise ErnieIRError(f"--checkpoint {text}: no such checkpoint in {root} (its checkpoints: {listed}; "
                           "or latest)")
    inside = (root / CHECKPOINTS).resolve()
    real = path.resolve()
    if inside not in real.parents:
        raise ErnieIRError(f"--checkpoint {text} is not a checkpoint of {root} (a training artifact compiles "
                           f"with its own checkpoints: {listed})")
    rel = real.relative_to(root.resolve()).as_posix()
    for c in runs:
        if rel == c.file or c.file.startswith(rel + "/") or rel == f"{CHECKPOINTS}/{c.name}":
            return c
    raise ErnieIRError(f"--checkpoint {text} is not one of the checkpoints {root}'s manifest lists "
                       f"({listed})")


def is_training_artifact(spec: str | Path) -> bool:
    """Whether `spec` is an artifact folder compiled with --mode training (its manifest says so)."""
    from ernie_ir.artifacts import read_manifest

    path = Path(spec)
    return (path / "manifest.json").is_file() and read_manifest(path).mode == "training"


def load_trained(path: str | Path, checkpoint: str | None = None) -> Graph:
    """The model a training artifact has trained, as an inference graph: the artifact's global
    graph with the params of checkpoint `checkpoint` (see `resolve_checkpoint`; None: the newest
    run) applied by their global names, in its inference form (`inference_form`: QAT activation
    quantizers read their learned scale, no param trainable).

    Every file's sha256 is checked first. One rank: the rank graph. Several (--tp/--ep): the
    global `graph.ir` the artifact keeps, each param put together from the rank slices (their
    `shard` annotations), the trained ones from the checkpoint (global names and shapes).
    Checkpoint values are cast to their param's declared dtype (a bf16 model's float32 trained
    values round to bf16, as ERNIEKit exports the model). `graph.metadata["trained"]` records
    the checkpoint. ErnieIRError, one line, for an artifact that is not a trained training
    artifact, a checkpoint that is missing or not this artifact's, or weights its target
    re-laid out for its kernels."""
    from ernie_ir.artifacts import artifact_mapping, require_weights, verify_artifact

    root = Path(path)
    manifest = verify_artifact(root)
    if manifest.mode != "training":
        raise ErnieIRError(f"{root} is an inference artifact, not a training artifact: it has no "
                           "checkpoints; compile its source model instead")
    require_weights(root, manifest)
    ckpt = resolve_checkpoint(root, manifest, checkpoint)
    world = artifact_mapping(manifest).rank_graphs  # every pipeline stage's too
    ranks = [load_graph(root / f"rank{r}") for r in range(world)]
    for g in ranks:
        lowered = next((p for p in g.params.values() if any(k in p.annotations for k in LOWERED_LAYOUT_KEYS)),
                       None)
        if lowered is not None:
            raise ErnieIRError(f"{root}: {lowered.name} is laid out for {manifest.target}'s "
                               "weight-only kernels, which cannot be compiled again; compile a training "
                               "artifact whose base weights are float (no --quant wint* with --lora-rank)")
    graph = ranks[0] if world == 1 else _global_graph(root, ranks)
    _apply_checkpoint(graph, root, ckpt)
    inference_form(graph)
    graph.metadata["trained"] = {"checkpoint": ckpt.file, "steps": ckpt.steps,
                                 "checkpoint_sha256": manifest.files[ckpt.file]}
    if _trained_on_synthetic(root / ckpt.file):
        graph.metadata["trained"]["synthetic"] = True
    return graph


def _trained_on_synthetic(params_file: Path) -> bool:
    """Whether the checkpoint beside `params_file` was trained without --data, on the recipe's
    synthetic batch (its trainer_state.json's `data.synthetic`, ernie_ir.training.checkpoints)."""
    import json

    try:
        state = json.loads((params_file.parent / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    data = state.get("data") if isinstance(state, dict) else None
    return isinstance(data, dict) and data.get("synthetic") is True


def inference_form(graph: Graph) -> int:
    """Turn a training graph into its inference form in place: every QAT activation quantizer
    (`fake_quant_moving_average`) becomes `is_test` (it reads its stored scale, the moving
    average's last value, and updates nothing: `qat-insert{is_test=true}`), no param stays
    trainable, and the legalization's records (kernel plan, `lowered:<target>`) go, so the
    graph compiles for any target. Returns how many quantizers changed."""
    changed = 0
    for node in graph:
        if node.op == "fake_quant_moving_average" and not node.attrs.is_test:
            node.attrs = node.attrs.model_copy(update={"is_test": True})
            changed += 1
    for p in graph.params.values():
        p.trainable = False
    graph.metadata.pop("kernel_plan", None)
    props = graph.metadata.get("properties")
    if isinstance(props, list):
        graph.metadata["properties"] = [p for p in props if not str(p).startswith("lowered:")]
    return changed


def _global_graph(root: Path, ranks: list[Graph]) -> Graph:
    """The artifact's global graph (`graph.ir`, no weights) with each param's data put together
    from the rank graphs' slices."""
    from ernie_ir.ir.mapping import shard_of

    try:
        graph = parse_graph((root / GRAPH_FILE).read_text(encoding="utf-8"), source=str(root / GRAPH_FILE))
    except (OSError, UnicodeDecodeError) as e:
        raise ErnieIRError(f"{root / GRAPH_FILE}: cannot read it ({e}): the artifact is corrupt") from None
    for p in graph.params.values():
        held = [g.params[p.name] for g in ranks if p.name in g.params]
        pieces = [(q, shard_of(q.annotations)) for q in held]
        if not pieces or any(q.type.dtype != p.type.dtype or q.source is None for q in held):
            raise ErnieIRError(f"{root}: param {p.name} of graph.ir is not held by the rank graphs as the "
                               "same type: the artifact cannot be put back together; recompile it")
        whole = next((q for q, s in pieces if s is None), None)
        if whole is not None:
            if whole.type.shape != p.type.shape:
                raise ErnieIRError(f"{root}: rank param {p.name} is {whole.type}, graph.ir says {p.type}: "
                                   "the artifact is corrupt; recompile it")
            p.source = whole.source
        else:
            shape = tuple(int(d) for d in p.type.shape)  # a global param's shape is concrete
            p.source = _ShardedSource(p.name, p.type.dtype, shape,
                                      [(q.source, s) for q, s in pieces if q.source is not None and s])
        p.digest = None
    return graph


class _ShardedSource(WeightSource):
    """A global tensor put together, on read, from rank slices (`shard` annotations: the global
    shape and the ranges of each cut axis); where slices overlap (KV heads several ranks hold),
    the first rank's copy is kept."""

    def __init__(self, name: str, dtype: DType, shape: tuple[int, ...],
                 pieces: list[tuple[WeightSource, dict[str, Any]]]) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.pieces = pieces
        for _, shard in pieces:
            if tuple(int(d) for d in shard.get("global_shape", ())) != shape:
                raise ErnieIRError(f"param {name}: a rank slice's global shape {shard.get('global_shape')} "
                                   f"is not graph.ir's {list(shape)}: the artifact is corrupt; recompile it")

    def read(self) -> np.ndarray:
        out: np.ndarray | None = None
        filled = np.zeros(self.shape, bool)
        for src, shard in reversed(self.pieces):  # the first rank written last: its copy wins
            arr = np.asarray(src.read())
            if out is None:
                out = np.zeros(self.shape, arr.dtype)
            axes = [np.arange(d) for d in self.shape]
            for cut in shard.get("cuts", []):
                axes[int(cut["axis"]) % len(self.shape)] = np.concatenate(
                    [np.arange(int(a), int(b)) for a, b in cut["ranges"]])
            index = np.ix_(*axes)
            out[index] = arr
            filled[index] = True
        if out is None or not filled.all():
            raise ErnieIRError(f"param {self.name}: the rank slices do not cover its global shape "
                               f"{list(self.shape)}: the artifact is corrupt; recompile it")
        return out

    def describe(self) -> str:
        return f"ranks<{len(self.pieces)} slices>({self.name})"


def _apply_checkpoint(graph: Graph, root: Path, ckpt: TrainingCheckpoint) -> None:
    """Put the checkpoint's params (global names) into `graph`; the checkpoint must hold every
    param the artifact's recipe trains (and its QAT state), each of its param's shape."""
    from ernie_ir.ir.weights import CastSource, SafetensorsFile

    recipe = json.loads((root / "training" / "train.json").read_text(encoding="utf-8"))  # hash-checked
    wanted = set(recipe.get("trainable", [])) | set(recipe.get("qat_state", []))
    values = SafetensorsFile(root / ckpt.file)
    where = f"checkpoint {ckpt.name} of {root}"
    if values.metadata.get("format") != CHECKPOINT_FORMAT:
        raise ErnieIRError(f"{where}: {ckpt.file} is not an ernie-ir training checkpoint (its metadata has "
                           f"no format {CHECKPOINT_FORMAT!r})")
    keys = set(values.keys())
    missing, unknown = sorted(wanted - keys), sorted(keys - set(graph.params))
    if missing or unknown:
        what = f"lacks {missing[0]}" if missing else f"holds {unknown[0]}, which the graph has not"
        raise ErnieIRError(f"{where} does not fit the artifact's graph (it {what}, of {len(keys)} params): "
                           "it is not this artifact's checkpoint")
    for name in sorted(keys):
        p = graph.params[name]
        src: WeightSource = values.source(name)
        if tuple(src.shape) != p.type.shape or (src.dtype != p.type.dtype
                                                and not (src.dtype.is_float and p.type.dtype.is_float)):
            raise ErnieIRError(f"{where}: {name} is {src.dtype}{list(src.shape)} but the graph's param is "
                               f"{p.type}: it is not this artifact's checkpoint")
        p.source = src if src.dtype == p.type.dtype else CastSource(src, p.type.dtype)
        p.digest = None
