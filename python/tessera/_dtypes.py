"""tessera dtypes (the safetensors names of include/tessera/dtype.h) <-> NumPy and torch dtypes.

A dtype the array library lacks is represented by an unsigned (NumPy) or signed (torch)
integer of the same width holding the raw bits: BF16 and F8 as NumPy uint16/uint8, F8 in a
torch without float8, U16/U32/U64 in a torch without unsigned types. Such arrays are saved and
loaded with their tessera dtype (ShardedTensor(dtype=...)), so the bits round-trip exactly.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional

# tessera name -> NumPy dtype name; None where NumPy has no such type.
_NUMPY_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": None,
    "F8_E4M3": None,
    "F8_E5M2": None,
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}

# tessera name -> torch dtype attribute; absent in older torch versions are skipped at lookup.
_TORCH_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}

_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
    "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8,
}

DTYPE_NAMES = tuple(_NUMPY_NAMES)

_numpy_to_name: Optional[Dict[str, str]] = None
_torch_to_name: Optional[Dict[Any, str]] = None


def _numpy():
    import numpy  # noqa: PLC0415 (imported on first use)
    return numpy


def numpy_dtype_name(dtype):
    """The tessera name of a NumPy dtype, or None (unsupported, or not in native byte order)."""
    global _numpy_to_name
    if _numpy_to_name is None:
        np = _numpy()
        _numpy_to_name = {np.dtype(n).str: t for t, n in _NUMPY_NAMES.items() if n}
    return _numpy_to_name.get(dtype.str)


def torch_dtype_name(dtype):
    """The tessera name of a torch dtype, or None."""
    global _torch_to_name
    if _torch_to_name is None:
        import torch  # noqa: PLC0415
        _torch_to_name = {}
        for t, n in _TORCH_NAMES.items():
            if hasattr(torch, n):
                _torch_to_name[getattr(torch, n)] = t
    return _torch_to_name.get(dtype)


def raw_name(size, signed):
    """The integer dtype name of `size` bytes: "int16", "uint16", ..."""
    return ("" if signed else "u") + "int" + str(8 * size)


def numpy_dtype(name):
    """(numpy dtype, is_raw_bits) for a tessera dtype name."""
    np = _numpy()
    n = _NUMPY_NAMES[name]
    if n is not None:
        return np.dtype(n), False
    return np.dtype(raw_name(_SIZES[name], signed=False)), True


def torch_dtype(name):
    """(torch dtype, is_raw_bits) for a tessera dtype name."""
    import torch  # noqa: PLC0415
    n = _TORCH_NAMES[name]
    if hasattr(torch, n):
        return getattr(torch, n), False
    return getattr(torch, raw_name(_SIZES[name], signed=True)), True


def itemsize(name):
    return _SIZES[name]


def is_torch_tensor(value):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_numpy_array(value):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray)
