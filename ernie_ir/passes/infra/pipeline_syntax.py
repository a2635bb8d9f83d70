"""Pipeline syntax: text and YAML read into `PassSpec`s, option values written back.

Text:  `canonicalize,cse,dce,my-pass{rank=32,targets=[".*qkv.*", ".*o_proj.*"]}`
YAML:  a list whose items are a pass name or a one-key mapping to options:

    pipeline:
      - canonicalize
      - my-pass: {rank: 32}

Reading checks the syntax only; `pipeline.build_pipeline` checks the names,
options and order against the registry. `format_value` and `format_pass_spec`
write what `parse_pipeline_text` reads back as the same values. `PipelineError`
is the error of every pipeline mistake, here and in the modules that build
and run pipelines.
"""

from __future__ import annotations

import enum
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel

from ernie_ir.ir import ErnieIRError


class PipelineError(ErnieIRError):
    """A pipeline that cannot be built: unknown pass, bad option, wrong order."""


_BARE = re.compile(r"[A-Za-z0-9_.\-/*+]+")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_\-:.]*")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a mapping key written without quotes


@dataclass(frozen=True)
class PassSpec:
    """One pipeline element before validation: a name and raw option values."""

    name: str
    options: dict[str, Any]
    where: str = ""  # "position 3" or "item 2 of file.yaml", for messages


def _bare_value(token: str) -> Any:
    low = token.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(token)
        except ValueError:
            pass
    return token


