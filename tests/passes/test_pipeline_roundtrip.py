"""The pipeline text round-trips: `load_pipeline(str(p)) == p` for every registered pass.

Option values are built from each option's declared type (bool, int, float, str, paths,
enums, literals, tuples/lists, dicts, optionals, nested pydantic models), never from a
hand-written table, so a pass added later is covered too. `ernie-ir passes` prints the
defaults in the same syntax, and stays inside an 80-column terminal.
"""

from __future__ import annotations

import enum
import os
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from _passes_testkit import ERNIE_IR, run_tool
from pydantic import BaseModel

from ernie_ir.ir import DType, ErnieIRError
from ernie_ir.passes import all_passes
from ernie_ir.passes.infra.pipeline import Pipeline, build_pipeline, load_pipeline
from ernie_ir.passes.infra.pipeline_syntax import format_value, parse_pipeline_text
from ernie_ir.passes.quant.config import QuantConfig

# Strings that stress the syntax: separators, quotes, escapes, braces, words the reader
# would otherwise take for a bool/None/number, and unicode.
TRICKY_STRINGS = ['a "quoted", {braced} [value]', "back\\slash = x", "none", "true", "12", "1e-05",
                  "", " lead and trail ", "é=ü,ß"]


def _candidates(annotation: Any, default: Any, files: Path) -> list[Any]:
    """Values of `annotation` other than `default`, most demanding first."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        out = []
        for arm in args:
            if arm is type(None):
                out.append(None)
            else:
                out.extend(_candidates(arm, default, files))
        return [v for v in out if v != default]
    if origin is typing.Literal:
        return [v for v in args if v != default]
    if annotation is bool:
        return [not default]
    if annotation is int:
        return [v for v in (2, 3, 1, 70, 90, 128, 0, -1, 7) if v != default]
    if annotation is float:
        return [v for v in (0.125, 1e-05, 2.5, 3.0, -0.5) if v != default]
    if annotation is str:
        # A real file first (options that name files are read when the pass is built): its
        # name holds a space, a comma, braces and an '=' so that quoting is exercised.
        # Last, a word from a vocabulary that some str options check (a quant preset name).
        return [str(files / "a dir, {x}=y" / "config.yaml"), *TRICKY_STRINGS, "wint8"]
    if isinstance(annotation, type) and issubclass(annotation, os.PathLike):
        return [files / "a dir, {x}=y" / "config.yaml", Path("relative/p q.bin")]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [m for m in annotation if m != default]
    if isinstance(annotation, type) and issubclass(annotation, QuantConfig):
        return [QuantConfig.preset("wint4"), QuantConfig.preset("qat-int8")]
    if origin in (tuple, list):
        item = args[0] if args else str
        values = _candidates(item, None, files)[:3]
        return [origin(values), origin(values[:1]), origin()]
    if origin is dict:
        key, value = args
        keys = [k for k in _candidates(key, None, files) if isinstance(k, str) and k][:3]
        vals = _candidates(value, None, files)[:3]
        return [dict(zip(keys, vals, strict=False)), {}]
    raise AssertionError(f"no non-default values known for option type {annotation!r}: teach "
                         "this test about it")


def _quant_file(files: Path) -> None:
    folder = files / "a dir, {x}=y"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text("quantization: wint8\n", encoding="utf-8")


def _properties() -> set[str]:
    """Every property any pass requires, so the order check never hides an option problem."""
    return {prop for cls in all_passes().values() for prop in cls.requires}


def _build(cls: type, options: dict[str, Any]) -> Any | None:
    try:
        return cls(options)
    except (ErnieIRError, ValueError, TypeError):
        return None


def _groups(annotation: Any, default: Any, files: Path) -> list[list[Any]]:
    """Candidate values per arm of a union (each arm must round-trip), else one group."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        groups = [[None] if arm is type(None) else _candidates(arm, default, files)
                  for arm in typing.get_args(annotation)]
        return [[v for v in g if v != default] for g in groups if any(v != default for v in g)]
    return [_candidates(annotation, default, files)]


def _variants(cls: type, files: Path) -> list[tuple[str, Any]]:
    """(option, pass instance with that option non-default) for every option of `cls` (and
    every arm of an option's union type)."""
    fields = cls.Options.model_fields
    base: dict[str, Any] = {}
    for key, fld in fields.items():
        if fld.is_required():
            tried = _candidates(fld.annotation, None, files)
            base[key] = next((v for v in tried if _build(cls, {**base, key: v}) is not None), tried[0])
    out = []
    # an option that only builds beside another (quant-annotate's method needs a preset): tried
    # again with the first value that built each earlier option
    companions: dict[str, Any] = {}
    for key, fld in fields.items():
        default = None if fld.is_required() else fld.get_default(call_default_factory=True)
        for tried in _groups(fld.annotation, default, files):
            built = None
            for value in tried:
                built = _build(cls, {**base, key: value})
                for other, companion in companions.items():
                    if built is not None:
                        break
                    built = _build(cls, {**base, other: companion, key: value})
                if built is not None:
                    companions.setdefault(key, value)
                    break
            assert built is not None, f"{cls.name}: no value of {key} in {tried!r} builds the pass"
            out.append((f"{key}={type(getattr(built.options, key)).__name__}", built))
    return out


