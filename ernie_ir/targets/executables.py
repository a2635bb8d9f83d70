"""Which executables an artifact carries (`compile --emit`), and the writers that make them.

An artifact always holds its rank weights (`rank{r}/weights.safetensors`, the target's packed
layout) and the interpreter runs them. On top of that, each executable either reads those
bytes where they are or needs a layout of its own:

- `paddle`: no files for inference (`run --backend paddle` and the launch recipe build each
  rank's Layer from `rank{r}/` at load, with the device's kernels there); training: train.json.
- `fastdeploy` (cuda inference, ERNIE 4.5): `config.json` + `rank{r}/model.safetensors`, a link
  to the rank bytes.
- `onnx` (one rank, inference): `inference/onnx/model.onnx` + `.data`, in ONNX's own layout
  (MatMulNBits blocks; bf16/f16 weights as they are, widened in the graph): a KV-cache decoder
  (the `kv-cache` pass on a copy of the rank graph), with `genai_config.json` for
  onnxruntime-genai beside it (the tokenizer files belong there too).
- `paddle-inference` (one rank, inference): `inference/paddle/model.json` + `.pdiparams` +
  `decoder.json`, the traced KV-cache decoder (the `kv-cache` pass on a copy of the rank graph,
  the ONNX decoder's inputs and outputs) with a float32 copy of the weights (`paddle.jit.save`);
  its prefill gives the whole-sequence logits, so there is no second, logits-only program. The
  artifact offers the `paddle` backend beside it (the Layer from `rank{r}/`, as without it).

The defaults (`default_emit`, the target's `HardwareTarget.default_emit`) are the executables
that share the rank bytes: `paddle` everywhere, plus `fastdeploy` for a cuda inference artifact
of ERNIE 4.5. A target lists the executables its artifacts may carry
(`HardwareTarget.executables`; only cuda's include `fastdeploy`). `onnx` and `paddle-inference`
each add their own copy of the weights in their own layout (ONNX cannot read Paddle's
arch-permuted layout; `paddle.jit.save` writes its own params file). `paddle-inference` is
written when asked for; `onnx`, the fastest backend on a CPU (benchmarks/default_backend.py), is
also written without `--emit` for a one-rank inference artifact whose rank weights are at most
`ONNX_DEFAULT_MAX_BYTES` (2 GiB: the copy costs at most that much disk) and whose graph ONNX can
express (`with_default_onnx`); above the size, compile says how to add it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ernie_ir.ir import Graph
from ernie_ir.ir.mapping import Mapping
from ernie_ir.targets.capabilities import HardwareTarget
from ernie_ir.targets.registry import TargetError, all_targets, get_target

EXECUTABLES: dict[str, str] = {
    "paddle": "the Paddle Layer, built from rank{r}/ at load (device kernels on the device); "
              "training: train.json",
    "fastdeploy": "a FastDeploy pre-quantized, pre-sharded checkpoint over the rank bytes "
                  "(cuda inference, ERNIE 4.5)",
    "onnx": "inference/onnx/model.onnx for onnxruntime, a KV-cache decoder with genai_config.json (one "
            "rank, inference; its own weight layout)",
    "paddle-inference": "inference/paddle/model.json + .pdiparams for paddle.inference, a KV-cache "
                        "decoder (one rank, inference; a float32 copy of the weights)",
}
Emitter = Callable[[Graph, Path], Any]
_BACKENDS = {"onnx": "onnxruntime"}


def backend_of(name: str) -> str:
    """The manifest's backend (or format) name of an executable: onnx -> onnxruntime, ..."""
    return _BACKENDS.get(name, name)


