"""ERNIEKit's training configs as they are: `erniekit train CONFIG.yaml key=value ...` read once
into what ernie-ir compiles (`compile`: CompileOptions keywords) and trains (`options`: TrainOptions
keys, the data, the run's length), with every key of ERNIEKit's published SFT configs either
honoured or named, in one line with its reason, as accepted without effect on this machine.

`key=value` overrides read as erniekit's CLI reads them (OmegaConf's dotlist, merged over the
file): a value is a YAML scalar with OmegaConf's two changes to PyYAML's rules (`1e-5`, without a
dot, is a float; a date stays text), `key=` is null. omegaconf is not a dependency, so these rules
are written here (`parse_override`).

`train ART --config FILE` reads the same keys (`config_values`): the keys that choose what to
compile (`model_name_or_path`, `fine_tuning`, `compute_type`, the parallel degrees, `output_dir`)
are then the artifact's own, and say so.

`erniekit export CONFIG.yaml key=value ...` is read by the same rules (`erniekit_export`): the keys
of ERNIEKit's export parser (its training argument classes plus `ExportArguments`), of which
`output_dir` (the run to export), `model_name_or_path` (the base a LoRA run is merged into),
`lora` / `fine_tuning` and the export keys act; a training key has no effect on export and is
named as such in one note.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.suggest import did_you_mean
from ernie_ir.training.loop import OPTION_ALIASES, RUN_KEYS


class ErnieKitConfigError(ErnieIRError):
    """An ERNIEKit config ernie-ir cannot run as it is (one line: the key, the value, the fix)."""


NO_EFFECT: dict[str, str] = {
    **dict.fromkeys(("fuse_rope", "fuse_rms_norm", "fuse_linear", "fuse_swiglu", "fuse_softmax_mask",
                     "use_flash_attention"),
                    "a kernel fusion choice: the compiled graph computes the same values"),
    **dict.fromkeys(("amp_custom_white_list", "amp_custom_black_list", "fp16_opt_level", "amp_master_grad"),
                    "Paddle AMP's op lists and level: the artifact's dtypes are set by compile"),
    **dict.fromkeys(("unified_checkpoint", "unified_checkpoint_config", "disable_ckpt_quant",
                     "optim_shard_num"),
                    "PaddleFormers' checkpoint format: ernie-ir writes its own checkpoints (LoRA: a "
                    "paddleformers adapter folder)"),
    **dict.fromkeys(("recompute", "recompute_use_reentrant", "recompute_granularity", "release_grads"),
                    "trades memory for time: the values trained are the same"),
    **dict.fromkeys(("dataloader_num_workers", "distributed_dataloader"),
                    "the data is read in this process"),
    **dict.fromkeys(("logging_dir", "disable_tqdm", "logging_steps"),
                    "VisualDL logs and tqdm: ernie-ir prints a line every step (--progress draws a bar)"),
    **dict.fromkeys(("num_samples_each_epoch", "mix_strategy"),
                    "sampling from several datasets: one dataset is read, an epoch is one pass over it"),
    "pipeline_parallel_config": "Paddle's pipeline communication flags: the schedule is ernie-ir's (1F1B)",
    "pp_seg_method": "pipeline cut points: compile balances the layers over the stages itself",
    "moe_group": "the MoE communication group: experts follow the layout compile chose",
    "max_evaluate_steps": "evaluation reads the whole eval_dataset_path file",
    "apply_hadamard": "FP8 QAT's Hadamard rotation (compute_type fp8, not built)",
}
"""ERNIEKit keys accepted without effect on this machine -> why (one line each)."""

FIXED_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "stage": (("SFT", "sft"), "ernie-ir train runs supervised fine-tuning (ERNIEKit's stage SFT)"),
    "layerwise_lr_decay_bound": ((1, 1.0), "layer-wise learning-rate decay is not built (1.0 is none)"),
    "num_nextn_predict_layers": ((0,), "MTP layers are not trained (0 is none)"),
    "do_train": ((True,), "ernie-ir train trains: give do_train=True"),
    "packing": ((False, None), "the training graph's attention has no per-example mask, so packed examples "
                "would attend to each other: give packing=False"),
}
"""Keys whose only value without effect (or the only one ernie-ir runs) is fixed: any other is
refused with the reason."""

COMPILE_KEYS = ("model_name_or_path", "fine_tuning", "lora_rank", "lora_alpha", "compute_type",
                "tensor_parallel_degree", "pipeline_parallel_degree", "sharding_parallel_degree",
                "sequence_parallel", "offload_optim", "tensorwise_offload_optimizer",
                "use_lowprecision_moment", "output_dir", "overwrite_output_dir")
"""Keys that choose what `ernie-ir train CONFIG.yaml` compiles into output_dir (with `sharding`)."""

RUN_SHAPE_KEYS = ("max_steps", "num_train_epochs", "max_seq_len", "train_dataset_path", "train_dataset_type",
                  "train_dataset_prob", "eval_dataset_path", "eval_dataset_type", "eval_dataset_prob",
                  "do_eval", "evaluation_strategy", "save_strategy", "optim")
"""Keys of the run that are not TrainOptions fields: its length, data and schedules."""

DATASET_TYPES = ("erniekit", "alpaca")
COMPUTE_TYPES = {"bf16": None, "fp16": None, "wint8": "wint8", "wint4/8": "wint8mix-erniekit"}
"""ERNIEKit compute_type -> the --quant preset of the frozen base (None: float). wint4/8 is
ERNIEKit's weight_only_mix rules exactly (routed experts INT4, attention and dense MLP INT8)."""


