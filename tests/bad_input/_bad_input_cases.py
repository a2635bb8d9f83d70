# ruff: noqa: E501  (a table of cases: one case a line reads best)
"""The bad-input corpus: one `Case` per hostile input, across every command and file reader.

A case says how to build its input under a fresh folder (`setup(tmp, bases)`), the command
line (`{t}` is that folder), the exit code (2) and substrings the one error line must hold
(the file, the field). `test_bad_input_corpus.py` runs each one and checks the contract:
exactly one non-empty `error:` line on stderr, no traceback, nothing written.

Cases are generated combinatorially where the inputs are alike (each config field times
wrong type / NaN / Infinity / 10**30 / negative / missing / deep nesting) and listed by hand
elsewhere. `Bases` holds the valid inputs cases break (a checkpoint folder, artifacts).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DEEP = 100_000
"""Nesting depth of the deep-nesting inputs (far past Python's recursion limit)."""
HUGE = 10**30


@dataclass(frozen=True)
class Bases:
    """Valid inputs, built once per session, that cases copy and break."""

    ckpt: Path
    """config.json + model.safetensors of ernie-4.5-0.3b@tiny (Paddle layout)."""
    gpt_ckpt: Path
    """config.json + model.safetensors of gpt-345m@tiny."""
    graph: Path
    """A graph folder (graph.ir + weights.safetensors) of gpt-345m@tiny."""
    artifact: Path
    """gpt-345m@tiny compiled for cuda (inference)."""
    train_artifact: Path | None
    """gpt-345m@tiny compiled for cuda --mode training --lora-rank 4 (None without Paddle)."""
    adapter: Path
    """A valid paddleformers-style LoRA adapter folder for `ckpt`."""
    pp_artifact: Path | None = None
    """gpt-345m@tiny compiled for cuda with --pp 2 (two rank graphs, one per stage, tp 1)."""


Setup = Callable[[Path, Bases], None]


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    expect: tuple[str, ...] = ()
    setup: Setup | None = None
    code: int = 2
    subprocess: bool = False
    """Run `python -m ernie_ir` in a child (FIFOs: a reader that blocks must not hang the suite)."""
    needs: str = ""
    """`paddle` when the case needs Paddle installed."""
    writes: tuple[str, ...] = field(default=())
    """Paths (relative to tmp) the failed command must not have created (besides the snapshot)."""


CASES: list[Case] = []


def case(id: str, argv: list[str] | tuple[str, ...], *expect: str, setup: Setup | None = None,
         subprocess: bool = False, needs: str = "") -> None:
    argv = tuple(argv)
    writes = tuple(a.removeprefix("{t}/") for i, a in enumerate(argv)
                   if i and argv[i - 1] in ("--out", "--save-logits", "--plot", "--dump-dir"))
    CASES.append(Case(id, argv, tuple(expect), setup, subprocess=subprocess, needs=needs, writes=writes))


# -- builders ----------------------------------------------------------------------------------

def _json(value: Any) -> str:
    return json.dumps(value, allow_nan=True)


def deep_list(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


def config_text(base: dict[str, Any], key: str, value: Any, *, raw: str | None = None) -> str:
    """config.json text with `key` set to `value` (MISSING: removed; `raw`: literal JSON text)."""
    cfg = dict(base)
    if value is MISSING:
        cfg.pop(key, None)
        return _json(cfg)
    if raw is not None:
        cfg[key] = "@@RAW@@"
        return _json(cfg).replace('"@@RAW@@"', raw)
    cfg[key] = value
    return _json(cfg)


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def copy_ckpt(src: Path, dest: Path, config: str | bytes | None = None) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" or config is None:
            shutil.copy(f, dest / f.name)
    if config is not None:
        (dest / "config.json").write_bytes(config.encode() if isinstance(config, str) else config)


def with_config(text: str | bytes, base: str = "ckpt") -> Setup:
    def setup(tmp: Path, b: Bases) -> None:
        copy_ckpt(getattr(b, base), tmp / "m", text)
    return setup


def write_file(name: str, data: str | bytes) -> Setup:
    def setup(tmp: Path, b: Bases) -> None:
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
    return setup


def fifo(name: str, then: Setup | None = None) -> Setup:
    def setup(tmp: Path, b: Bases) -> None:
        if then is not None:
            then(tmp, b)
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():
            p.unlink()
        os.mkfifo(p)
    return setup


def both(*setups: Setup) -> Setup:
    def setup(tmp: Path, b: Bases) -> None:
        for s in setups:
            s(tmp, b)
    return setup


def safetensors_bytes(header: Any, data: bytes = b"", *, raw_header: bytes | None = None,
                      length: int | None = None) -> bytes:
    raw = raw_header if raw_header is not None else json.dumps(header, allow_nan=True).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def with_weights(blob: bytes, name: str = "model.safetensors") -> Setup:
    """The checkpoint with its safetensors file replaced by `blob`."""
    def setup(tmp: Path, b: Bases) -> None:
        copy_ckpt(b.ckpt, tmp / "m")
        (tmp / "m" / "model.safetensors").unlink()
        (tmp / "m" / name).write_bytes(blob)
    return setup


def edit_weights(edit: Callable[[dict[str, np.ndarray]], None], base: str = "ckpt") -> Setup:
    """The checkpoint with its tensors edited (read with our reader, written with ours)."""
    def setup(tmp: Path, b: Bases) -> None:
        from ernie_ir.ir.weights import SafetensorsFile, write_safetensors

        src = getattr(b, base)
        copy_ckpt(src, tmp / "m")
        st = SafetensorsFile(tmp / "m" / "model.safetensors")
        tensors = {k: np.array(st.read(k)) for k in st}
        del st
        edit(tensors)
        write_safetensors(tmp / "m" / "model.safetensors", list(tensors.items()))
    return setup


def poison(key_part: str, value: float = float("nan")) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(tensors: dict[str, np.ndarray]) -> None:
        key = next(k for k in tensors if key_part in k)
        arr = tensors[key].copy()
        arr.reshape(-1)[arr.size // 2] = value
        tensors[key] = arr
    return edit


def copy_tree(attr: str, dest: str = "a") -> Setup:
    def setup(tmp: Path, b: Bases) -> None:
        src = getattr(b, attr)
        assert src is not None
        shutil.copytree(src, tmp / dest)
    return setup


def edit_json(path: str, edit: Callable[[Any], Any]) -> Setup:
    def setup(tmp: Path, b: Bases) -> None:
        p = tmp / path
        p.write_text(_json(edit(json.loads(p.read_text()))))
    return setup


def adapter_with(files: dict[str, str | bytes | None]) -> Setup:
    """The valid adapter folder at tmp/ad with `files` replaced (None: removed)."""
    def setup(tmp: Path, b: Bases) -> None:
        shutil.copytree(b.adapter, tmp / "ad")
        for name, data in files.items():
            p = tmp / "ad" / name
            if data is None:
                p.unlink()
            else:
                p.write_bytes(data.encode() if isinstance(data, str) else data)
    return setup


def adapter_config(base: dict[str, Any], key: str, value: Any, raw: str | None = None) -> Setup:
    return adapter_with({"lora_config.json": config_text(base, key, value, raw=raw)})


# -- 1. config.json: every field x every kind of bad value ----------------------------------

ERNIE_CFG: dict[str, Any] = {
    "architectures": ["Ernie4_5_ForCausalLM"], "vocab_size": 1024, "hidden_size": 64,
    "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "use_bias": False, "hidden_act": "silu",
    "max_position_embeddings": 131072, "model_type": "ernie4_5", "torch_dtype": "bfloat16",
}

# field -> (required, kind); kind: int (positive), float (positive), bool
ERNIE_FIELDS = {
    "vocab_size": (True, "int"), "hidden_size": (True, "int"), "intermediate_size": (True, "int"),
    "num_hidden_layers": (True, "int"), "num_attention_heads": (True, "int"),
    "num_key_value_heads": (False, "int"), "head_dim": (False, "int"),
    "rms_norm_eps": (True, "float"), "rope_theta": (True, "float"),
    "max_position_embeddings": (False, "int"), "tie_word_embeddings": (False, "bool"),
    "use_bias": (False, "bool"),
}

BAD_VALUES: dict[str, tuple[Any, str | None]] = {
    "string": ("abc", None),
    "nan": (float("nan"), None),
    "inf": (float("inf"), None),
    "huge": (HUGE, None),
    "negative": (-1, None),
    "missing": (MISSING, None),
    "deep": (None, deep_list()),
    "object": ({"a": 1}, None),
}

# Which (kind, bad value) pairs a field refuses: a huge positive float is a legal rope_theta;
# a bool field takes no numbers at all.
_SKIP = {("float", "huge"): {"rope_theta"}}

COMMANDS: list[tuple[str, list[str]]] = [
    ("show-meta", ["show", "{t}/m", "--meta"]),
    ("show", ["show", "{t}/m"]),
    ("compile", ["compile", "{t}/m", "--target", "cuda", "--out", "{t}/out"]),
    ("plan", ["plan", "{t}/m", "--target", "cuda"]),
    ("run", ["run", "{t}/m", "--tokens", "1,2,3"]),
    ("explain", ["explain", "fuse-linear-bias", "{t}/m"]),
]


def _config_cases() -> None:
    n = 0
    for fld, (required, kind) in ERNIE_FIELDS.items():
        for bad, (value, raw) in BAD_VALUES.items():
            if bad == "missing" and not required:
                continue
            if fld in _SKIP.get((kind, bad), set()):
                continue
            name, argv = COMMANDS[n % len(COMMANDS)]
            n += 1
            text = config_text(ERNIE_CFG, fld, value, raw=raw)
            # JSON nested past the parser's depth fails before any field is known: the file is named
            case(f"config-{fld}-{bad}-{name}", argv, "config.json", *([fld] if bad != "deep" else []),
                 setup=with_config(text))


_config_cases()

MOE_CFG = {**ERNIE_CFG, "architectures": ["Ernie4_5_MoeForCausalLM"], "moe_num_experts": 4, "moe_k": 2,
           "moe_intermediate_size": 32, "moe_num_shared_experts": 1, "moe_layer_start_index": 1}
MOE_FIELDS = ["moe_num_experts", "moe_k", "moe_intermediate_size", "moe_num_shared_experts",
              "moe_layer_interval", "moe_layer_start_index"]
for i, fld in enumerate(MOE_FIELDS):
    for bad in ("string", "inf", "huge", "negative", "deep"):
        value, raw = BAD_VALUES[bad]
        case(f"moe-config-{fld}-{bad}", ["show", "{t}/m", "--meta"] if i % 2 else
             ["plan", "{t}/m", "--target", "cuda"], "config.json", *([fld] if bad != "deep" else []),
             setup=with_config(config_text(MOE_CFG, fld, value, raw=raw)))

GPT_CFG = {"architectures": ["GPTForCausalLM"], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 256, "max_position_embeddings": 128}
for fld in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings"):
    for bad in ("nan", "huge", "negative", "missing"):
        value, raw = BAD_VALUES[bad]
        case(f"gpt-config-{fld}-{bad}", ["show", "{t}/m", "--meta", "--summary"], "config.json", fld,
             setup=with_config(config_text(GPT_CFG, fld, value, raw=raw), base="gpt_ckpt"))

SE_CFG = {"architectures": ["Ernie35ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4}
for fld in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_norm_eps", "rope_theta",
            "max_position_embeddings"):
    for bad in ("inf", "huge", "string"):
        if fld == "rope_theta" and bad == "huge":
            continue
        value, raw = BAD_VALUES[bad]
        case(f"se-config-{fld}-{bad}", ["compile", "{t}/m", "--meta", "--target", "cuda", "--out", "{t}/out"],
             "config.json", fld, setup=with_config(config_text(SE_CFG, fld, value, raw=raw)))

# Cross-field sizes that cannot run (item 2): each alone is in range.
for name, edit, expect in [
    ("heads-not-multiple-kv", {"num_attention_heads": 8, "num_key_value_heads": 3}, "num_key_value_heads"),
    ("kv-more-than-heads", {"num_attention_heads": 2, "num_key_value_heads": 8}, "num_key_value_heads"),
    ("odd-head-dim", {"head_dim": 15}, "head_dim"),
    ("layers-over-cap", {"num_hidden_layers": 100_000}, "num_hidden_layers"),
    ("vocab-over-cap", {"vocab_size": 2**40}, "vocab_size"),
    ("hidden-over-cap", {"hidden_size": 2**40}, "hidden_size"),
    ("heads-over-cap", {"num_attention_heads": 2**20, "num_key_value_heads": 2**20}, "num_attention_heads"),
    ("positions-over-cap", {"max_position_embeddings": 2**50}, "max_position_embeddings"),
    ("eps-absurd", {"rms_norm_eps": 1e30}, "rms_norm_eps"),
    ("theta-zero", {"rope_theta": 0}, "rope_theta"),
    ("act-unknown", {"hidden_act": "relu6"}, "hidden_act"),
    ("act-wrong-type", {"hidden_act": 3}, "hidden_act"),
    ("rope-scaling", {"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
    ("rope-params-inf", {"rope_parameters": {"rope_theta": float("inf")}, "rope_theta": MISSING}, "rope_theta"),
    ("rope-params-not-dict-kind", {"rope_parameters": {"rope_type": "dynamic"}}, "rope_type"),
]:
    def _edit(cfg: dict[str, Any], e: dict[str, Any] = edit) -> str:
        c = dict(cfg)
        for k, v in e.items():
            if v is MISSING:
                c.pop(k, None)
            else:
                c[k] = v
        return _json(c)
    case(f"config-cross-{name}", ["show", "{t}/m", "--meta"], "config.json", expect,
         setup=with_config(_edit(ERNIE_CFG)))

for name, edit, expect in [
    ("moe-k-over-experts", {"moe_k": 8, "moe_num_experts": 4}, "moe_k"),
    ("moe-experts-over-cap", {"moe_num_experts": 2**30}, "moe_num_experts"),
    ("moe-gate-act", {"moe_gate_act": "sigmoid"}, "moe_gate_act"),
    ("moe-bias", {"use_bias": True}, "use_bias"),
    ("moe-norm-min-nan", {"moe_norm_min": float("nan")}, "moe_norm_min"),
]:
    case(f"config-cross-{name}", ["show", "{t}/m", "--meta"], "config.json", expect,
         setup=with_config(_json({**MOE_CFG, **edit})))

# -- 2. config.json as a file ------------------------------------------------------------------

for name, data, expect in [
    ("empty", b"", "config.json"),
    ("whitespace", b"  \n\t ", "config.json"),
    ("not-utf8", b"\xff\xfe\x00{", "config.json"),
    ("not-json", b"{architectures: x}", "config.json"),
    ("truncated", _json(ERNIE_CFG)[:40].encode(), "config.json"),
    ("array", b"[1, 2, 3]", "config.json"),
    ("null", b"null", "config.json"),
    ("string", b'"Ernie4_5_ForCausalLM"', "config.json"),
    ("number", b"42", "config.json"),
    ("deep-top", deep_list().encode(), "config.json"),
    ("deep-object", ('{"a":' * DEEP + "1" + "}" * DEEP).encode(), "config.json"),
    ("no-architectures", _json({k: v for k, v in ERNIE_CFG.items() if k != "architectures"}).encode(),
     "architectures"),
    ("architectures-int", config_text(ERNIE_CFG, "architectures", 5).encode(), "architectures"),
    ("architectures-nested", config_text(ERNIE_CFG, "architectures", [["x"]]).encode(), "architectures"),
    ("architectures-empty", config_text(ERNIE_CFG, "architectures", []).encode(), "architecture"),
    ("architectures-unknown", config_text(ERNIE_CFG, "architectures", ["LlamaForCausalLM"]).encode(),
     "LlamaForCausalLM"),
    ("architectures-deep", config_text(ERNIE_CFG, "architectures", None, raw=deep_list()).encode(),
     "too deeply"),
    ("huge-number-literal", config_text(ERNIE_CFG, "hidden_size", None, raw="1" * 5000).encode(),
     "config.json"),
    ("bom", b"\xef\xbb\xbf" + _json(ERNIE_CFG).encode(), "config.json"),
]:
    for cmd, argv in (("show", ["show", "{t}/m", "--meta"]),
                      ("compile", ["compile", "{t}/m", "--target", "ascend", "--out", "{t}/out"])):
        case(f"config-file-{name}-{cmd}", argv, *([expect] if expect else []), setup=with_config(data))

case("config-file-fifo", ["show", "{t}/m"], "config.json",
     setup=fifo("m/config.json", with_config(b"{}")), subprocess=True)
case("config-file-is-dir", ["show", "{t}/m"], "config.json",
     setup=both(with_config(b"{}"), lambda t, b: ((t / "m" / "config.json").unlink(),
                                                   (t / "m" / "config.json").mkdir())))

# -- 3. safetensors headers ----------------------------------------------------------------------

E = "ernie.embed_tokens.weight"
GOOD_ENTRY = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
for name, blob, expect in [
    ("empty", b"", "model.safetensors"),
    ("short", b"\x01\x02\x03", "model.safetensors"),
    ("length-zero", safetensors_bytes(None, raw_header=b""), "model.safetensors"),
    ("length-huge", safetensors_bytes(None, raw_header=b"{}", length=2**63), "model.safetensors"),
    ("length-past-file", safetensors_bytes(None, raw_header=b"{}", length=4096), "model.safetensors"),
    ("header-not-json", safetensors_bytes(None, raw_header=b"{not json"), "model.safetensors"),
    ("header-not-utf8", safetensors_bytes(None, raw_header=b"\xff\xff\xff\xff"), "model.safetensors"),
    ("header-array", safetensors_bytes([1, 2]), "model.safetensors"),
    ("header-null", safetensors_bytes(None), "model.safetensors"),
    ("header-deep", safetensors_bytes(None, raw_header=deep_list().encode()), "model.safetensors"),
    ("header-deep-object", safetensors_bytes(None, raw_header=('{"a":' * DEEP + "1" + "}" * DEEP).encode()),
     "model.safetensors"),
    ("entry-not-object", safetensors_bytes({E: 5}), E),
    ("entry-deep", safetensors_bytes(None, raw_header=(f'{{"{E}":' + deep_list() + "}").encode()), "too deeply"),
    ("dtype-int", safetensors_bytes({E: {**GOOD_ENTRY, "dtype": 3}}, b"\0" * 16), E),
    ("dtype-unknown", safetensors_bytes({E: {**GOOD_ENTRY, "dtype": "F128"}}, b"\0" * 16), "F128"),
    ("dtype-missing", safetensors_bytes({E: {"shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 16), E),
    ("shape-string", safetensors_bytes({E: {**GOOD_ENTRY, "shape": "2x2"}}, b"\0" * 16), E),
    ("shape-float", safetensors_bytes({E: {**GOOD_ENTRY, "shape": [2.0, 2]}}, b"\0" * 16), E),
    ("shape-bool", safetensors_bytes({E: {**GOOD_ENTRY, "shape": [True, 2]}}, b"\0" * 16), E),
    ("shape-negative", safetensors_bytes({E: {**GOOD_ENTRY, "shape": [-2, -2]}}, b"\0" * 16), E),
    ("shape-nan", safetensors_bytes({E: {**GOOD_ENTRY, "shape": [float("nan"), 2]}}, b"\0" * 16), E),
    ("shape-huge", safetensors_bytes({E: {**GOOD_ENTRY, "shape": [HUGE, HUGE]}}, b"\0" * 16), E),
    ("shape-nested", safetensors_bytes({E: {**GOOD_ENTRY, "shape": [[2], [2]]}}, b"\0" * 16), E),
    ("offsets-reversed", safetensors_bytes({E: {**GOOD_ENTRY, "data_offsets": [16, 0]}}, b"\0" * 16), E),
    ("offsets-negative", safetensors_bytes({E: {**GOOD_ENTRY, "data_offsets": [-16, 0]}}, b"\0" * 16), E),
    ("offsets-past-end", safetensors_bytes({E: {**GOOD_ENTRY, "data_offsets": [16, 32]}}, b"\0" * 16), E),
    ("offsets-huge", safetensors_bytes({E: {**GOOD_ENTRY, "data_offsets": [HUGE, HUGE + 16]}}, b"\0" * 16), E),
    ("offsets-three", safetensors_bytes({E: {**GOOD_ENTRY, "data_offsets": [0, 8, 16]}}, b"\0" * 16), E),
    ("offsets-strings", safetensors_bytes({E: {**GOOD_ENTRY, "data_offsets": ["0", "16"]}}, b"\0" * 16), E),
    ("offsets-float", safetensors_bytes({E: {**GOOD_ENTRY, "data_offsets": [0.0, 16.0]}}, b"\0" * 16), E),
    ("offsets-not-list", safetensors_bytes({E: {**GOOD_ENTRY, "data_offsets": 16}}, b"\0" * 16), E),
    ("offsets-overlap", safetensors_bytes({E: GOOD_ENTRY, "x.weight": {**GOOD_ENTRY, "data_offsets": [8, 24]}},
                                          b"\0" * 32), "overlap"),
    ("offsets-same", safetensors_bytes({E: GOOD_ENTRY, "x.weight": GOOD_ENTRY}, b"\0" * 16), "overlap"),
    ("size-mismatch", safetensors_bytes({E: {**GOOD_ENTRY, "data_offsets": [0, 12]}}, b"\0" * 16), E),
    ("metadata-list", safetensors_bytes({"__metadata__": [1], E: GOOD_ENTRY}, b"\0" * 16), "model.safetensors"),
    ("metadata-deep", safetensors_bytes(None, raw_header=('{"__metadata__":{"a":' + deep_list() + "}}").encode()),
     "model.safetensors"),
    ("int4-meta-bad", safetensors_bytes({"__metadata__": {"ernie_ir.int4": "{bad"}, E: GOOD_ENTRY}, b"\0" * 16),
     "ernie_ir.int4"),
    ("int4-meta-deep", safetensors_bytes({"__metadata__": {"ernie_ir.int4": deep_list()}, E: GOOD_ENTRY},
                                         b"\0" * 16), "ernie_ir.int4"),
    ("int4-shape-huge", safetensors_bytes({"__metadata__": {"ernie_ir.int4": _json({E: [HUGE]})},
                                           E: {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2),
     E),
    ("truncated-data", safetensors_bytes({E: {"dtype": "F32", "shape": [1024, 64], "data_offsets": [0, 262144]}},
                                         b"\0" * 100), "truncated"),
]:
    cmd = ["show", "{t}/m"] if len(CASES) % 3 else ["compile", "{t}/m", "--target", "kunlun", "--out", "{t}/out"]
    case(f"safetensors-{name}", cmd, expect, setup=with_weights(blob))

case("safetensors-fifo", ["show", "{t}/m"], "model.safetensors",
     setup=fifo("m/model.safetensors", with_weights(b"")))
case("safetensors-fifo-compile", ["compile", "{t}/m", "--target", "cuda", "--out", "{t}/out"],
     "model.safetensors", setup=fifo("m/model.safetensors", with_weights(b"")), subprocess=True)
case("safetensors-dev-null", ["show", "{t}/m"], "model.safetensors",
     setup=both(with_weights(b""), lambda t, b: ((t / "m" / "model.safetensors").unlink(),
                                                  (t / "m" / "model.safetensors").symlink_to("/dev/null"))))
case("safetensors-is-dir", ["show", "{t}/m"], "model.safetensors",
     setup=both(with_weights(b""), lambda t, b: ((t / "m" / "model.safetensors").unlink(),
                                                  (t / "m" / "model.safetensors").mkdir())))

# Sharded checkpoints: the index.
IDX = "model.safetensors.index.json"
for name, data in [("empty", b""), ("not-json", b"{"), ("array", b"[]"), ("no-map", b"{}"),
                   ("map-list", b'{"weight_map": []}'), ("map-deep", ('{"weight_map":' + deep_list() + "}").encode()),
                   ("map-values-int", b'{"weight_map": {"a": 1}}'), ("shard-missing", b'{"weight_map": {"a": "x.st"}}'),
                   ("shard-escape", b'{"weight_map": {"a": "../../etc/passwd"}}'),
                   ("map-values-nested", b'{"weight_map": {"a": [["x"]]}}')]:
    case(f"index-{name}", ["show", "{t}/m"], IDX,
         setup=both(with_weights(b"", "ignored.bin"), write_file(f"m/{IDX}", data)))
case("index-fifo", ["show", "{t}/m"], IDX, setup=fifo(f"m/{IDX}", with_weights(b"", "ignored.bin")))

# Tensors that do not match the config.
for name, edit, expect in [
    ("missing-layer", lambda ts: [ts.pop(k) for k in list(ts) if ".layers.1." in k], "num_hidden_layers"),
    ("missing-tensor", lambda ts: ts.pop("ernie.layers.1.mlp.down_proj.weight"), "layers.1.mlp.down_proj"),
    ("wrong-shape", lambda ts: ts.__setitem__(E, np.zeros((3, 3), np.float32)), E),
    ("extra-tensor", lambda ts: ts.__setitem__("ernie.layers.7.mystery.weight", np.zeros(2, np.float32)),
     "layers.7"),
    ("int-dtype", lambda ts: ts.__setitem__(E, np.zeros(ts[E].shape, np.int32)), E),
]:
    case(f"weights-{name}", ["show", "{t}/m"], expect, setup=edit_weights(edit))

# A config that claims many more layers than the checkpoint has: refused before building 4000 layers.
case("weights-config-claims-more-layers", ["show", "{t}/m"], "num_hidden_layers",
     setup=both(edit_weights(lambda ts: None),
                write_file("m/config.json", _json({**ERNIE_CFG, "num_hidden_layers": 4000}))))

# NaN/Inf weights (item 4): refused with or without --quant, naming the tensor.
for i, (part, value) in enumerate([("qkv_proj", float("nan")), ("o_proj", float("inf")),
                                   ("embed_tokens", float("-inf")), ("down_proj", float("nan")),
                                   ("input_layernorm", float("nan")), ("up_gate_proj", float("inf"))]):
    for quant in ([], ["--quant", "wint8"], ["--quant", "wint4"]):
        if quant and i % 2:
            continue
        case(f"weights-nonfinite-{part}-{quant[1] if quant else 'float'}",
             ["compile", "{t}/m", "--target", "cuda", *quant, "--out", "{t}/out"], part,
             setup=edit_weights(poison(part, value)))

# -- 4. pickle checkpoints -----------------------------------------------------------------------

for name, data, trust, expect in [
    ("untrusted", b"\x80\x04N.", False, "--trust-pickle"),
    ("garbage", b"not a pickle at all", True, "model_state.pdparams"),
    ("empty", b"", True, "model_state.pdparams"),
    ("os-system", b"cos\nsystem\n(S'echo pwned'\ntR.", True, "model_state.pdparams"),
    ("deep", b"\x80\x04" + b"]" * 50000 + b".", True, "model_state.pdparams"),
    ("not-dict", b"\x80\x04K\x05.", True, "model_state.pdparams"),
]:
    def _pd(tmp: Path, b: Bases, data: bytes = data) -> None:
        (tmp / "m").mkdir()
        (tmp / "m" / "config.json").write_text(_json(ERNIE_CFG))
        (tmp / "m" / "model_state.pdparams").write_bytes(data)
    case(f"pdparams-{name}", ["show", "{t}/m", *(["--trust-pickle"] if trust else [])], expect, setup=_pd)

# -- 5. .ir text and graph folders -----------------------------------------------------------------

IR_GOOD = """graph @g(%x: f32[2,4]) -> (y: f32[2,4]) {
  %0 = softmax(%x) {axis = -1} : f32[2,4]
  return %0
}
"""


def ir(body: str = "  %0 = softmax(%x) {axis = -1} : f32[2,4]", args: str = "%x: f32[2,4]",
       result: str = "y: f32[2,4]") -> str:
    return f"graph @g({args}) -> ({result}) {{\n{body}\n  return %0\n}}\n"


for name, text, expect in [
    ("empty", "", "g.ir"),
    ("whitespace", "   \n\n", "g.ir"),
    ("garbage", "hello world", "g.ir"),
    ("not-utf8", b"\xff\xfe\xfa", "g.ir"),
    ("deep-parens", "graph @g(" + "(" * DEEP + ")" * DEEP + ") -> () {}", "g.ir"),
    ("deep-brackets", "graph @g(%x: f32" + "[" * DEEP + ") -> () {}", "g.ir"),
    ("deep-attr", ir("  %0 = softmax(%x) {axis = " + deep_list() + "} : f32[2,4]"), "g.ir"),
    ("deep-meta", ir("  meta {a = " + deep_list() + "}\n  %0 = softmax(%x) {axis = -1} : f32[2,4]"), "g.ir"),
    ("huge-dim", ir(f"  %0 = softmax(%x) {{axis = -1}} : f32[{HUGE},4]", f"%x: f32[{HUGE},4]", f"y: f32[{HUGE},4]"),
     "g.ir"),
    ("huge-int-literal", ir(args="%x: f32[" + "9" * 5000 + "]"), "g.ir"),
    ("negative-dim", ir(args="%x: f32[-2,4]"), "g.ir"),
    ("unknown-dtype", ir(args="%x: q7[2,4]"), "q7"),
    ("unknown-op", ir("  %0 = frobnicate(%x) : f32[2,4]"), "frobnicate"),
    ("undefined-value", ir("  %0 = softmax(%z) {axis = -1} : f32[2,4]"), "%z"),
    ("truncated", IR_GOOD[:30], "g.ir"),
    ("attr-dtype-for-int", ir("  %0 = softmax(%x) {axis = f32} : f32[2,4]"), "axis"),
    ("attr-nan", ir("  %0 = softmax(%x) {axis = nan} : f32[2,4]"), "axis"),
    ("attr-huge", ir(f"  %0 = softmax(%x) {{axis = {HUGE}}} : f32[2,4]"), "axis"),
    ("attr-string-for-int", ir('  %0 = softmax(%x) {axis = "a"} : f32[2,4]'), "axis"),
    ("attr-list-for-int", ir("  %0 = softmax(%x) {axis = [1]} : f32[2,4]"), "axis"),
    ("attr-out-of-range", ir("  %0 = softmax(%x) {axis = 7} : f32[2,4]"), "axis"),
    ("attr-float-for-int", ir("  %0 = softmax(%x) {axis = 1.5} : f32[2,4]"), "axis"),
    ("attr-bool-for-int", ir("  %0 = softmax(%x) {axis = true} : f32[2,4]"), "axis"),
    ("attr-unknown", ir("  %0 = softmax(%x) {axis = -1, bogus = 1} : f32[2,4]"), "bogus"),
    ("wrong-result-type", ir("  %0 = softmax(%x) {axis = -1} : f32[3,4]"), "g.ir"),
    ("nul-bytes", "graph @g\x00(%x: f32[2]) -> () {}", "g.ir"),
    ("lone-surrogate-escape", ir('  meta {s = "\\ud800"}\n  %0 = softmax(%x) {axis = -1} : f32[2,4]'), "g.ir"),
    ("param-huge", ir(f"  param @w : f32[{HUGE},{HUGE}]\n  %0 = softmax(@w) {{axis = -1}} : f32[{HUGE},{HUGE}]",
                      "", f"y: f32[{HUGE},{HUGE}]"), "g.ir"),
    ("param-dtype-garbage", ir("  param @w : zz[2,4]\n  %0 = softmax(@w) {axis = -1} : f32[2,4]", ""), "zz"),
]:
    data = text if isinstance(text, bytes) else text.encode()
    for cmd, argv in (("show", ["show", "{t}/g.ir"]), ("run", ["run", "{t}/g.ir", "--tokens", "1,2"]),
                      ("compile", ["compile", "{t}/g.ir", "--target", "cuda", "--out", "{t}/out"])):
        if cmd != "show" and name not in ("empty", "garbage", "deep-parens", "huge-dim", "attr-dtype-for-int",
                                          "param-huge", "deep-attr"):
            continue
        case(f"ir-{name}-{cmd}", argv, expect, setup=write_file("g.ir", data))

case("ir-fifo", ["show", "{t}/g.ir"], "g.ir", setup=fifo("g.ir"))

# An attribute of the wrong type reaches no op's validator (issue 24: `group_size = bf16` went
# through pydantic's int check as the string "bf16" and ended in a TypeError from `v <= 0`), and
# a float attribute that is not finite (1e309 overflows to inf) is refused where it is parsed.
_WOL = "  param @w : i8[4,8]\n  param @s : f32[8]\n  %0 = weight_only_linear(%x, @w, @s) {{{}}} : f32[2,8]"
_RMS = "  param @w : f32[4]\n  %0 = rms_norm(%x, @w) {{eps = {}}} : f32[2,4]"
for name, text, expect in [
    ("wol-group-size-dtype", ir(_WOL.format("group_size = bf16"), result="y: f32[2,8]"), "group_size"),
    ("wol-group-size-int-dtype", ir(_WOL.format("group_size = i8"), result="y: f32[2,8]"), "group_size"),
    ("wol-group-size-bool", ir(_WOL.format("group_size = true"), result="y: f32[2,8]"), "group_size"),
    ("wol-group-size-list", ir(_WOL.format("group_size = [bf16]"), result="y: f32[2,8]"), "group_size"),
    ("split-sizes-dtype-item", ir("  %0, %1 = split(%x) {axis = -1, sizes = [2, bf16]} : f32[2,2], f32[2,2]"), "sizes"),
    ("fake-quant-round-type-bool", ir("  %0 = fake_quant(%x) {round_type = true} : f32[2,4]"), "round_type"),
    ("positions-limit-dtype", ir("  %0 = position_ids(%x) {limit = bf16} : i64[2,4]", "%x: i64[2,4]", "y: i64[2,4]"),
     "limit"),
    ("eps-overflows-to-inf", ir(_RMS.format("1e309")), "eps"),
    ("eps-inf", ir(_RMS.format("inf")), "eps"),
    ("rope-theta-inf", ir("  %0 = rope(%x) {theta = 1e400} : f32[2,4,1,2]", "%x: f32[2,4,1,2]", "y: f32[2,4,1,2]"),
     "theta"),
    ("attention-scale-nan", ir("  %0 = attention(%x, %x, %x) {scale = nan} : f32[1,2,1,4]", "%x: f32[1,2,1,4]",
                               "y: f32[1,2,1,4]"), "scale"),
    ("lora-scale-minus-inf", ir("  param @a : f32[4,2]\n  param @b : f32[2,4]\n  %0 = lora(%x, %x, @a, @b) "
                                "{scale = -inf} : f32[2,4]"), "scale"),
]:
    for cmd, argv in (("show", ["show", "{t}/g.ir"]), ("explain", ["explain", "fuse-linear-bias", "{t}/g.ir"])):
        case(f"ir-attr-{name}-{cmd}", argv, "g.ir", expect, setup=write_file("g.ir", text))


def _graph_folder(edit: Callable[[Path], None]) -> Setup:
    def setup(tmp: Path, b: Bases) -> None:
        shutil.copytree(b.graph, tmp / "gf")
        edit(tmp / "gf")
    return setup


for name, edit, expect in [
    ("graph-ir-empty", lambda d: (d / "graph.ir").write_text(""), "graph.ir"),
    ("graph-ir-not-utf8", lambda d: (d / "graph.ir").write_bytes(b"\xff\xff"), "graph.ir"),
    ("weights-empty", lambda d: (d / "weights.safetensors").write_bytes(b""), "weights.safetensors"),
    ("weights-garbage", lambda d: (d / "weights.safetensors").write_bytes(b"x" * 64), "weights.safetensors"),
    ("weights-deep", lambda d: (d / "weights.safetensors").write_bytes(
        safetensors_bytes(None, raw_header=deep_list().encode())), "weights.safetensors"),
    ("weights-fifo", lambda d: ((d / "weights.safetensors").unlink(), os.mkfifo(d / "weights.safetensors")),
     "weights.safetensors"),
    ("weights-extra", lambda d: (d / "weights.safetensors").write_bytes(
        safetensors_bytes({"stray": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)), "stray"),
]:
    case(f"graphdir-{name}", ["show", "{t}/gf"], expect, setup=_graph_folder(edit))

# -- 6. --pipeline text and YAML ---------------------------------------------------------------

GPT = "gpt-345m@tiny"
for name, text, expect in [
    ("unknown-pass", "frobnicate", "frobnicate"),
    ("empty-item", "canonicalize,,dce", "pipeline"),
    ("unbalanced", "canonicalize{", "pipeline"),
    ("deep-braces", "canonicalize" + "{" * DEEP, "pipeline"),
    ("deep-list-option", "split{tp=" + deep_list() + "}", "too deeply"),
    ("option-unknown", "dce{bogus=1}", "bogus"),
    ("option-huge", f"split{{tp={HUGE}}}", "tp"),
    ("option-nan", "split{tp=nan}", "tp"),
    ("option-inf", "split{tp=inf}", "tp"),
    ("option-negative", "split{tp=-2}", "tp"),
    ("option-string", "split{tp=abc}", "tp"),
    ("option-float", "split{tp=2.5}", "tp"),
    ("huge-literal", "split{tp=" + "9" * 5000 + "}", "tp"),
    ("weight-only-bits", "quant-annotate{preset=wint8},weight-only-quant{bits=3}", "bits"),
    ("lora-rank-zero", "lora{rank=0}", "rank"),
    ("lora-rank-huge", f"lora{{rank={HUGE}}}", "rank"),
    ("lora-rank-over-dims", "lora{rank=100000}", "rank"),
    ("lora-alpha-nan", "lora{rank=4,alpha=nan}", "alpha"),
    ("lora-alpha-inf", "lora{rank=4,alpha=inf}", "alpha"),
    ("fp8-calibration-tokens-huge", f"quant-annotate{{preset=fp8}},fp8-quant{{calibration_tokens={HUGE}}}", "calibration_tokens"),
    ("fp8-calibration-tokens-zero", "quant-annotate{preset=fp8},fp8-quant{calibration_tokens=0}", "calibration_tokens"),
    ("fp8-calibration-tokens-over-positions", "quant-annotate{preset=fp8},fp8-quant{calibration_tokens=100000000}", "calibration_tokens"),
    ("nul", "canonicalize\x00", "pipeline"),
]:
    for cmd, argv in (("show", ["show", GPT, "--pipeline", text]),
                      ("compile", ["compile", GPT, "--target", "cuda", "--pipeline", text, "--out", "{t}/out"])):
        if cmd == "compile" and not name.startswith(("unknown", "deep", "option-huge", "lora", "fp8")):
            continue
        case(f"pipeline-{name}-{cmd}", argv, expect)

for name, text, expect in [
    ("empty", "", "p.yaml"),
    ("not-yaml", "passes: [unclosed", "p.yaml"),
    ("scalar", "42", "p.yaml"),
    ("deep", deep_list(), "p.yaml"),
    ("deep-mapping", "a: " * 5000 + "1", "p.yaml"),
    ("unknown-pass", "passes:\n  - frobnicate\n", "frobnicate"),
    ("pass-int", "passes:\n  - 5\n", "p.yaml"),
    ("options-list", "passes:\n  - split: [1, 2]\n", "p.yaml"),
    ("option-nan", "passes:\n  - split: {tp: .nan}\n", "tp"),
    ("option-inf", "passes:\n  - split: {tp: .inf}\n", "tp"),
    ("option-huge", f"passes:\n  - split: {{tp: {HUGE}}}\n", "tp"),
    ("lora-alpha-nan", "passes:\n  - lora: {rank: 4, alpha: .nan}\n", "alpha"),
    ("binary-tag", "passes: !!binary aGVsbG8=\n", "p.yaml"),
    ("python-tag", "passes: !!python/object/apply:os.system ['echo pwned']\n", "p.yaml"),
    ("alias-bomb", "a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
     "passes: [*f]\n", "p.yaml"),
    ("not-utf8", b"\xff\xfe passes", "p.yaml"),
]:
    data = text if isinstance(text, bytes) else text.encode()
    case(f"pipeline-yaml-{name}", ["show", GPT, "--pipeline", "{t}/p.yaml"], expect,
         setup=write_file("p.yaml", data))
case("pipeline-yaml-missing", ["show", GPT, "--pipeline", "{t}/nope.yaml"], "nope.yaml")
case("pipeline-yaml-fifo", ["show", GPT, "--pipeline", "{t}/p.yaml"], "p.yaml", setup=fifo("p.yaml"))

# -- 7. --quant and --quant-config YAML -----------------------------------------------------------

for name, text, expect in [
    ("empty", "", "q.yaml"),
    ("scalar", "7", "q.yaml"),
    ("list", "- a\n- b\n", "q.yaml"),
    ("deep", deep_list(), "q.yaml"),
    ("not-yaml", "rules: [", "q.yaml"),
    ("rules-not-list", "rules: 5\n", "rules"),
    ("rule-unknown-algo", "rules:\n  - match: '.*'\n    algo: wint3\n", "algo"),
    ("rule-bad-regex", "rules:\n  - match: '(['\n    algo: weight_only_int8\n", "(["),
    ("rule-group-size-nan", "rules:\n  - match: '.*'\n    algo: weight_only_int4\n    group_size: .nan\n", "group_size"),
    ("rule-group-size-huge", f"rules:\n  - match: '.*'\n    algo: weight_only_int4\n    group_size: {HUGE}\n", "group_size"),
    ("rule-group-size-negative", "rules:\n  - match: '.*'\n    algo: weight_only_int4\n    group_size: -64\n", "group_size"),
    ("rule-deep", "rules:\n  - match: " + deep_list() + "\n", "q.yaml"),
    ("not-utf8", b"\xff\xfe", "q.yaml"),
    ("python-tag", "rules: !!python/name:os.system\n", "q.yaml"),
]:
    data = text if isinstance(text, bytes) else text.encode()
    cmd = (["show", GPT, "--quant-config", "{t}/q.yaml"] if len(CASES) % 2 else
           ["compile", GPT, "--target", "cuda", "--quant-config", "{t}/q.yaml", "--out", "{t}/out"])
    case(f"quant-config-{name}", cmd, expect, setup=write_file("q.yaml", data))
case("quant-config-missing", ["show", GPT, "--quant-config", "{t}/none.yaml"], "none.yaml")
case("quant-config-fifo", ["show", GPT, "--quant-config", "{t}/q.yaml"], "q.yaml", setup=fifo("q.yaml"))
for q in ("wint3", "int8!", "W" * 5000, "fp8,fp8"):
    case(f"quant-name-{q[:10] or 'empty'}", ["compile", GPT, "--target", "cuda", "--quant", q, "--out", "{t}/out"],
         q[:10])

# -- 8. --tokens and calibration files ---------------------------------------------------------------

for name, tokens, expect in [
    ("letters", "a,b,c", "--tokens"),
    ("empty", "", "--tokens"),
    ("commas", ",,,", "--tokens"),
    ("float", "1.5,2", "--tokens"),
    ("huge", str(HUGE), "--tokens"),
    ("negative", "-1,2", "token id"),
    ("out-of-vocab", "999999", "token id"),
    ("too-many", ",".join(["1"] * 2000), "positions"),
    ("far-too-many", ",".join(["1"] * 3_000_000), "positions"),
    ("nan", "nan", "--tokens"),
    ("inf", "inf", "--tokens"),
    ("long-literal", "9" * 5000, "--tokens"),
]:
    case(f"tokens-{name}", ["run", GPT, "--tokens", tokens], expect)


def _npy(name: str, array: Any) -> Setup:
    def setup(tmp: Path, b: Bases) -> None:
        np.save(tmp / name, array, allow_pickle=True)
    return setup


for name, setup, expect in [
    ("float", _npy("t.npy", np.ones((1, 3), np.float32)), "t.npy"),
    ("3d", _npy("t.npy", np.ones((1, 2, 3), np.int64)), "t.npy"),
    ("empty", _npy("t.npy", np.zeros((1, 0), np.int64)), "t.npy"),
    ("object", _npy("t.npy", np.array([{"a": 1}], dtype=object)), "t.npy"),
    ("garbage", write_file("t.npy", b"\x93NUMPY garbage"), "t.npy"),
    ("empty-file", write_file("t.npy", b""), "t.npy"),
    ("out-of-vocab", _npy("t.npy", np.full((1, 3), 10**9, np.int64)), "token id"),
    ("negative", _npy("t.npy", np.full((1, 3), -5, np.int64)), "token id"),
    ("too-long", _npy("t.npy", np.ones((1, 5000), np.int64)), "positions"),
    ("uint64-huge", _npy("t.npy", np.full((1, 2), 2**63 + 5, np.uint64)), "9223372036854775813"),
    ("huge-shape-header", write_file("t.npy", b"\x93NUMPY\x01\x00v\x00{'descr': '<i8', 'fortran_order': False, "
                                              b"'shape': (1000000000000, 1000000000000), }" + b" " * 40 + b"\n"),
     "t.npy"),
    ("missing", None, "t.npy"),
    ("is-dir", lambda t, b: (t / "t.npy").mkdir(), "t.npy"),
]:
    case(f"tokens-npy-{name}", ["run", GPT, "--tokens", "{t}/t.npy"], expect, setup=setup)
case("tokens-npy-fifo", ["run", GPT, "--tokens", "{t}/t.npy"], "t.npy", setup=fifo("t.npy"))

for name, setup, expect in [
    ("float", _npy("c.npy", np.ones((1, 3), np.float32)), "c.npy"),
    ("object", _npy("c.npy", np.array([{"a": 1}], dtype=object)), "c.npy"),
    ("garbage", write_file("c.npy", b"garbage"), "c.npy"),
    ("empty-file", write_file("c.npy", b""), "c.npy"),
    ("out-of-vocab", _npy("c.npy", np.full((1, 3), 10**9, np.int64)), "c.npy"),
    ("empty", _npy("c.npy", np.zeros((1, 0), np.int64)), "c.npy"),
    ("missing", None, "c.npy"),
    ("3d", _npy("c.npy", np.ones((1, 2, 3), np.int64)), "c.npy"),
]:
    case(f"calibration-{name}", ["compile", GPT, "--target", "cuda", "--pipeline",
                                 "quant-annotate{preset=fp8},fp8-quant{calibration_file='{t}/c.npy'}", "--out", "{t}/out"], expect,
         setup=setup)
case("calibration-fifo", ["show", GPT, "--pipeline", "quant-annotate{preset=fp8},fp8-quant{calibration_file='{t}/c.npy'}"], "c.npy",
     setup=fifo("c.npy"))

# -- 9. numeric flags and memory strings -------------------------------------------------------------

for flag, values in {
    "--tp": ["0", "-1", str(HUGE), "3", "abc"],
    "--ep": ["0", "-2", str(HUGE)],
    "--lora-rank": ["0", "-4", str(HUGE), "100000", "nan"],
    "--lora-alpha": ["nan", "inf", "-inf", "1e400"],
    "--cuda-arch": ["12", "-80", str(HUGE)],
}.items():
    for v in values:
        extra = ["--lora-rank", "4"] if flag == "--lora-alpha" else []
        case(f"flag-compile{flag}={v[:12]}", ["compile", GPT, "--target", "cuda", *extra, flag, v,
                                              "--out", "{t}/out"], flag.removeprefix("--").split("-")[-1])
for flag, values in {"--tp": ["0", str(HUGE)], "--rank": ["-1", "99", str(HUGE)], "--lora-rank": ["100000", str(HUGE)],
                     "--lora-alpha": ["nan"]}.items():
    for v in values:
        extra = ["--lora-rank", "4"] if flag == "--lora-alpha" else ["--tp", "2"] if flag == "--rank" else []
        case(f"flag-show{flag}={v[:12]}", ["show", GPT, *extra, flag, v], flag.removeprefix("--").split("-")[-1])

for flag, values in {
    "--seq-len": ["0", "-1", str(HUGE), "abc"],
    "--batch": ["0", "-3", str(HUGE)],
    "--tp": ["0", str(HUGE)],
    "--ep": ["-1", str(HUGE)],
    "--lora-rank": ["0", str(HUGE), "1000000"],
    "--device-memory": ["abc", "-1GiB", "0", "nanGiB", "infGiB", "1e400GiB", "", "80 XB", "9" * 5000],
    "--reserve": ["abc", "nan", "inf", "-5G", "1e400"],
    "--cuda-arch": ["0", str(HUGE)],
    "--moment-dtype": ["f128", ""],
    "--kv-cache-dtype": ["int3"],
    "--mode": ["serving"],
}.items():
    for v in values:
        extra = ["--mode", "training"] if flag == "--lora-rank" else []
        case(f"flag-plan{flag}={v[:12] or 'empty'}", ["plan", "ernie-4.5-0.3b", "--target", "cuda", *extra, flag, v],
             flag.removeprefix("--").split("-")[0])
case("flag-plan-target-unknown", ["plan", "ernie-4.5-0.3b", "--target", "tpu"], "tpu")
case("flag-plan-plot-not-svg", ["plan", "ernie-4.5-0.3b", "--target", "cuda", "--plot", "{t}/p.png"], "--plot")
case("flag-plan-plot-no-folder", ["plan", "ernie-4.5-0.3b", "--target", "cuda", "--plot", "{t}/x/p.svg"], "--plot")
case("flag-plan-seq-over-cap", ["plan", "gpt-345m", "--target", "cuda", "--seq-len", str(2**25)], "seq")

for flag, v in [("--timeout", "nan"), ("--timeout", "-1"), ("--timeout", "inf"), ("--emulate", "f8"),
                ("--backend", "tensorrt")]:
    case(f"flag-run{flag}={v}", ["run", GPT, "--tokens", "1,2", flag, v], flag.removeprefix("--"))
case("flag-run-save-logits-is-folder", ["run", GPT, "--tokens", "1,2", "--save-logits", "{t}/d"], "--save-logits",
     "folder", setup=write_file("d/keep", ""))  # np.save("d") would write d.npy beside it
case("flag-run-save-logits-no-folder", ["run", GPT, "--tokens", "1,2", "--save-logits", "{t}/x/l.npy"],
     "--save-logits")
case("flag-run-compare-to-unknown", ["run", GPT, "--tokens", "1,2", "--compare-to", "nope-model"], "nope-model")
case("flag-show-dump-dir-is-file", ["show", GPT, "--pipeline", "dce", "--dump-dir", "{t}/f"], "dump folder",
     setup=write_file("f", "x"))
case("flag-show-print-after-unknown", ["show", GPT, "--pipeline", "dce", "--print-after", "cse"], "cse")
case("flag-compile-target-unknown", ["compile", GPT, "--target", "tpu", "--out", "{t}/out"], "tpu")
case("flag-compile-mode-unknown", ["compile", GPT, "--target", "cuda", "--mode", "serve", "--out", "{t}/out"],
     "serve")
case("flag-compile-lora-targets-bad-regex", ["compile", GPT, "--target", "cuda", "--lora-rank", "4",
                                             "--lora-targets", "([", "--out", "{t}/out"], "([")
case("flag-compile-lora-targets-none", ["compile", GPT, "--target", "cuda", "--lora-rank", "4",
                                        "--lora-targets", "nothing_matches", "--out", "{t}/out"],
     "nothing_matches")
case("flag-compile-onnx-numerics", ["compile", GPT, "--target", "cuda", "--onnx-numerics", "wrong",
                                    "--out", "{t}/out"], "--onnx-numerics")

# -- 10. LoRA adapter folders ---------------------------------------------------------------------

LORA_CFG = {"r": 4, "lora_alpha": 8, "target_modules": [".*qkv_proj.*"], "rslora": False,
            "lora_dropout": 0.0, "scaling": 2.0}
AD = ["show", "{t}/m", "--lora-adapter", "{t}/ad"]


def _ckpt_and(setup: Setup) -> Setup:
    return both(lambda t, b: copy_ckpt(b.ckpt, t / "m"), setup)


for fld in ("r", "lora_alpha", "scaling", "target_modules"):
    for bad in ("string", "nan", "inf", "huge", "negative", "deep", "object"):
        if fld == "target_modules" and bad in ("nan", "inf", "huge", "negative", "string"):
            continue
        value, raw = BAD_VALUES[bad]
        case(f"adapter-config-{fld}-{bad}", AD, "lora_config.json", *([fld] if bad != "deep" else []),
             setup=_ckpt_and(adapter_config(LORA_CFG, fld, value, raw)))
for name, files, expect in [
    ("config-empty", {"lora_config.json": ""}, "lora_config.json"),
    ("config-array", {"lora_config.json": "[]"}, "lora_config.json"),
    ("config-deep", {"lora_config.json": deep_list()}, "lora_config.json"),
    ("config-not-utf8", {"lora_config.json": b"\xff\xfe"}, "lora_config.json"),
    ("config-missing", {"lora_config.json": None}, "lora_config.json"),
    ("weights-missing", {"adapter_model.safetensors": None}, "safetensors"),
    ("weights-garbage", {"adapter_model.safetensors": b"garbage!"}, "adapter_model.safetensors"),
    ("weights-deep", {"adapter_model.safetensors": safetensors_bytes(None, raw_header=deep_list().encode())},
     "adapter_model.safetensors"),
    ("weights-nan", {"adapter_model.safetensors": None, "nan.safetensors": "@nan"}, "lora"),
    ("base-config-deep", {"config.json": deep_list()}, "config.json"),
    ("base-config-not-json", {"config.json": "{"}, "config.json"),
]:
    def _setup(tmp: Path, b: Bases, files: dict[str, Any] = files) -> None:
        copy_ckpt(b.ckpt, tmp / "m")
        plain = {k: v for k, v in files.items() if v != "@nan"}
        adapter_with(plain)(tmp, b)
        if "@nan" in files.values():
            from ernie_ir.ir.weights import SafetensorsFile, write_safetensors

            st = SafetensorsFile(b.adapter / "adapter_model.safetensors")
            ts = {k: np.array(st.read(k)) for k in st}
            k0 = sorted(ts)[0]
            ts[k0].reshape(-1)[0] = np.nan
            write_safetensors(tmp / "ad" / "nan.safetensors", list(ts.items()))
    case(f"adapter-{name}", AD, expect, setup=_setup)
case("adapter-folder-missing", AD, "{t}/ad", setup=lambda t, b: copy_ckpt(b.ckpt, t / "m"))
case("adapter-config-fifo", AD, "lora_config.json",
     setup=_ckpt_and(both(adapter_with({}), fifo("ad/lora_config.json"))))

# -- 11. train: hyper-parameters, data, configs --------------------------------------------------------

TRAIN = ["train", "{t}/a", "--steps", "1"]
for flag, values in {
    "--lr": ["inf", "nan", "1e30", "-1e-3", "0", "-inf"],
    "--clip-norm": ["inf", "nan", "-1", "1e30"],
    "--weight-decay": ["nan", "inf", "-0.1", "5"],
    "--beta1": ["1", "nan", "-0.5"],
    "--beta2": ["inf", "1.5"],
    "--eps": ["inf", "0", "nan", "-1e-8"],
    "--batch-size": ["0", "-1", str(HUGE)],
    "--grad-accum": ["0", str(HUGE)],
    "--warmup-steps": ["-1", str(HUGE)],
    "--seed": ["-1", str(HUGE)],
    "--schedule": ["exponential", ""],
    "--pad-id": ["-5", str(HUGE), "999999"],
    "--ignore-index": [str(HUGE), "3", str(-HUGE)],
    "--steps": ["0", "-1", str(HUGE)],
}.items():
    for v in values:
        argv = ["train", "{t}/a", flag, v] if flag == "--steps" else [*TRAIN, flag, v]
        case(f"train-flag{flag}={v[:12] or 'empty'}", argv, flag.removeprefix("--").split("-")[0],
             setup=copy_tree("train_artifact"), needs="paddle")

for name, text, expect in [
    ("empty", "", "d.jsonl"),
    ("blank-lines", "\n\n  \n", "d.jsonl"),
    ("not-json", "hello\n", "d.jsonl:1"),
    ("not-utf8", b"\xff\xfe\n", "d.jsonl"),
    ("array-line", "[1, 2, 3]\n", "d.jsonl:1"),
    ("no-input-ids", '{"ids": [1, 2]}\n', "d.jsonl:1"),
    ("ids-string", '{"input_ids": "1 2 3"}\n', "input_ids"),
    ("ids-floats", '{"input_ids": [1.0, 2.0, 3.0]}\n', "input_ids"),
    ("ids-bools", '{"input_ids": [true, false, true]}\n', "input_ids"),
    ("ids-nan", '{"input_ids": [1, NaN, 3]}\n', "input_ids"),
    ("ids-inf", '{"input_ids": [1, Infinity]}\n', "input_ids"),
    ("ids-huge", f'{{"input_ids": [1, {HUGE}]}}\n', "input_ids"),
    ("ids-negative", '{"input_ids": [1, -2, 3]}\n', "input_ids"),
    ("ids-out-of-vocab", '{"input_ids": [1, 99999]}\n', "input_ids"),
    ("ids-one-token", '{"input_ids": [1]}\n', "input_ids"),
    ("ids-deep", '{"input_ids": ' + deep_list() + "}\n", "d.jsonl:1"),
    ("ids-nested", '{"input_ids": [[1, 2], [3, 4]]}\n', "input_ids"),
    ("ids-long-literal", '{"input_ids": [1, ' + "9" * 5000 + "]}\n", "d.jsonl:1"),
    ("line-too-long", _json({"input_ids": [1] * 5000}) + "\n", "d.jsonl:1"),
    ("labels-short", '{"input_ids": [1, 2, 3], "labels": [1, 2]}\n', "labels"),
    ("labels-nan", '{"input_ids": [1, 2, 3], "labels": [1, NaN, 3]}\n', "labels"),
    ("labels-bools", '{"input_ids": [1, 2, 3], "labels": [true, true, true]}\n', "labels"),
    ("labels-all-ignored", '{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}\n', "d.jsonl:1"),
    ("second-line-bad", '{"input_ids": [1, 2]}\n{"input_ids": "x"}\n', "d.jsonl:2"),
    ("deep-object-line", '{"a":' * DEEP + "1" + "}" * DEEP + "\n", "d.jsonl:1"),
]:
    data = text if isinstance(text, bytes) else text.encode()
    case(f"train-data-{name}", [*TRAIN, "--data", "{t}/d.jsonl"], expect,
         setup=both(copy_tree("train_artifact"), write_file("d.jsonl", data)), needs="paddle")
case("train-data-missing", [*TRAIN, "--data", "{t}/none.jsonl"], "none.jsonl",
     setup=copy_tree("train_artifact"), needs="paddle")
case("train-data-is-dir", [*TRAIN, "--data", "{t}/dd"], "dd",
     setup=both(copy_tree("train_artifact"), lambda t, b: (t / "dd").mkdir()), needs="paddle")
case("train-data-fifo", [*TRAIN, "--data", "{t}/d.jsonl"], "d.jsonl",
     setup=both(copy_tree("train_artifact"), fifo("d.jsonl")), needs="paddle")
case("train-data-dev-zero", [*TRAIN, "--data", "/dev/zero"], "/dev/zero",
     setup=copy_tree("train_artifact"), subprocess=True, needs="paddle")

for name, fname, text, expect in [
    ("yaml-not-mapping", "c.yaml", "- 1\n", "c.yaml"),
    ("yaml-deep", "c.yaml", deep_list(), "c.yaml"),
    ("yaml-lr-nan", "c.yaml", "learning_rate: .nan\n", "lr"),
    ("yaml-lr-inf", "c.yaml", "learning_rate: .inf\n", "lr"),
    ("yaml-lr-string", "c.yaml", "learning_rate: fast\n", "lr"),
    ("yaml-batch-huge", "c.yaml", f"per_device_train_batch_size: {HUGE}\n", "batch"),
    ("yaml-unknown-key", "c.yaml", "output_dirr: /tmp/x\n", "output_dirr"),
    ("yaml-lr-list", "c.yaml", "learning_rate: [1, 2]\n", "lr"),
    ("yaml-python-tag", "c.yaml", "learning_rate: !!python/name:os.system\n", "c.yaml"),
    ("json-deep", "c.json", deep_list(), "c.json"),
    ("json-nan", "c.json", '{"learning_rate": NaN}', "lr"),
    ("json-huge-int-literal", "c.json", '{"seed": ' + "9" * 5000 + "}", "c.json"),
    ("not-utf8", "c.yaml", b"\xff\xfe", "c.yaml"),
]:
    data = text if isinstance(text, bytes) else text.encode()
    case(f"train-config-{name}", [*TRAIN, "--config", f"{{t}}/{fname}"], expect,
         setup=both(copy_tree("train_artifact"), write_file(fname, data)), needs="paddle")
case("train-config-fifo", [*TRAIN, "--config", "{t}/c.yaml"], "c.yaml",
     setup=both(copy_tree("train_artifact"), fifo("c.yaml")), needs="paddle")
case("train-not-training-artifact", ["train", "{t}/a", "--steps", "1"], "training", setup=copy_tree("artifact"))
case("train-missing-artifact", ["train", "{t}/nope", "--steps", "1"], "nope")
case("train-recipe-deep", TRAIN, "train.json", needs="paddle",
     setup=both(copy_tree("train_artifact"), write_file("a/training/train.json", deep_list())))

# -- 12. verify, run on artifacts, golden, passes, explain ------------------------------------------

def _manifest_with(art: Path, **fields: Any) -> None:
    """Edit fields of the artifact's manifest.json (the one file its hashes do not cover)."""
    p = art / "manifest.json"
    p.write_text(_json({**json.loads(p.read_text()), **fields}))


for name, edit, expect in [
    ("manifest-empty", lambda d: (d / "manifest.json").write_text(""), "manifest.json"),
    ("manifest-deep", lambda d: (d / "manifest.json").write_text(deep_list()), "manifest.json"),
    ("manifest-array", lambda d: (d / "manifest.json").write_text("[]"), "manifest.json"),
    ("manifest-files-list", lambda d: (d / "manifest.json").write_text(
        _json({**json.loads((d / "manifest.json").read_text()), "files": []})), "files"),
    ("file-modified", lambda d: (d / "rank0" / "graph.ir").write_text("// tampered\n"), "graph.ir"),
    ("file-missing", lambda d: (d / "rank0" / "graph.ir").unlink(), "graph.ir"),
    # the manifest is the one file no hash covers: a field that contradicts graph.ir or the
    # executables folder (which the hashes do cover) is tampering (issue 24)
    ("manifest-target-edited", lambda d: _manifest_with(d, target="kunlun"), "target"),
    ("manifest-mode-edited", lambda d: _manifest_with(d, mode="training"), "mode"),
    ("manifest-cuda-arch-edited", lambda d: _manifest_with(d, cuda_arch=90), "cuda_arch"),
]:
    def _art(tmp: Path, b: Bases, edit: Callable[[Path], Any] = edit) -> None:
        shutil.copytree(b.artifact, tmp / "a")
        edit(tmp / "a")
    case(f"verify-{name}", ["verify", "{t}/a"], expect, setup=_art)
    case(f"run-artifact-{name}", ["run", "{t}/a", "--tokens", "1,2"], expect, setup=_art)
case("verify-missing", ["verify", "{t}/nope"], "nope")


def _rehashed(name: str, old: str, new: str) -> Setup:
    """The artifact with the first `old` in its file `name` replaced by `new` and the manifest's
    sha256 of it updated, so the artifact still verifies: what the IR says is checked on load."""
    def setup(tmp: Path, b: Bases) -> None:
        import hashlib

        shutil.copytree(b.artifact, tmp / "a")
        f = tmp / "a" / name
        text = f.read_text()
        assert old in text, (name, old)
        f.write_text(text.replace(old, new, 1))
        m = json.loads((tmp / "a" / "manifest.json").read_text())
        m["files"][name] = hashlib.sha256(f.read_bytes()).hexdigest()
        (tmp / "a" / "manifest.json").write_text(json.dumps(m))
    return setup


# IR from disk is checked like IR from the command line (issue 41): the first "eps = 1e-05" of a
# printed graph is its meta config's layer_norm_eps; "{eps = 1e-05}" a layer_norm node's attribute
for where in ("rank0/graph.ir", "graph.ir"):
    tag = where.split("/")[0].replace(".ir", "")
    for name, old, new, expect in [
        ("meta-eps-1e309", "eps = 1e-05", "eps = 1e309", ("graph.ir", "meta config.layer_norm_eps", "finite")),
        ("node-eps-1e309", "{eps = 1e-05}", "{eps = 1e309}", ("graph.ir", "node %", "attribute eps", "finite")),
    ]:
        case(f"run-artifact-{tag}-{name}-rehashed", ["run", "{t}/a", "--tokens", "1,2"], *expect,
             setup=_rehashed(where, old, new))
        case(f"verify-{tag}-{name}-rehashed", ["verify", "{t}/a"], *expect, setup=_rehashed(where, old, new))

# what needs no work is refused before any pass runs or warns (wint8mix on a dense model warns)
case("run-tokens-out-of-range-before-pipeline-warnings",
     ["run", "ernie-4.5-0.3b@tiny", "--quant", "wint8mix", "--tokens", "5000"], "5000", "vocabulary [0, 1024)")
case("run-tokens-negative-before-pipeline-warnings",
     ["run", "ernie-4.5-0.3b@tiny", "--quant", "wint8mix", "--tokens", "3,-1"], "-1", "vocabulary")
case("run-compare-to-missing-before-pipeline-warnings",
     ["run", "ernie-4.5-0.3b@tiny", "--quant", "wint8mix", "--tokens", "1,2", "--compare-to", "nothing"],
     "nothing")

# a pipelined artifact: its rank-0 graph is stage 0 (hidden states out), never the whole model
for flags in (["--emulate", "bf16"], ["--quant", "wint8"], ["--backend", "interpreter", "--pipeline", "dce"]):
    case(f"run-pp-artifact-{flags[-1]}", ["run", "{t}/a", "--tokens", "1,2", *flags], "2 rank graphs", "pp 2",
         setup=copy_tree("pp_artifact"))
case("run-pp-artifact-nnodes-not-dividing",
     ["run", "{t}/a", "--tokens", "1,2", "--backend", "paddle", "--nnodes", "3", "--node-rank", "0",
      "--master", "127.0.0.1:1"], "--nnodes 3", "2 processes", setup=copy_tree("pp_artifact"))


def _drop_stage(tmp: Path, b: Bases) -> None:
    """The pipelined artifact without its last stage, from the folder and the manifest alike."""
    copy_tree("pp_artifact")(tmp, b)
    shutil.rmtree(tmp / "a" / "rank1")
    _manifest_with(tmp / "a", files={k: v for k, v in json.loads((tmp / "a" / "manifest.json").read_text())
                                     ["files"].items() if not k.startswith("rank1/")})


case("verify-pp-artifact-stage-dropped", ["verify", "{t}/a"], "rank1/graph.ir", "2 rank graph(s)",
     setup=_drop_stage)
case("run-pp-artifact-stage-dropped", ["run", "{t}/a", "--tokens", "1,2"], "rank1/graph.ir", setup=_drop_stage)
case("verify-a-file", ["verify", "{t}/f"], "f", setup=write_file("f", "x"))

for name, text, expect in [
    ("empty", "", "g.ir"),
    ("header-only", "// golden case\n", "g.ir"),
    ("input-missing", "// golden case\n// input: nope-model@tiny\n// pipeline: dce\n", "nope-model"),
    ("pipeline-deep", "// golden case\n// input: gpt-345m@tiny\n// pipeline: split{tp=" + deep_list() + "}\n", "too deeply"),
    ("not-utf8", b"// golden case\n\xff\xfe", "g.ir"),
    # a valid header over IR that does not parse: a broken file (exit 2), not a difference (exit 1)
    ("garbage-ir", "// golden case\n// input: gpt-345m@tiny\n// pipeline: dce\nhello world (\n", "g.ir:4:1"),
    ("truncated-ir", "// golden case\n// input: gpt-345m@tiny\n// pipeline:\n" + IR_GOOD[:40], "g.ir"),
]:
    data = text if isinstance(text, bytes) else text.encode()
    case(f"golden-check-{name}", ["golden", "check", "{t}/g.ir"], expect, setup=write_file("g.ir", data))
case("golden-check-missing", ["golden", "check", "{t}/nope"], "nope")
case("golden-update-missing", ["golden", "update", "{t}/nope"], "nope")
case("passes-extra-arg", ["passes", "extra"], "extra")
case("explain-unknown-rule", ["explain", "no-such-rule", GPT], "no-such-rule")
case("explain-unknown-model", ["explain", "fuse-linear-bias", "no-such-model"], "no-such-model")
case("unknown-command", ["frobnicate"], "frobnicate")
case("unknown-option", ["show", GPT, "--frob"], "--frob")
case("show-unknown-model", ["show", "no-such-model@tiny"], "no-such-model")
case("show-meta-on-ir", ["show", "{t}/g.ir", "--meta"], "--meta", setup=write_file("g.ir", IR_GOOD))
case("show-file-not-ir", ["show", "{t}/x.txt"], "x.txt", setup=write_file("x.txt", "hi"))
case("compile-out-is-file", ["compile", GPT, "--target", "cuda", "--out", "{t}/f"], "f", setup=write_file("f", "x"))
case("compile-out-exists", ["compile", GPT, "--target", "cuda", "--out", "{t}/o"], "o",
     setup=lambda t, b: (t / "o").mkdir())
case("compile-quant-and-pipeline-yaml", ["compile", GPT, "--target", "cuda", "--quant", "wint8", "--pipeline",
                                         "{t}/p.yaml", "--out", "{t}/out"], "--pipeline",
     setup=write_file("p.yaml", "passes: [dce]\n"))


def _poison_training(*suffixes: str) -> Setup:
    """The training artifact with its adapters set to 3e38 (finite, but a step overflows), the
    manifest's sha256 updated so the artifact still verifies."""
    def setup(tmp: Path, b: Bases) -> None:
        import hashlib

        from ernie_ir.ir.weights import SafetensorsFile, write_safetensors

        copy_tree("train_artifact")(tmp, b)
        w = tmp / "a" / "rank0" / "weights.safetensors"
        st = SafetensorsFile(w)
        ts = {k: np.array(st.read(k)) for k in st}
        del st
        for k in ts:
            if k.endswith(suffixes):
                ts[k][...] = 3e38
        write_safetensors(w, list(ts.items()))
        m = json.loads((tmp / "a" / "manifest.json").read_text())
        m["files"]["rank0/weights.safetensors"] = hashlib.sha256(w.read_bytes()).hexdigest()
        (tmp / "a" / "manifest.json").write_text(json.dumps(m))
    return setup


case("train-params-become-nonfinite", [*TRAIN, "--steps", "2"], "NaN or Inf", needs="paddle",
     setup=_poison_training(".lora_A"))
case("train-loss-nonfinite", TRAIN, "NaN or Inf", needs="paddle", setup=_poison_training(".lora_A", ".lora_B"))
case("train-loss-nonfinite-data", [*TRAIN, "--data", "{t}/d.jsonl"], "NaN or Inf", needs="paddle",
     setup=both(_poison_training(".lora_A", ".lora_B"), write_file("d.jsonl", '{"input_ids": [1, 2, 3]}\n')))