class _TextReader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def fail(self, msg: str) -> PipelineError:
        return PipelineError(f"pipeline {self.text!r}: {msg} at character {self.i + 1}")

    def skip(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def peek(self) -> str:
        self.skip()
        return self.text[self.i] if self.i < len(self.text) else ""

    def expect(self, ch: str) -> None:
        if self.peek() != ch:
            found = self.peek() or "end of text"
            raise self.fail(f"expected {ch!r}, found {found!r}")
        self.i += 1

    def specs(self) -> list[PassSpec]:
        out: list[PassSpec] = []
        while True:
            if not self.peek():
                raise self.fail("expected a pass name")
            out.append(self.spec(len(out) + 1))
            if not self.peek():
                return out
            self.expect(",")

    def spec(self, position: int) -> PassSpec:
        self.skip()
        m = _NAME.match(self.text, self.i)
        if m is None:
            raise self.fail("expected a pass name")
        self.i = m.end()
        options: dict[str, Any] = {}
        if self.peek() == "{":
            self.i += 1
            while self.peek() != "}":
                if options:
                    self.expect(",")
                self.skip()
                k = _NAME.match(self.text, self.i)
                if k is None:
                    raise self.fail("expected an option name")
                key = k.group().replace("-", "_")
                if key in options:
                    raise self.fail(f"option {key!r} given twice")  # at the repeated name
                self.i = k.end()
                self.expect("=")
                options[key] = self.value()
            self.i += 1
        return PassSpec(m.group(), options, f"position {position}")

    def value(self) -> Any:
        ch = self.peek()
        if ch == '"':
            m = re.compile(r'"(?:[^"\\]|\\.)*"').match(self.text, self.i)
            if m is None:
                raise self.fail("unterminated string")
            try:
                value = json.loads(m.group())
            except json.JSONDecodeError as e:
                self.i += e.pos
                raise self.fail(f"invalid string {m.group()[:40]}: {e.msg} (strings take JSON "
                                "escapes: \\\\ for a backslash)") from None
            self.i = m.end()
            return value
        if ch == "[":
            self.i += 1
            items: list[Any] = []
            while self.peek() != "]":
                if items:
                    self.expect(",")
                items.append(self.value())
            self.i += 1
            return items
        if ch == "{":
            return self.mapping()
        m = _BARE.match(self.text, self.i)
        if m is None:
            raise self.fail(f"expected a value, found {ch or 'end of text'!r}")
        self.i = m.end()
        return _bare_value(m.group())


    def mapping(self) -> dict[str, Any]:
        """`{key=value, "any key"=value}` (`:` may stand for `=`); keys are always strings."""
        self.i += 1
        out: dict[str, Any] = {}
        while self.peek() != "}":
            if out:
                self.expect(",")
            if self.peek() == '"':
                key = self.value()
            else:
                m = _BARE.match(self.text, self.i)
                if m is None:
                    raise self.fail(f"expected a key, found {self.peek() or 'end of text'!r}")
                self.i = m.end()
                key = m.group()
            if key in out:
                raise self.fail(f"key {key!r} given twice")
            if self.peek() == ":":
                self.i += 1
            else:
                self.expect("=")
            out[key] = self.value()
        self.i += 1
        return out


def parse_pipeline_text(text: str) -> list[PassSpec]:
    """Split pipeline text into specs (no validation against the registry yet)."""
    if not text.strip():
        return []
    reader = _TextReader(text)
    try:
        return reader.specs()
    except RecursionError:  # an option value of lists nested thousands deep
        raise reader.fail("option values nest too deeply ([[[...]]]): give a flat value") from None


_MAX_YAML_DEPTH = 32


def _check_yaml_depth(text: str, source: str) -> None:
    """PyYAML builds nodes recursively (RecursionError, and slowly): refuse deep nesting from the
    event stream, which its parser produces without recursion."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > _MAX_YAML_DEPTH:
                mark = event.start_mark
                raise PipelineError(f"{source}: nested deeper than {_MAX_YAML_DEPTH} levels at line "
                                    f"{mark.line + 1}, column {mark.column + 1}: a pipeline is a flat "
                                    "list of passes")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def parse_pipeline_yaml(text: str, source: str = "<yaml>") -> list[PassSpec]:
    try:
        _check_yaml_depth(text, source)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())  # ReaderError: several lines
        raise PipelineError(f"{source}: invalid YAML{where}: {problem}") from None
    except (ValueError, KeyError, AttributeError, TypeError) as e:  # an explicit tag: `!!int x`
        raise PipelineError(f"{source}: invalid YAML: a tagged value cannot be read ({e}): drop "
                            "the !!tag or fix the value") from None
    except RecursionError:
        raise PipelineError(f"{source}: the YAML nests too deeply to be a pipeline: give a list of "
                            "passes") from None
    if isinstance(data, dict):
        keys = set(data)
        if keys - {"pipeline", "passes", "description"}:
            raise PipelineError(f"{source}: expected a list of passes or a 'pipeline:' key, "
                                f"found keys {sorted(keys)}")
        data = data.get("pipeline", data.get("passes"))
    if not isinstance(data, list):
        raise PipelineError(f"{source}: a pipeline is a list of passes")
    specs = []
    for i, item in enumerate(data, 1):
        where = f"item {i} of {source}"
        if isinstance(item, str):
            specs.append(PassSpec(item, {}, where))
        elif isinstance(item, dict) and len(item) == 1:
            name, opts = next(iter(item.items()))
            if opts is None:
                opts = {}
            if not isinstance(opts, dict):
                raise PipelineError(f"{where}: options of {name!r} must be a mapping")
            specs.append(PassSpec(str(name), {str(k).replace("-", "_"): v for k, v in opts.items()},
                                  where))
        else:
            raise PipelineError(f"{where}: expected a pass name or {{name: {{options}}}}")
    return specs


def format_value(v: Any) -> str:
    """An option value in pipeline syntax; `_TextReader.value` reads it back as the same value
    (a pydantic model as the mapping of its non-default fields, a tuple as a list, an enum as
    its value, a path as its text)."""
    if isinstance(v, BaseModel):
        v = v.model_dump(mode="json", exclude_defaults=True)
    if isinstance(v, enum.Enum):
        v = v.value
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, (int, float)):
        return repr(float(v)) if isinstance(v, float) else str(int(v))
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(format_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{_format_key(str(k))}={format_value(v[k])}"
                              for k in sorted(v, key=str)) + "}"
    s = str(v)
    if _BARE.fullmatch(s) and isinstance(_bare_value(s), str):
        return s
    return json.dumps(s, ensure_ascii=False)


def _format_key(k: str) -> str:
    return k if _KEY.fullmatch(k) else json.dumps(k, ensure_ascii=False)


def format_pass_spec(name: str, options: BaseModel) -> str:
    """`name{k=v,...}` listing only options that differ from their defaults."""
    items = []
    for key, fld in type(options).model_fields.items():
        value = getattr(options, key)
        if not fld.is_required() and value == fld.get_default(call_default_factory=True):
            continue
        items.append(f"{key}={format_value(value)}")
    return name + ("{" + ",".join(items) + "}" if items else "")