def accepted_keys() -> list[str]:
    """Every key a training config may hold (ERNIEKit's and ernie-ir's names), sorted."""
    return sorted({*OPTION_ALIASES, *RUN_KEYS, *NO_EFFECT, *FIXED_VALUES, *COMPILE_KEYS, *RUN_SHAPE_KEYS})


def _refuse_unknown(values: Mapping[str, Any], source: str, known: Sequence[str] | None = None,
                    what: str = "training") -> None:
    known = list(known) if known is not None else accepted_keys()
    for key in values:
        if key not in known:
            raise ErnieKitConfigError(f"unknown {what} option {key!r}{did_you_mean(key, known)}; "
                                      f"known: {', '.join(known)}")


# -- key=value overrides, read as OmegaConf's dotlist --------------------------------------------

_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


def _override_loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        """PyYAML's safe rules, with exponent floats and without timestamps (OmegaConf's)."""

    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in rules if tag != "tag:yaml.org,2002:timestamp"]
        for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))
    return Loader


def parse_override(item: str) -> tuple[str, Any]:
    """One `key=value` of the command line as (key, value), typed as erniekit's CLI types it."""
    import yaml

    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ErnieKitConfigError(f"override {item!r}: write key=value (e.g. max_steps=100), as erniekit's "
                                  "command line takes them")
    if "." in key or "[" in key:
        raise ErnieKitConfigError(f"override {item!r}: {key!r} is a nested key, and ERNIEKit's training "
                                  "configs are flat: name a top-level key")
    try:
        value = yaml.load(text, Loader=_override_loader())  # a SafeLoader subclass: no Python tags
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ErnieKitConfigError(f"override {item!r}: not a YAML value: {first}") from None
    return key, value


