"""A checkpoint folder's tensors by key: headers read, data left on disk.

Formats, in the order they are looked for:
1. `model.safetensors.index.json` (sharded safetensors; `weight_map` names the files);
2. `*.safetensors` (one file, or several without an index);
3. `*.pdparams` (Paddle pickle; `model_state.pdparams.index.json` when sharded):
   only with `trust_pickle=True`, read by the restricted lazy reader of
   `pdparams.py`.
When a folder holds both, safetensors wins (it needs no trust).

Opening reads only headers (safetensors) or the pickle's opcode stream
without its array bytes (.pdparams): no weight bytes. `source(key)` returns
a lazy, memory-mapped `WeightSource`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from ernie_ir.ir import DType, WeightError
from ernie_ir.ir.inputs import read_json
from ernie_ir.ir.weights import SafetensorsFile, WeightSource

from .errors import CheckpointError, UntrustedPickleError, name_some
from .pdparams import PdparamsFile, UnsafePickleError

SAFETENSORS_INDEX = "model.safetensors.index.json"
PDPARAMS_INDEX = "model_state.pdparams.index.json"


class TensorStore:
    """The tensors of a checkpoint folder, by key."""

    def __init__(self, folder: Path, format: str, files: list[SafetensorsFile | PdparamsFile]) -> None:
        self.folder = folder
        self.format = format  # "safetensors" or "pdparams"
        self.files = files
        self._where: dict[str, SafetensorsFile | PdparamsFile] = {}
        for f in files:
            for key in f.entries:
                other = self._where.get(key)
                if other is not None:
                    raise CheckpointError(
                        f"{folder}: tensor {key!r} is stored twice ({other.path.name} and {f.path.name}): "
                        "remove the stale file"
                    )
                self._where[key] = f

    def keys(self) -> list[str]:
        return list(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def source(self, key: str) -> WeightSource:
        try:
            f = self._where[key]
        except KeyError:
            raise CheckpointError(f"{self.folder}: no tensor named {key!r}") from None
        return f.source(key)

    def shape(self, key: str) -> tuple[int, ...]:
        f = self._where[key]
        return tuple(f.entries[key].shape)

    def dtype(self, key: str) -> DType:
        return self.source(key).dtype

    def file_names(self) -> list[str]:
        return [f.path.name for f in self.files]

    def nbytes_on_disk(self) -> int:
        return sum(f.path.stat().st_size for f in self.files)


def _open_safetensors(path: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile(path)
    except WeightError as e:
        raise CheckpointError(f"{e}; re-download or re-export it") from None


def _index_files(index: Path) -> list[Path]:
    weight_map = _weight_map(index)
    names = list(dict.fromkeys(weight_map.values()))
    outside = [n for n in names if Path(n).name != n]
    if outside:
        raise CheckpointError(f"{index} names shard {outside[0]!r}, which is not a file name in "
                              f"{index.parent}: an index lists shards by name, next to it")
    missing = [n for n in names if not (index.parent / n).exists()]
    if missing:
        raise CheckpointError(
            f"{index.name} lists shard(s) that are not in {index.parent}: {name_some(missing)}; "
            "copy every shard next to the index"
        )
    return [index.parent / n for n in names]


def _weight_map(index: Path) -> dict[str, str]:
    """The index's `weight_map`, {tensor: shard file name}, checked to be one."""
    data = read_json(index, "checkpoint index", CheckpointError)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} is not a valid index (a JSON object with a 'weight_map' of tensor "
                              "names to shard file names): re-export the checkpoint")
    return weight_map


def _check_index(index: Path, store: TensorStore) -> None:
    weight_map = _weight_map(index)
    wrong = [k for k, f in weight_map.items() if k not in store or store._where[k].path.name != f]
    if wrong:
        raise CheckpointError(
            f"{index.name} lists tensors its shards do not hold: {name_some(sorted(wrong))}; "
            "the index and the shards are out of sync (re-export the checkpoint)"
        )


def open_checkpoint(folder: str | os.PathLike[str], *, trust_pickle: bool = False) -> TensorStore:
    """Open the weights of a model folder (headers only)."""
    root = Path(folder)
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        store = TensorStore(root, "safetensors", [_open_safetensors(p) for p in _index_files(index)])
        _check_index(index, store)
        return store
    singles = sorted(root.glob("*.safetensors"))
    if singles:
        return TensorStore(root, "safetensors", [_open_safetensors(p) for p in singles])
    pindex = root / PDPARAMS_INDEX
    pickles = _index_files(pindex) if pindex.is_file() else sorted(root.glob("*.pdparams"))
    if pickles:
        if not trust_pickle:
            raise UntrustedPickleError(
                f"{pickles[0]} is a pickle (.pdparams), which can run code when loaded: pass "
                "--trust-pickle if you trust where it came from, or convert it "
                "to safetensors"
            )
        files = []
        for p in pickles:
            try:
                files.append(PdparamsFile(p))
            except UnsafePickleError as e:
                raise CheckpointError(str(e)) from None
            except WeightError as e:
                raise CheckpointError(f"{e}; re-download or re-export it") from None
        store = TensorStore(root, "pdparams", files)
        if pindex.is_file():
            _check_index(pindex, store)
        return store
    meta = ("; to read config.json alone, as the full-size graph without weights, give --meta (compile, "
            "inspect; plan reads it so by itself)" if (root / "config.json").is_file() else "")
    raise CheckpointError(
        f"no weights in {root}: expected model.safetensors, sharded model-*.safetensors with "
        f"{SAFETENSORS_INDEX}, or model_state.pdparams{meta}"
    )
