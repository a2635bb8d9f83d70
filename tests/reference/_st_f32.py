"""Read a safetensors file into float32 numpy arrays with numpy alone (stdlib + numpy).

``safetensors.numpy`` cannot read bfloat16 (numpy has no such dtype), and the checkpoints
``ernie-ir export`` writes keep the model's bf16. Used by pf_load_export.py and
hf_load_export.py to compare what a library loaded with the file's own values.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

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
