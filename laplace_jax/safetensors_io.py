"""Read and write the safetensors format with numpy (bf16 via ml_dtypes; no torch needed).

Layout: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from laplace_jax.errors import SafetensorsError

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def load(path: str) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as numpy arrays (copies, in the stored dtype)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise SafetensorsError(f"{path}: too short to be a safetensors file ({len(raw)} bytes)")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise SafetensorsError(
            f"{path}: header length {n} exceeds the file size; the file is truncated or not safetensors"
        )
    try:
        header = json.loads(raw[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: unreadable header ({e}); the file is corrupt or not safetensors") from e
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        dtype = _DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize or base + end > len(raw):
            raise SafetensorsError(f"{path}: tensor {name} has inconsistent offsets; the file is truncated or corrupt")
        out[name] = np.frombuffer(raw, dtype=dtype, count=count, offset=base + begin).reshape(info["shape"]).copy()
    return out


def save(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write tensors (sorted by name, C order) to ``path`` atomically (temp file, then rename)."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAMES:
            raise SafetensorsError(f"tensor {name}: dtype {a.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)
