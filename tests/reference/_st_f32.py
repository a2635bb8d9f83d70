"""Read a safetensors file into float32 numpy arrays with numpy alone (stdlib + numpy).

``safetensors.numpy`` cannot read bfloat16 (numpy has no such dtype), and the checkpoints
``ernie-ir export`` writes keep the model's bf16. Used by pf_load_export.py and
hf_load_export.py to compare what a library loaded with the file's own values (`check_resaved`).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
           "I8": np.int8, "U8": np.uint8}


def read_f32(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """({key: float32 array}, {key: stored dtype}) of every tensor of the file (bf16 widened exactly)."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    body = data[8 + n:]
    out: dict[str, np.ndarray] = {}
    stored: dict[str, str] = {}
    for key, info in header.items():
        a, b = info["data_offsets"]
        raw = body[a:b]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(raw, _DTYPES[info["dtype"]]).astype(np.float32)
        out[key] = arr.reshape(info["shape"])
        stored[key] = info["dtype"]
    return out, stored


def read_folder_f32(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of the folder's ``*.safetensors`` files (see ``read_f32``)."""
    tensors: dict[str, np.ndarray] = {}
    stored: dict[str, str] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        t, s = read_f32(f)
        tensors.update(t)
        stored.update(s)
    return tensors, stored


def check_resaved(model: Any, folder: Path, files: dict[str, np.ndarray], scratch: Path,
                  library: str) -> None:
    """Exit (one line) unless `model.save_pretrained` writes back exactly `files`, the tensors of
    `folder` it was loaded from: a tensor the library re-initialised or holds differently fails."""
    resaved = Path(scratch) / "resaved"
    if resaved.exists():
        shutil.rmtree(resaved)
    model.save_pretrained(str(resaved))
    back, _ = read_folder_f32(resaved)
    shutil.rmtree(resaved)
    if set(back) != set(files):
        raise SystemExit(f"{folder}: {library} holds {sorted(set(back) ^ set(files))[:4]} differently "
                         "from the file")
    for k in sorted(files):
        if back[k].shape != files[k].shape or not np.array_equal(back[k], files[k]):
            raise SystemExit(f"{folder}: after loading, {k} differs from the file's tensor")
