"""The artifact manifest (DESIGN.md section 6): its schema, reading, verifying and writing it.

`read_manifest` checks the manifest's shape against the schema (`validate_manifest`: every
field the readers use has its type, e.g. `backends` a list of strings, `files` an object of
64-digit sha256s under safe relative names), so a reader never meets a value of the wrong kind;
a wrong shape is one `ArtifactError` line naming the field.

`verify_artifact` walks the folder without following links and checks:
- every listed file is there, is a regular file and has its sha256;
- nothing else is there (an unlisted file, a FIFO or device, a link to a folder);
- a symbolic link is refused unless it is an alias of a listed regular file in its folder or
  below it (`rank0/model.safetensors -> weights.safetensors`, FastDeploy's name for the rank
  weights; at tp 1 the top-level `model.safetensors -> rank0/weights.safetensors`): an absolute
  link, one with `..` or `.`, a chain, a dangling link are tampering.

`build_manifest` + `write_manifest` are the one writer (compile); `record_files` adds files
written later into an artifact (training checkpoints), under the artifact's lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.mapping import Mapping
from ernie_ir.ir.storage import load_graph, printable, sha256_file

FORMAT = "ernie-ir-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FORMATS = ("fastdeploy",)
"""Emitters that write a format another program loads (the manifest's "formats"), not a backend
`ernie-ir run --backend` offers ("backends")."""
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest lists names and hashes; anything larger is not one (and is not read into memory)."""
MAX_RANKS = 4096


class ArtifactError(ErnieIRError):
    """An artifact folder that is missing, incomplete, tampered with, or in the way."""


show = printable
"""A name or path as it may appear in a one-line message (control characters escaped)."""


# -- the schema ----------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _Parallel(_Strict):
    tp: int = Field(1, ge=1, le=MAX_RANKS)
    ep: int = Field(1, ge=1, le=MAX_RANKS)
    world_size: int = Field(1, ge=1, le=MAX_RANKS)
    ranks: list[str] | None = None
    mapping: dict[str, Any] | None = None
    pp: int | None = None
    dp: int | None = None
    processes: int | None = None
    sharding: str | None = None


class _KernelPlan(_Strict):
    kernels: dict[str, int] = {}
    fallbacks: list[Any] = []


class Manifest(_Strict):
    """An artifact's manifest, as `read_manifest` and `verify_artifact` return it: every field
    typed (fields compile adds beyond these stay readable as attributes, pydantic's extras),
    the layout as `mapping`, the backends offered as `offered`."""

    format: str
    format_version: int
    ernie_ir_version: str | None = None
    source: dict[str, Any] | None = None
    pipeline: str | None = None
    target: str | None = None
    cuda_arch: int | None = None
    mode: Literal["inference", "training"] | None = None
    weights: bool | None = None
    parallel: _Parallel | None = None
    kernel_plan: _KernelPlan | None = None
    backends: list[str] | None = None
    formats: list[str] | None = None
    onnx_numerics: str | None = None
    kv_cache_dtype: str | None = None
    tokenizer: str | None = None
    """The folder (relative) holding the model's tokenizer files."""
    emit: list[str] | None = None
    """The executables compile wrote (`--emit`)."""
    params_before: dict[str, Any] | None = None
    params_after: dict[str, Any] | None = None
    lora_adapter: dict[str, Any] | None = None
    """An imported LoRA adapter: its folder, the sha256 of its files, merged or not."""
    rank_files: dict[str, dict[str, str]] | None = None
    files: dict[str, str]

    @property
    def mapping(self) -> Mapping:
        """The parallel layout the artifact records (one rank for older artifacts)."""
        data = self.parallel.mapping if self.parallel is not None else None
        if data is None:
            return Mapping.create()
        try:
            return Mapping.model_validate(data)
        except ValueError:
            raise ArtifactError("manifest.json: field 'parallel.mapping' is not a valid layout: the manifest "
                                "is corrupt or tampered with; recompile the model") from None

    @property
    def offered(self) -> list[str]:
        """The backends `run --backend` can use (older artifacts: the interpreter only)."""
        return list(self.backends) if self.backends is not None else ["interpreter"]


_KINDS = {"list_type": "a list", "dict_type": "an object", "model_type": "an object",
          "string_type": "a string", "int_type": "an integer", "bool_type": "true or false",
          "literal_error": "one of the known values", "missing": "present"}


def validate_manifest(data: Any, where: str = MANIFEST) -> dict[str, Any]:
    """`data` as a manifest (the dict itself, to write), or ArtifactError naming the first field
    of the wrong shape."""
    parse_manifest(data, where)
    return data


def parse_manifest(data: Any, where: str = MANIFEST) -> Manifest:
    """`data` as a typed Manifest, or ArtifactError naming the first field of the wrong shape."""
    corrupt = "the manifest is corrupt or tampered with; recompile the model"
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ArtifactError(f"{where} is not an ernie-ir artifact manifest")
    if data.get("format_version") != FORMAT_VERSION or isinstance(data.get("format_version"), bool):
        raise ArtifactError(f"{where}: format version {show(data.get('format_version'))} is not supported "
                            f"(this ernie-ir reads version {FORMAT_VERSION}); recompile the model")
    if not isinstance(data.get("files"), dict):
        raise ArtifactError(f"{where}: field 'files' must be an object of sha256s, not "
                            f"{_kind(data.get('files'))}: {corrupt}")
    for name, digest in data["files"].items():
        _check_name(name, where)
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= set("0123456789abcdef"):
            raise ArtifactError(f"{where}: the sha256 of {show(name)} is not a 64-digit hex string: "
                                f"{corrupt}")
    try:
        model = Manifest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        want = _KINDS.get(first["type"], first["msg"].lower())
        got = "missing" if first["type"] == "missing" else _kind(first.get("input"))
        raise ArtifactError(f"{where}: field '{show(field)}' must be {want}, not {got}: {corrupt}") from None
    if model.tokenizer is not None and model.tokenizer != ".":  # "." : the artifact's root
        _check_name(model.tokenizer, where)
    if model.parallel is not None and model.parallel.mapping is not None:
        try:
            mapping = Mapping.model_validate(model.parallel.mapping)
        except ValueError:
            raise ArtifactError(f"{where}: field 'parallel.mapping' is not a valid layout: "
                                f"{corrupt}") from None
        if mapping.world_size != model.parallel.world_size:
            raise ArtifactError(f"{where}: parallel.world_size {model.parallel.world_size} is not the "
                                f"mapping's {mapping.world_size}: {corrupt}")
    return model


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _check_name(name: str, where: str) -> None:
    """A listed name is a plain relative POSIX path inside the artifact, spelled one way."""
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts)
            or name == MANIFEST or not name.isprintable()):
        raise ArtifactError(f"{where} lists '{show(name)}', which is outside the artifact folder or not a "
                            "plain file name: the manifest is corrupt or tampered with; recompile the model")