def _cases(files: Path) -> list[tuple[str, Any]]:
    _quant_file(files)
    cases = []
    for name, cls in all_passes().items():
        for key, p in _variants(cls, files):
            cases.append((f"{name}.{key}", p))
    return cases


def test_every_option_of_every_registered_pass_round_trips(tmp_path: Path):
    cases = _cases(tmp_path)
    assert len(cases) >= 20  # the built-in passes alone have more options than that
    props = _properties()
    for label, p in cases:
        pipeline = Pipeline([p])
        text = str(pipeline)
        again = load_pipeline(text, initial=props)
        assert again == pipeline, f"{label}: {text!r} parses to {again!r}"
        assert str(again) == text, label


def test_a_pipeline_of_all_of_them_round_trips_as_one_text(tmp_path: Path):
    passes = [p for _, p in _cases(tmp_path)]
    pipeline = Pipeline(passes)
    # Built without the order check: some of these passes invalidate what others require.
    again = build_pipeline(parse_pipeline_text(str(pipeline)), check_order=False)
    assert again == pipeline
    assert again != Pipeline(passes[:-1]) and again != Pipeline(passes[::-1])


@pytest.mark.parametrize("value", [
    {"model.": "ernie.", "a b": "c,d", 'q"uote': "}"},
    {"nested": {"x": [1, 2.5, None, True]}, "empty": {}},
    ["x", ["y", []], {"k": "v"}],
    DType.BF16, Path("some dir/f.yaml"), 1e-05, -0.0, 1e300, True, False, None,
    *TRICKY_STRINGS,
])
def test_format_value_is_read_back_as_the_same_value(value: Any):
    text = format_value(value)
    (spec,) = parse_pipeline_text(f"p{{v={text}}}")
    got = spec.options["v"]
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    assert got == value and type(got) is type(value), text


def test_a_pydantic_model_option_is_written_as_its_non_default_fields():
    cfg = QuantConfig.preset("wint8")
    text = format_value(cfg)
    assert "freeze_embedding" not in text  # a default
    (spec,) = parse_pipeline_text(f"quant-annotate{{config={text}}}")
    assert QuantConfig.model_validate(spec.options["config"]) == cfg
    assert isinstance(cfg, BaseModel)


# -- `ernie-ir passes` -------------------------------------------------------------------------

def _passes_output(columns: int) -> str:
    run = run_tool(ERNIE_IR, "passes", env={"COLUMNS": str(columns)})
    assert run.returncode == 0 and run.stderr == "", run.stderr
    return run.stdout


def _spec_blocks(out: str) -> dict[str, str]:
    """Pass name -> its spec line(s) joined (a spec starts in column 0 and continues indented
    under the '{')."""
    blocks: dict[str, str] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("Presets"):
            break
        if line and not line[0].isspace() and line[0].isalpha() and not line.startswith("Passes"):
            name = line.split("{")[0].split()[0]
            blocks[name] = line.split("  ")[0] if "{" not in line else line.rstrip()
            current = name if "{" in line and not line.rstrip().endswith("}") else None
        elif current is not None and line.startswith(" ") and line.strip() and "{" in blocks[current]:
            blocks[current] += line.strip()
            if line.rstrip().endswith("}"):
                current = None
    return blocks


@pytest.mark.slow
def test_passes_prints_defaults_in_pipeline_syntax_within_80_columns():
    out = _passes_output(80)
    too_wide = [line for line in out.splitlines() if len(line) > 80]
    assert not too_wide, "\n".join(too_wide)
    blocks = _spec_blocks(out)
    assert set(all_passes()) <= set(blocks), sorted(set(all_passes()) - set(blocks))
    # Every spec whose options all have defaults is a pipeline that builds those defaults.
    checked = 0
    for name, cls in all_passes().items():
        text = blocks[name]
        if any(f.is_required() for f in cls.Options.model_fields.values()):
            assert "=<" in text, text  # a required option shows its type, not a value
            continue
        try:
            default = cls()
        except ErnieIRError:
            continue  # e.g. quant-annotate needs one of two options
        (parsed,) = load_pipeline(text, initial=_properties()).passes
        assert parsed.options == default.options, (name, text)
        checked += 1
    assert checked >= 10
    assert "lora-import{" in out and 'prefix_map={"model."=ernie.}' in out.replace("\n", "")
    assert "dtype=f32" in out


@pytest.mark.slow
def test_passes_at_a_wide_terminal_keeps_one_line_per_spec():
    out = _passes_output(200)
    line = next(line for line in out.splitlines() if line.startswith("lora{"))
    assert line.endswith("}") and "freeze_base=true" in line