def parse_emit(text: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """`--emit onnx,paddle` -> ("onnx", "paddle"); None stays None (the target's default)."""
    if text is None:
        return None
    items = text.split(",") if isinstance(text, str) else list(text)
    names = tuple(dict.fromkeys(i.strip().lower() for i in items if i.strip()))
    if not names:
        raise TargetError("--emit is empty: name one or more of " + ", ".join(EXECUTABLES))
    for n in names:
        if n not in EXECUTABLES:
            raise TargetError(f"unknown executable {n!r} in --emit: choose from {', '.join(EXECUTABLES)}")
    return names


ONNX_DEFAULT_MAX_BYTES = 2 << 30
"""Rank weights (bytes as stored) up to which an inference artifact carries ONNX without `--emit`."""


def with_default_onnx(emit: tuple[str, ...], ranks: Sequence[Graph], target: HardwareTarget, mode: str,
                      warnings: list[str]) -> tuple[str, ...]:
    """`emit` (the default executables) plus `onnx` where it applies: one rank graph, inference,
    a target that has it, every op lowerable to ONNX, rank weights within ONNX_DEFAULT_MAX_BYTES.
    Over the size, a warning gives the flag that adds it."""
    from ernie_ir.backends.onnx.lower import first_refusal, unsupported_ops

    if (mode != "inference" or len(ranks) != 1 or "onnx" in emit or "onnx" not in target.executables
            or unsupported_ops(ranks[0]) or first_refusal(ranks[0]) is not None):
        return emit
    size = sum(p.type.nbytes() for p in ranks[0].params.values() if p.type.is_static)
    if size > ONNX_DEFAULT_MAX_BYTES:
        warnings.append(f"no ONNX decoder by default: its copy of the weights would add "
                        f"{size / 2**30:.1f} GiB (over {ONNX_DEFAULT_MAX_BYTES / 2**30:g} GiB); add it "
                        f"with --emit {','.join((*emit, 'onnx'))} for --backend onnxruntime, the fastest")
        return emit
    return (*emit, "onnx")


def default_emit(target: str | HardwareTarget, mode: str) -> tuple[str, ...]:
    """The executables written when `--emit` is not given: the target's defaults for `mode`
    (`HardwareTarget.default_emit`: those that read the rank bytes)."""
    tgt = get_target(target) if isinstance(target, str) else target
    return tuple(tgt.default_emit.get(mode, ("paddle",)))


def _offered_by(name: str) -> str:
    """The targets whose artifacts may carry executable `name` ("cuda", "cuda/dcu")."""
    return "/".join(t.name for t in all_targets().values() if name in t.executables) or "no target"


def check_emit(emit: Sequence[str], target: str | HardwareTarget, mode: str, world: int) -> None:
    """Refuse, before any pass runs, executables this target, mode or layout cannot have."""
    tgt = get_target(target) if isinstance(target, str) else target
    for name in emit:
        if name in ("onnx", "paddle-inference") and mode != "inference":
            raise TargetError(f"--emit {name} is an inference executable; --mode {mode} writes "
                              "paddle (train.json): drop it from --emit")
        if name in ("onnx", "paddle-inference") and world > 1:
            why = "ONNX has no collectives" if name == "onnx" else "a Paddle Inference program is one rank"
            raise TargetError(f"--emit {name} needs one rank ({why}); this layout has "
                              f"{world}: drop --tp/--ep/--pp or {name}")
        if name == "paddle-inference":
            from ernie_ir.backends.paddle.emit import paddle_available

            if not paddle_available():
                raise TargetError("--emit paddle-inference needs PaddlePaddle to trace the program: "
                                  "install ernie-ir[paddle] (or paddlepaddle-gpu), or drop it from --emit")
        if name == "fastdeploy" and (name not in tgt.executables or mode != "inference"):
            raise TargetError(f"--emit fastdeploy is a {_offered_by(name)} inference checkpoint; not "
                              f"--target {tgt.name} --mode {mode}: drop it from --emit")
        if name not in tgt.executables:
            raise TargetError(f"--emit {name}: --target {tgt.name} has no {name} executable (it has "
                              f"{', '.join(tgt.executables)}): drop it from --emit")


@dataclass(frozen=True)
class EmitSettings:
    """What the compile options say about the executables: whether the user named them
    (`--emit`: one that cannot be made is an error; a default one that does not apply, e.g.
    fastdeploy for GPT, is left out with a warning where the model nearly qualified), the mode,
    the ONNX numerics and the element type of the ONNX decoder's KV cache (None: the
    attention's key dtype); training: AdamW's moment dtype (None: f32) and the optimizer offload
    the recipe records (ernie_ir.training.precision)."""

    explicit: bool
    mode: str
    onnx_numerics: str
    kv_cache_dtype: str | None = None
    moment_dtype: str | None = None
    offload_optimizer: bool = False
    implied: tuple[str, ...] = ()
    """Executables added by default (`with_default_onnx`): left out, quietly, where the graph
    cannot become one (e.g. no KV-cache decoder)."""


def select_emitters(emit: Sequence[str], settings: EmitSettings, *, target: HardwareTarget, model: str,
                    ranks: Sequence[Graph], mapping: Mapping, arch: int | None,
                    warnings: list[str]) -> dict[str, Emitter]:
    """backend/format name -> writer, for the executables in `emit` (see EXECUTABLES)."""
    from ernie_ir.backends.fastdeploy import NOT_A_CHECKPOINT, fastdeploy_emitters

    explicit, mode = settings.explicit, settings.mode
    onnx_numerics, kv_cache_dtype = settings.onnx_numerics, settings.kv_cache_dtype

    first = ranks[0]
    emitters: dict[str, Emitter] = {}
    if "onnx" in emit:
        implied = "onnx" in settings.implied  # not asked for: its notes (genai_config) are noise
        try:
            emitters[backend_of("onnx")] = _onnx_emitter(first, onnx_numerics, kv_cache_dtype,
                                                         [] if implied else warnings)
        except TargetError:
            if not implied:
                raise
    if "paddle" in emit or "paddle-inference" in emit:  # the Layer from rank0/ runs beside the program
        emitters["paddle"] = _paddle_emitter(target, mode, mapping, settings)
    if "paddle-inference" in emit:
        emitters[backend_of("paddle-inference")] = _paddle_inference_emitter(first, kv_cache_dtype)
    if "fastdeploy" in emit:
        # the target's part is decided here; the backend gets plain values
        found = (fastdeploy_emitters(mode, model, ranks, mapping, arch, warnings, explicit=explicit)
                 if "fastdeploy" in target.executables else {})
        if not found and explicit:
            why = next((w.removeprefix(NOT_A_CHECKPOINT) for w in reversed(warnings)
                        if w.startswith(NOT_A_CHECKPOINT)), None)
            raise TargetError(f"--emit fastdeploy: {why}" if why else
                              f"--emit fastdeploy: {model} is not an ERNIE 4.5 model, the only family "
                              "FastDeploy checkpoints are written for; drop fastdeploy from --emit")
        emitters.update(found)
    return emitters


def _onnx_emitter(graph: Graph, numerics: str, kv_cache_dtype: str | None = None,
                  warnings: list[str] | None = None) -> Emitter:
    """The ONNX decoder (`inference/onnx/model.onnx` + `.data` + `genai_config.json`): the
    `kv-cache` pass applied to a copy of the rank graph (the graph itself is what the other
    executables and the rank files are made from, and stays as it is). Checked here, before any
    file is written: an op without an ONNX lowering, a graph that cannot become a decoder, a bad
    cache dtype are one-line errors; token ids onnxruntime-genai must guess are a warning."""
    from ernie_ir.backends.onnx.lower import emit_onnx, first_refusal, unsupported_ops
    from ernie_ir.formats.genai_config import GenaiConfigError, missing_token_ids, write_genai_config

    missing = unsupported_ops(graph)
    if missing:
        raise TargetError(f"--emit onnx: {', '.join(missing)} {'has' if len(missing) == 1 else 'have'} "
                          "no ONNX lowering (e.g. fp8): drop onnx from --emit")
    refused = first_refusal(graph)  # an op that lowers, but not with these attrs
    if refused is not None:
        node, why = refused
        raise TargetError(f"--emit onnx: {node.op} at {node.scope or '<root>'} cannot be lowered: {why}; "
                          "or drop onnx from --emit")
    decoder_of, decoder, layout = _kv_decoder(graph, kv_cache_dtype, "onnx", "the ONNX model")
    unknown = missing_token_ids(decoder)
    if unknown and warnings is not None:
        warnings.append(f"onnx: the model's config.json has no {', '.join(unknown)}: genai_config.json "
                        "leaves them to onnxruntime-genai's defaults (pad 0); add them to config.json")

    def emit(g: Graph, exe: Path) -> list[Path]:
        dec = decoder_of(g)
        folder = exe / "onnx"
        files = emit_onnx(dec, folder, numerics=numerics)
        try:
            files += write_genai_config(dec, layout, folder)
        except GenaiConfigError as e:
            if warnings is not None:
                warnings.append(f"onnx: no genai_config.json for onnxruntime-genai: {e}")
        return files

    return emit


def _paddle_inference_emitter(graph: Graph, kv_cache_dtype: str | None) -> Emitter:
    """The Paddle Inference decoder (`inference/paddle/`): the `kv-cache` pass on a copy of the
    rank graph, made here so that a graph that cannot decode is refused before any file is
    written."""
    from ernie_ir.backends.paddle.decoder import emit_paddle_decoder

    decoder_of = _kv_decoder(graph, kv_cache_dtype, "paddle-inference", "the Paddle Inference model")[0]

    def emit(g: Graph, exe: Path) -> list[Path]:
        return emit_paddle_decoder(decoder_of(g), exe / "paddle")

    return emit


def _kv_decoder(graph: Graph, kv_cache_dtype: str | None, flag: str,
                what: str) -> tuple[Callable[[Graph], Graph], Graph, Any]:
    """(decoder_of, decoder, cache layout): the `kv-cache` pass applied to a copy of the rank
    graph now, so that a graph that cannot decode (or an unknown cache dtype) is refused before
    any file is written; `decoder_of(g)` is that decoder for the graph the emitter is handed
    (`graph` itself: the copy, its weights read where the rank files now hold them; another
    rank's graph: its own copy)."""
    from ernie_ir.ir.storage import clone_graph
    from ernie_ir.passes.decoding.kv_cache import KvCacheError, add_kv_cache

    decoder = clone_graph(graph)
    try:
        layout = add_kv_cache(decoder, kv_cache_dtype)
    except (KvCacheError, ValueError) as e:  # a graph that cannot decode, or an unknown dtype name
        raise TargetError(f"--emit {flag}: {what} is a KV-cache decoder, and {e}") from None

    def decoder_of(g: Graph) -> Graph:
        if g is graph:  # the weights may have moved (the rank files written meanwhile): read them there
            for name, p in decoder.params.items():
                p.source = g.params[name].source
            return decoder
        dec = clone_graph(g)
        add_kv_cache(dec, kv_cache_dtype)
        return dec

    return decoder_of, decoder, layout


def _paddle_emitter(target: HardwareTarget, mode: str, mapping: Mapping,
                    settings: EmitSettings | None = None) -> Emitter:
    """Training: the recipe (with its mixed precision). Inference: nothing to write; `run --backend
    paddle` and the launch recipe build each rank's Layer from `rank{r}/` (the bytes already in
    the artifact)."""
    if mode == "training":
        from ernie_ir.training.precision import precision_of
        from ernie_ir.training.recipe import emit_paddle_training

        layout = None if mapping.processes == 1 else mapping  # dp replicas of one rank: a layout too
        moments = None if settings is None else settings.moment_dtype
        offload = settings is not None and settings.offload_optimizer
        return lambda g, exe: emit_paddle_training(g, exe, target, layout,
                                                   precision_of(g, moments, offload))
    return lambda g, exe: None