# -- reading -----------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of the artifact folder `path`, typed, its shape checked (ArtifactError, one line)."""
    data = read_manifest_data(path)
    return parse_manifest(data, show(Path(path) / MANIFEST))


def read_manifest_data(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of `path` as the dict in the file, its shape checked: for the writers that
    rewrite it (`record_files`, `retire_published`)."""
    root = Path(path)
    mf = root / MANIFEST
    try:
        st = os.lstat(mf)
    except OSError:
        st = None
    if not root.is_dir() or st is None:
        raise ArtifactError(f"{show(root)} is not an ernie-ir artifact (no {MANIFEST})")
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(f"{show(mf)} is not a regular file (a link, FIFO or folder): the artifact is "
                            "corrupt or tampered with; recompile the model")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{show(mf)} is {st.st_size} bytes, more than a manifest can be "
                            f"({MAX_MANIFEST_BYTES >> 20} MiB): the artifact is corrupt")
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ArtifactError(f"{show(mf)} is not valid JSON: the artifact is corrupt") from None
    except OSError as e:
        raise ArtifactError(f"{show(mf)}: cannot read it ({e.strerror or e})") from None
    return validate_manifest(manifest, show(mf))


def _tree(root: Path) -> dict[str, os.stat_result]:
    """{relative name: lstat} of every entry that is not a folder, links not followed."""
    entries: dict[str, os.stat_result] = {}
    for folder, dirs, names in os.walk(root):
        rel = Path(folder).relative_to(root)
        for d in list(dirs):
            if os.path.islink(os.path.join(folder, d)):
                names.append(d)  # os.walk lists a link to a folder as a folder
                dirs.remove(d)
        for n in names:
            entries[(rel / n).as_posix()] = os.lstat(os.path.join(folder, n))
    return entries


def _sibling(root: Path, name: str) -> str | None:
    """The relative name of the file the link `name` aliases in its own folder or below it
    (FastDeploy's `rank0/model.safetensors -> weights.safetensors`; at tp 1 the top-level
    `model.safetensors -> rank0/weights.safetensors`), or None when its target is not such a
    relative path of plain names (absolute, empty, with `.` or `..`)."""
    target = os.readlink(root / name)
    parts = target.split("/")
    if target.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return None
    return (PurePosixPath(name).parent / target).as_posix()


def _link_ok(root: Path, name: str, listed: dict[str, str], entries: dict[str, os.stat_result]) -> str | None:
    """None when the link `name` is an alias of a listed regular file in its folder or below it,
    else why not."""
    target = os.readlink(root / name)
    inside = root.resolve()
    if inside not in (root / name).resolve().parents:
        return f"a symbolic link that resolves outside the artifact ({show(target)})"
    sibling = _sibling(root, name)
    if sibling is None:
        return (f"a symbolic link to {show(target)}, not an alias of a listed file in its folder or below "
                "(the only link an artifact may hold)")
    st = entries.get(sibling)
    if st is None:
        return f"a symbolic link to {show(target)}, which does not exist"
    if not stat.S_ISREG(st.st_mode) or sibling not in listed:
        return f"a symbolic link to {show(target)}, which is not a listed regular file"
    return None


def verify_artifact(path: str | os.PathLike[str]) -> Manifest:
    """Re-check every file's sha256 and the folder's shape against the manifest; returns it.

    Raises ArtifactError naming the first file that is missing, changed, unlisted, not a regular
    file, or a link other than an alias of a listed file in its folder or below.
    """
    root = Path(path)
    manifest = read_manifest(root)
    listed: dict[str, str] = manifest.files
    where = f"artifact {show(root)}"
    entries = _tree(root)
    for name, st in sorted(entries.items()):
        if name == MANIFEST:
            continue
        if name not in listed:
            raise ArtifactError(f"{where}: {show(name)} is not listed in {MANIFEST} (an added file): "
                                "remove it or recompile")
        if stat.S_ISLNK(st.st_mode):
            why = _link_ok(root, name, listed, entries)
            if why is not None:
                raise ArtifactError(f"{where}: {show(name)} is {why}: an artifact holds only its own files; "
                                    "the artifact was tampered with; recompile it")
        elif not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{where}: {show(name)} is not a regular file (a FIFO, socket or device): "
                                "the artifact was tampered with; recompile it")
    for name, digest in listed.items():
        if name not in entries:
            raise ArtifactError(f"{where}: {show(name)} is missing (listed in {MANIFEST})")
        _check_digest(root, name, digest, where)
    _check_rank_folders(manifest, where)
    _check_records(root, manifest, where)
    return manifest


def _check_rank_folders(manifest: Manifest, where: str) -> None:
    """One `rank{g}/graph.ir` per rank graph the layout holds (`Mapping.rank_graphs`: pp x
    world_size, stage-major), and no other rank folder: a run starts one process per rank graph,
    so a folder too few or too many would run a part of the model as if it were the whole."""
    count = manifest.mapping.rank_graphs
    listed = {n.split("/", 1)[0] for n in manifest.files if n.startswith("rank") and "/" in n}
    for g in range(count):
        if f"rank{g}/graph.ir" not in manifest.files:
            raise ArtifactError(f"{where}: rank{g}/graph.ir is not listed in {MANIFEST}, but the layout "
                                f"({manifest.mapping.describe()}) has {count} rank graph(s): the artifact "
                                "is incomplete or tampered with; recompile the model")
    extra = sorted(listed - {f"rank{g}" for g in range(count)})
    if extra:
        raise ArtifactError(f"{where}: {show(extra[0])}/ is beyond the layout's {count} rank graph(s) "
                            f"({manifest.mapping.describe()}): the manifest was edited (tampered with); "
                            "recompile the model")


def check_rank_graphs(path: str | os.PathLike[str], manifest: Manifest) -> int:
    """Parse every rank graph's IR (`rank{g}/graph.ir`) as `load_rank_graphs` would, every
    attribute and type checked, without reading weights; returns how many. ArtifactError naming
    the file, line and node for IR that does not load."""
    from ernie_ir.ir.parser import parse_graph

    root = Path(path)
    count = manifest.mapping.rank_graphs
    for g in range(count):
        name = f"rank{g}/graph.ir"
        try:
            parse_graph((root / name).read_text(encoding="utf-8"), source=str(root / name))
        except UnicodeDecodeError:
            raise ArtifactError(f"artifact {show(root)}: {name} is not UTF-8 text: the artifact is corrupt; "
                                "recompile the model") from None
        except OSError as e:
            raise ArtifactError(f"artifact {show(root)}: cannot read {name} ({e.strerror or e})") from None
    return count


def _check_records(root: Path, manifest: Manifest, where: str) -> None:
    """The manifest's target, cuda_arch and mode against what the hashed files record of them
    (checked after the hashes, so these records are the compiler's own): `graph.ir`'s metadata
    (`kernel_plan.target`, `kernel_plan.cuda_arch`, the `lowered:<target>` property) and the
    executables folder (`inference/` or `training/`) with its `launch.json` (target and mode).
    The manifest is the one file no hash covers: an edited field is tampering."""
    from ernie_ir.ir.parser import parse_graph  # the op set loads only for this check

    listed: dict[str, str] = manifest.files
    records: list[tuple[str, str, Any]] = []  # (field, file that records it, its value there)
    if "graph.ir" in listed:
        try:
            meta = parse_graph((root / "graph.ir").read_text(encoding="utf-8"), source="graph.ir",
                               check_types=False).metadata
        except (OSError, UnicodeDecodeError, ErnieIRError) as e:
            raise ArtifactError(f"{where}: graph.ir cannot be read as IR ({e}): the artifact is corrupt; "
                                "recompile the model") from None
        plan = meta.get("kernel_plan")
        if isinstance(plan, dict):
            if "target" in plan:
                records.append(("target", "graph.ir", plan["target"]))
            if "cuda_arch" in plan:
                records.append(("cuda_arch", "graph.ir", plan["cuda_arch"]))
        props = meta.get("properties")
        lowered = [p.removeprefix("lowered:") for p in (props if isinstance(props, list) else [])
                   if isinstance(p, str) and p.startswith("lowered:")]
        if len(lowered) == 1:
            records.append(("target", "graph.ir", lowered[0]))
    modes = sorted({n.split("/", 1)[0] for n in listed} & {"inference", "training"})
    if len(modes) == 1:
        records.append(("mode", f"the executables folder {modes[0]}/", modes[0]))
        recipe_name = f"{modes[0]}/launch.json"
        if recipe_name in listed:
            try:
                recipe = json.loads((root / recipe_name).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                raise ArtifactError(f"{where}: {recipe_name} is not valid JSON: the artifact is corrupt; "
                                    "recompile the model") from None
            if isinstance(recipe, dict):
                records += [(k, recipe_name, recipe[k]) for k in ("target", "mode") if k in recipe]
    for key, source, value in records:
        said = getattr(manifest, key)
        if key in manifest.model_fields_set and said != value:
            raise ArtifactError(f"{where}: {MANIFEST} says {key} {show(json.dumps(said))} "
                                f"but {source} records {show(json.dumps(value))}: the manifest was edited "
                                "(tampered with); recompile the model")


def _check_digest(root: Path, name: str, digest: str, where: str) -> None:
    try:
        actual = sha256_file(root / name)
    except OSError as e:
        raise ArtifactError(f"{where}: cannot read {show(name)} ({e.strerror or e})") from None
    if actual != digest:
        raise ArtifactError(f"{where}: {show(name)} was modified (sha256 {actual[:16]}..., "
                            f"manifest says {digest[:16]}...); recompile or restore it")


def check_files(root: Path, manifest: Manifest, names: Iterable[str]) -> None:
    """The sha256 of just `names` (e.g. one rank's files) against a manifest read by
    `read_manifest`: each must be listed, a regular file (or the allowed alias) and unchanged."""
    listed: dict[str, str] = manifest.files
    where = f"artifact {show(root)}"
    for name in names:
        if name not in listed:
            raise ArtifactError(f"{where}: {show(name)} is not listed in {MANIFEST}: recompile the model")
        try:
            st = os.lstat(root / name)
        except OSError:
            raise ArtifactError(f"{where}: {show(name)} is missing (listed in {MANIFEST})") from None
        if stat.S_ISLNK(st.st_mode):
            entries = {name: st}
            target = (PurePosixPath(name).parent / os.readlink(root / name)).as_posix()
            if os.path.lexists(root / target):
                entries[target] = os.lstat(root / target)
            why = _link_ok(root, name, listed, entries)
            if why is not None:
                raise ArtifactError(f"{where}: {show(name)} is {why}: the artifact was tampered with; "
                                    "recompile it")
        elif not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{where}: {show(name)} is not a regular file: the artifact was tampered "
                                "with; recompile it")
        _check_digest(root, name, listed[name], where)


def require_weights(root: Path, manifest: Manifest) -> None:
    """Refuse to run a graph-only artifact (compiled from a model without weights)."""
    if manifest.weights is False:
        raise ArtifactError(f"{show(root)} is a graph-only artifact (compiled from a model without weights, "
                            "e.g. NAME@meta): it holds no weights to run; `ernie-ir show` and "
                            "`ernie-ir plan` read it; compile a checkpoint folder or NAME@tiny to run")


def artifact_mapping(manifest: Manifest) -> Mapping:
    """The parallel layout an artifact's manifest records (one rank for older artifacts)."""
    return manifest.mapping


def load_rank_graphs(path: str | os.PathLike[str], *, verify: bool = True) -> tuple[Mapping, list[Graph]]:
    """Every rank graph of an artifact (rank order), weights memory-mapped, with its Mapping."""
    root = Path(path)
    manifest = verify_artifact(root) if verify else read_manifest(root)
    require_weights(root, manifest)
    mapping = artifact_mapping(manifest)
    return mapping, [load_graph(root / f"rank{r}") for r in range(mapping.rank_graphs)]


def load_artifact(path: str | os.PathLike[str], *, verify: bool = True) -> Graph:
    """The rank-0 graph of an artifact, weights memory-mapped (hashes checked first unless verify=False)."""
    root = Path(path)
    if verify:
        verify_artifact(root)
    else:
        read_manifest(root)
    return load_graph(root / "rank0")


# -- writing -----------------------------------------------------------------------------------


def hash_tree(root: Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """{relative name: sha256} of every file under `root` except the manifest (links: their
    target's bytes); `known` digests (hashed while written) are taken as they are."""
    entries = _tree(root)
    known = dict(known or {})
    for name, st in entries.items():  # an alias of a file hashed as written has its digest
        if stat.S_ISLNK(st.st_mode) and name not in known and (alias := _sibling(root, name)) in known:
            known[name] = known[alias]
    return {name: known.get(name) or sha256_file(root / name)
            for name in sorted(entries) if name != MANIFEST}


@dataclass(frozen=True)
class ManifestRecord:
    """What a compile records of itself in the manifest, beside the files and their hashes."""

    ernie_ir_version: str
    source: dict[str, Any]
    pipeline: str
    target: str
    mode: str
    weights: bool
    mapping: Mapping
    kernel_plan: dict[str, Any]
    backends: tuple[str, ...] = ()
    """Executables written (FORMATS go to "formats", the rest to "backends" after the interpreter)."""
    extra: dict[str, Any] = field(default_factory=dict)


def build_manifest(record: ManifestRecord, files: dict[str, str],
                   rank_names: Iterable[str]) -> dict[str, Any]:
    """The manifest dict of a compiled artifact (key order is the file's)."""
    kernels: dict[str, int] = {}
    for entry in record.kernel_plan.get("kernels", []):
        kernels[entry["kernel"]] = kernels.get(entry["kernel"], 0) + 1
    names = tuple(rank_names)
    mapping = record.mapping
    formats = [b for b in record.backends if b in FORMATS]
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "ernie_ir_version": record.ernie_ir_version,
        "source": record.source,
        "pipeline": record.pipeline,
        "target": record.target,
        **({"cuda_arch": record.kernel_plan["cuda_arch"]} if "cuda_arch" in record.kernel_plan else {}),
        "mode": record.mode,
        "weights": record.weights,
        "parallel": {"tp": mapping.tp, "ep": mapping.ep, "world_size": mapping.world_size,
                     "ranks": [f"rank{r}" for r in range(mapping.rank_graphs)],
                     **({"pp": mapping.pp} if mapping.pp > 1 else {}),
                     **({"dp": mapping.dp, "processes": mapping.processes, "sharding": mapping.sharding}
                        if mapping.dp > 1 else {}),
                     "mapping": mapping.model_dump(mode="json")},
        "kernel_plan": {"kernels": dict(sorted(kernels.items())),
                        "fallbacks": record.kernel_plan.get("fallbacks", [])},
        **record.extra,
        "backends": ["interpreter", *(b for b in record.backends if b not in FORMATS)],
        **({"formats": formats} if formats else {}),
        "rank_files": {f"rank{r}": {n: files[f"rank{r}/{n}"] for n in names}
                       for r in range(mapping.rank_graphs)},
        "files": files,
    }
    return validate_manifest(manifest)


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Write `root/manifest.json` atomically (a temp file renamed over it), its shape checked first."""
    validate_manifest(manifest)
    for stale in root.glob(f".{MANIFEST}.tmp-*"):  # a killed writer's (callers hold the lock)
        stale.unlink(missing_ok=True)
    tmp = root / f".{MANIFEST}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(manifest, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def record_files(root: Path, files: Iterable[Path],
                 expected: Manifest | dict[str, Any] | None = None) -> dict[str, Any]:
    """List `files` (inside `root`) with their sha256 in the artifact's manifest, read afresh and
    rewritten atomically; returns the new manifest. The caller holds the artifact's lock
    (`artifact_lock`), so two writers never lose each other's entries.

    `expected`: the manifest the caller started from; if any of its files changed meanwhile
    (the artifact was recompiled), ArtifactError and nothing is recorded."""
    manifest = read_manifest_data(root)
    if expected is not None:
        now = manifest["files"]
        was = expected.files if isinstance(expected, Manifest) else expected.get("files", {})
        changed = [n for n, d in was.items() if now.get(n) != d]
        if changed:
            raise ArtifactError(f"artifact {show(root)} changed while it was in use ({show(changed[0])} is "
                                "not the file it was): nothing was recorded; run again on the new artifact")
    base = Path(root).resolve()  # a relative root and absolute files (or the reverse) name the same tree
    for f in files:
        name = Path(f).resolve().relative_to(base).as_posix()
        _check_name(name, MANIFEST)
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(chunk)
        manifest["files"][name] = h.hexdigest()
    write_manifest(root, manifest)
    return manifest
