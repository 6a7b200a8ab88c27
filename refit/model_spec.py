"""The weight layout a model expects, read from its checkpoint's safetensors headers.

Only headers are read (a few KB per file), never tensor data. Names are the
checkpoint's (Hugging Face) names, the same names ``reload_weights`` takes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def read_safetensors_header(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = (tuple(int(s) for s in info["shape"]), _ST_DTYPES.get(info["dtype"], info["dtype"].lower()))
    return out


def checkpoint_spec(model_dir: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """Map every checkpoint tensor name to (shape, dtype); ``None`` if the directory has no safetensors."""
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        return None
    spec: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        spec.update(read_safetensors_header(f))
    return spec