def merged_config(values: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """The file's keys with the overrides given replacing theirs, in the order given."""
    merged = dict(values)
    for item in overrides:
        key, value = parse_override(item)
        merged[key] = value
    return merged


# -- what the keys mean ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ErnieKitRun:
    """An ERNIEKit config read as ernie-ir's: what to compile (`model` with `compile`, into
    `output_dir`) and how to train it (`options`, `data`, `steps` or `epochs`, ...), and `notes`
    (one line per key accepted without effect or adjusted as ERNIEKit adjusts it)."""

    compile: dict[str, Any] = field(default_factory=dict)
    """CompileOptions keywords (mode, lora_rank, lora_alpha, quant, tp, pp, sp, dp, sharding, ...)."""
    model: Path | None = None
    output_dir: Path | None = None
    overwrite: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    """TrainOptions keys (field names or ERNIEKit aliases)."""
    resume: str | bool | None = None
    steps: int | None = None
    epochs: float | None = None
    data: Path | None = None
    eval_data: Path | None = None
    max_seq_len: int | None = None
    notes: tuple[str, ...] = ()


def _int(values: Mapping[str, Any], key: str, default: int) -> int:
    value = values.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ErnieKitConfigError(f"{key}: an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ErnieKitConfigError(f"{key}: an integer, got {value!r}") from None


def _bool(values: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = values.get(key, default)
    if value is None:
        return default
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if not isinstance(value, bool | int):
        raise ErnieKitConfigError(f"{key}: true or false, got {value!r}")
    return bool(value)


def _dataset(values: Mapping[str, Any], kind: str) -> Path | None:
    """`{kind}_dataset_path` as one file: ERNIEKit's comma-separated list mixed by
    `{kind}_dataset_prob` is refused unless it is one path."""
    path = values.get(f"{kind}_dataset_path")
    if path is None or (isinstance(path, str) and not path.strip()):
        return None
    kinds = [t.strip() for t in str(values.get(f"{kind}_dataset_type") or "erniekit").split(",")]
    for t in kinds:
        if t not in DATASET_TYPES:
            raise ErnieKitConfigError(f"{kind}_dataset_type {t!r}: ernie-ir reads "
                                      f"{' and '.join(DATASET_TYPES)} JSON Lines (ERNIEKit SFT, alpaca)")
    paths = [p.strip() for p in str(path).split(",") if p.strip()]
    if len(paths) != 1 or len(kinds) != 1:
        raise ErnieKitConfigError(f"{kind}_dataset_path {path!r}: mixing several datasets by "
                                  f"{kind}_dataset_prob is not built: give one file")
    prob = values.get(f"{kind}_dataset_prob", 1.0)
    try:
        one = float(str(prob)) == 1.0
    except ValueError:
        one = False
    if not one:
        raise ErnieKitConfigError(f"{kind}_dataset_prob {prob!r}: one dataset is read whole: give 1.0")
    return Path(paths[0])


def _length(values: Mapping[str, Any]) -> tuple[int | None, float | None]:
    """(steps, epochs), ERNIEKit's rule: max_steps > 0 wins, else num_train_epochs (default 1)."""
    steps = _int(values, "max_steps", -1)
    if steps > 0:
        return steps, None
    epochs = values.get("num_train_epochs", 1.0)
    try:
        return None, float(epochs if epochs is not None else 1.0)
    except (TypeError, ValueError):
        raise ErnieKitConfigError(f"num_train_epochs: a number > 0, got {epochs!r}") from None


def _fixed(values: Mapping[str, Any]) -> list[str]:
    notes = []
    for key, (allowed, why) in FIXED_VALUES.items():
        if key not in values:
            continue
        value = values[key]
        if value not in allowed and not (isinstance(value, str) and value in map(str, allowed)):
            raise ErnieKitConfigError(f"{key}: {value!r} is not run here: {why}")
    optim = values.get("optim")
    if optim is not None and not str(optim).lower().startswith("adamw"):
        raise ErnieKitConfigError(f"optim {optim!r}: ernie-ir trains with AdamW: give optim=adamw (or drop "
                                  "it)")
    for key, why in NO_EFFECT.items():
        if key in values:
            notes.append(f"{key}: accepted without effect: {why}")
    return notes


def _schedules(values: Mapping[str, Any], options: dict[str, Any]) -> list[str]:
    """do_eval, evaluation_strategy and save_strategy onto the options (ERNIEKit's `steps` and
    `no`; `epoch` is refused)."""
    notes = []
    for key in ("evaluation_strategy", "save_strategy"):
        strategy = str(values.get(key, "steps")).lower()
        if strategy not in ("steps", "no"):
            every = "eval_steps" if key == "evaluation_strategy" else "save_steps"
            raise ErnieKitConfigError(f"{key} {strategy!r}: ernie-ir evaluates and saves every N steps: give "
                                      f"{key}=steps with {every}=N, or {key}=no")
        if strategy == "no":
            options.pop("eval_steps" if key == "evaluation_strategy" else "save_steps", None)
            if key == "save_strategy":
                notes.append("save_strategy: no: the run's last checkpoint is written all the same (what "
                             "compile and export read)")
    return notes


def _training(values: Mapping[str, Any], source: str) -> ErnieKitRun:
    """The training half of a config: options, data, length (the compile keys are left alone)."""
    options = {k: v for k, v in values.items() if k in OPTION_ALIASES}
    notes = [*_fixed(values), *_schedules(values, options)]
    strategy = str(values.get("evaluation_strategy", "steps")).lower()
    do_eval = _bool(values, "do_eval", True) and strategy != "no"
    steps, epochs = _length(values)
    max_seq_len = values.get("max_seq_len")
    if max_seq_len is not None:
        max_seq_len = _int(values, "max_seq_len", 0)
    resume = values.get("resume_from_checkpoint")
    eval_data = _dataset(values, "eval") if do_eval else None
    return ErnieKitRun(options=options, resume=resume, steps=steps, epochs=epochs,
                       data=_dataset(values, "train"), eval_data=eval_data, max_seq_len=max_seq_len,
                       notes=tuple(notes))


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _model(values: Mapping[str, Any]) -> Path:
    """model_name_or_path as a folder on this machine: a hub id is refused with the override to give."""
    return model_path(values.get("model_name_or_path"))


def model_path(name: Any) -> Path:
    """A config's model_name_or_path as a folder on this machine (ErnieKitConfigError, one line, for
    a hub id, a missing folder or none given)."""
    if name is None or not str(name).strip():
        raise ErnieKitConfigError("model_name_or_path: not given: add model_name_or_path=/path/to/folder "
                                  "(a checkpoint folder)")
    path = Path(str(name)).expanduser()
    if path.exists():
        return path
    if _HUB_ID.match(str(name)):
        raise ErnieKitConfigError(f"model_name_or_path {name!r} is a model hub id, and ernie-ir downloads "
                                  "nothing: download it, then add model_name_or_path=/path/to/folder")
    raise ErnieKitConfigError(f"model_name_or_path {str(name)!r} does not exist: give a checkpoint folder "
                              "(model_name_or_path=/path/to/folder)")


def _degree(values: Mapping[str, Any], key: str) -> int:
    """A parallel degree; ERNIEKit's -1 (the world's share) is 1 here, where one process is started
    per rank graph the artifact has."""
    degree = _int(values, key, 1)
    if degree == -1:
        return 1
    if degree < 1:
        raise ErnieKitConfigError(f"{key}: an integer >= 1 (or -1), got {degree}")
    return degree


def _quant(values: Mapping[str, Any]) -> str | None:
    compute = str(values.get("compute_type") or "bf16").strip().lower()
    if compute == "fp8":
        raise ErnieKitConfigError("compute_type fp8 trains with FP8 QAT (issue 37: FP8 fake-quant training), "
                                  "which is not built: give compute_type=bf16, or wint8 / wint4/8 with LoRA")
    if compute not in COMPUTE_TYPES:
        raise ErnieKitConfigError(f"compute_type {compute!r}{did_you_mean(compute, COMPUTE_TYPES)}: choose "
                                  f"{', '.join(COMPUTE_TYPES)} (or fp8, not built)")
    return COMPUTE_TYPES[compute]


def _layout(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """tp, pp, sp, dp and sharding from ERNIEKit's degrees, adjusted as ERNIEKit adjusts them."""
    tp, pp = _degree(values, "tensor_parallel_degree"), _degree(values, "pipeline_parallel_degree")
    dp = _degree(values, "sharding_parallel_degree")
    notes = []
    sp = _bool(values, "sequence_parallel")
    if sp and tp == 1:
        sp = False
        notes.append("sequence_parallel: tensor_parallel_degree is 1, so it is off (ERNIEKit sets it to "
                     "False the same way)")
    sharding = str(values.get("sharding") or "").strip() or None
    if sharding is not None and sharding.lower() == "none":
        sharding = None
    if sharding is not None and dp == 1:
        notes.append(f"sharding: {sharding} over sharding_parallel_degree 1 shards nothing (PaddleFormers "
                     "drops it the same way)")
        sharding = None
    return {"tp": tp, "pp": pp, "sp": sp, "dp": dp, "sharding": sharding}, notes


def _compile_keys(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """CompileOptions keywords (a training artifact) from the model and performance keys."""
    tuning = str(values.get("fine_tuning") or "LoRA").strip()
    if tuning.lower() not in ("lora", "full"):
        raise ErnieKitConfigError(f"fine_tuning {tuning!r}: choose LoRA or Full")
    flags: dict[str, Any] = {"mode": "training"}
    notes: list[str] = []
    quant = _quant(values)
    if quant is not None:
        flags["quant"] = quant
    if tuning.lower() == "lora":
        flags["lora_rank"] = _int(values, "lora_rank", 8)
        alpha = values.get("lora_alpha")
        if alpha is not None and alpha != -1:  # ERNIEKit's -1: 2 x rank, ernie-ir's default
            flags["lora_alpha"] = alpha
    elif "lora_rank" in values or "lora_alpha" in values:
        notes.append("lora_rank, lora_alpha: fine_tuning Full trains every weight, so they have no effect "
                     "(ERNIEKit ignores them too)")
    layout, more = _layout(values)
    flags.update(layout)
    if _bool(values, "offload_optim") or _bool(values, "tensorwise_offload_optimizer"):
        flags["offload_optimizer"] = True
    if _bool(values, "use_lowprecision_moment"):
        flags["moment_dtype"] = "bf16"
    return flags, [*notes, *more]


def erniekit_run(path: Path, overrides: Sequence[str] = ()) -> ErnieKitRun:
    """`erniekit train PATH key=value ...` read as ernie-ir's: the model to compile into
    output_dir and the run to train there. ErnieKitConfigError (one line) for an unknown key, a
    hub id, FP8 and every value ernie-ir does not run, before anything is written."""
    from ernie_ir.training.loop import read_config

    values = merged_config(read_config(path), overrides)
    _refuse_unknown(values, str(path))
    flags, notes = _compile_keys(values)  # fp8 and the model's keys first: what cannot run at all
    model = _model(values)
    out = values.get("output_dir")
    if out is None or not str(out).strip():
        raise ErnieKitConfigError("output_dir: not given: add output_dir=DIR (the artifact and its "
                                  "checkpoints go there)")
    run = _training(values, str(path))
    run.options.pop("sharding", None)  # the layout's, compiled into the recipe with its degree
    return ErnieKitRun(compile=flags, model=model, output_dir=Path(str(out)).expanduser(),
                       overwrite=_bool(values, "overwrite_output_dir"), options=run.options,
                       resume=run.resume,
                       steps=run.steps, epochs=run.epochs, data=run.data, eval_data=run.eval_data,
                       max_seq_len=run.max_seq_len, notes=(*notes, *run.notes))


def config_values(values: Mapping[str, Any], source: str) -> ErnieKitRun:
    """A `train ART --config` file's keys: the run's (options, data, length) as in the YAML form;
    the keys that choose what to compile are the artifact's own (one note names them). The run's
    length is given only where the file sets max_steps or num_train_epochs."""
    _refuse_unknown(values, source)
    run = _training(values, source)
    given = [k for k in COMPILE_KEYS if k in values]
    notes = list(run.notes)
    if "sharding" in values and "dp" not in values and _degree(values, "sharding_parallel_degree") == 1:
        run.options.pop("sharding", None)  # ERNIEKit's sharding over one replica: the artifact's dp rules
        notes.append("sharding: over sharding_parallel_degree 1 it shards nothing (PaddleFormers drops it "
                     "the same way); --dp N --sharding STAGE shard over replicas")
    if given:
        notes.append(f"{', '.join(given)}: the artifact's own (set when it was compiled): no effect here")
    has_length = "max_steps" in values or "num_train_epochs" in values
    return ErnieKitRun(options=run.options, resume=run.resume, steps=run.steps if has_length else None,
                       epochs=run.epochs if has_length else None, data=run.data, eval_data=run.eval_data,
                       max_seq_len=run.max_seq_len, notes=tuple(notes))


def training_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """The TrainOptions keys and resume_from_checkpoint of a config mapping (what a rank worker's
    --config needs), the other accepted keys left out; an unknown key is refused."""
    _refuse_unknown(values, "training config")
    return {k: v for k, v in values.items() if k in OPTION_ALIASES or k in RUN_KEYS}


# -- erniekit export ---------------------------------------------------------------------------------

EXPORT_KEYS = ("lora", "copy_tokenizer", "max_shard_size", "hf_hub_id", "mergekit_task_config")
"""Keys of ERNIEKit's ExportArguments, and ModelArguments' `lora`, that `erniekit export` reads."""

EXPORT_ACTING = ("model_name_or_path", "output_dir", "lora", "fine_tuning", "copy_tokenizer", "hf_hub_id",
                 "mergekit_task_config", "max_shard_size")
"""The keys of an export config that act on (or are checked for) the export; any other accepted
key is a training key and has no effect on it."""


@dataclass(frozen=True)
class ErnieKitExport:
    """`erniekit export CONFIG.yaml key=value ...` read as ernie-ir's: the run in `output_dir` to
    export, the base `model_name` a LoRA run is merged into, and `notes` (one line per key accepted
    without effect)."""

    output_dir: Path
    """What `ernie-ir train CONFIG.yaml` trained (an artifact), or ERNIEKit's output folder."""
    model_name: str | None
    """model_name_or_path as written (checked where a LoRA run needs it: `model_path`)."""
    lora: bool | None
    """`lora`, else `fine_tuning: LoRA|Full`; None: neither given, the trained run says."""
    notes: tuple[str, ...] = ()


def export_keys() -> list[str]:
    """Every key an export config may hold, sorted: ERNIEKit's export parser reads the training
    argument classes too, so a training config's keys are accepted (without effect)."""
    return sorted({*accepted_keys(), *EXPORT_KEYS})


def erniekit_export(path: Path, overrides: Sequence[str] = ()) -> ErnieKitExport:
    """`erniekit export PATH key=value ...` read as ernie-ir's (see ErnieKitExport).
    ErnieKitConfigError (one line) for an unknown key, an upload (`hf_hub_id`), a mergekit config
    and a missing output_dir, before anything is read or written."""
    from ernie_ir.training.loop import read_config

    values = merged_config(read_config(path), overrides)
    _refuse_unknown(values, str(path), export_keys(), "export")
    out = values.get("output_dir")
    if out is None or not str(out).strip():
        raise ErnieKitConfigError("output_dir: not given: add output_dir=DIR, the folder the run to export "
                                  "was trained in (ernie-ir train CONFIG.yaml's output_dir)")
    if values.get("hf_hub_id") not in (None, ""):
        raise ErnieKitConfigError(f"hf_hub_id {values['hf_hub_id']!r}: ernie-ir uploads nothing: give "
                                  "hf_hub_id=null and upload the exported folder yourself")
    if values.get("mergekit_task_config") not in (None, ""):
        raise ErnieKitConfigError("mergekit_task_config: merging several models (PaddleFormers' mergekit) is "
                                  "not built; export merges one LoRA adapter: give mergekit_task_config=null")
    lora: bool | None = None
    if values.get("lora") is not None:
        lora = _bool(values, "lora")
    elif values.get("fine_tuning") is not None:
        tuning = str(values["fine_tuning"]).strip()
        if tuning.lower() not in ("lora", "full"):
            raise ErnieKitConfigError(f"fine_tuning {tuning!r}: choose LoRA or Full")
        lora = tuning.lower() == "lora"
    notes = []
    if "max_shard_size" in values:
        notes.append("max_shard_size: accepted without effect: the weights are written as one "
                     "model.safetensors")
    if "copy_tokenizer" in values and not _bool(values, "copy_tokenizer", True):
        notes.append("copy_tokenizer: False: accepted without effect: the tokenizer files are always "
                     "written (FastDeploy, paddleformers and ernie-ir generate read them)")
    training = [k for k in values if k not in EXPORT_ACTING]
    if training:
        notes.append(f"{', '.join(training)}: training keys, accepted without effect on export (it writes "
                     "the trained weights whole, in the model's dtype)")
    name = values.get("model_name_or_path")
    return ErnieKitExport(output_dir=Path(str(out)).expanduser(),
                          model_name=None if name is None else str(name), lora=lora, notes=tuple(notes))
