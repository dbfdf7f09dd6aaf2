#!/usr/bin/env python3
"""An independent writer of Hugging Face safetensors files: the Python standard library only
(struct, json), following the safetensors format as published, not tessera's code:

    u64 little-endian N | N bytes of JSON header (padded with spaces to a multiple of 8) | data

The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
relative to the data section) and may hold "__metadata__" (str -> str). A sharded checkpoint
adds model.safetensors.index.json: {"metadata": {"total_size": N}, "weight_map": {name: file}}.

Used by the C++ tests (through the command line) and the Python tests (imported).

Command line: write_hf.py SPEC_JSON, where SPEC_JSON (text, not a path) is
    {"dir": "/out", "files": {"a.safetensors": ["t1", "t2"], ...},
     "tensors": {"t1": {"dtype": "F32", "shape": [4, 8]}, ...},
     "index": true | false, "metadata": {"k": "v"}}
Each tensor's bytes are pattern_bytes(name, nbytes); the C++ tests compute the same pattern.
"""

import json
import os
import struct
import sys

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
    "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8,
}
INDEX_NAME = "model.safetensors.index.json"


def pattern_bytes(name, n):
    """Byte i is (seed + 167 i + (i >> 9)) mod 256, seed = sum of (j + 1) * byte j of the
    UTF-8 name: different per tensor and per position, cheap to recompute in C++."""
    seed = sum((j + 1) * c for j, c in enumerate(name.encode()))
    return bytes((seed + 167 * i + (i >> 9)) & 0xFF for i in range(n))


def nbytes(dtype, shape):
    n = DTYPE_SIZES[dtype]
    for d in shape:
        n *= d
    return n


def write_safetensors(path, tensors, metadata=None):
    """tensors: [(name, dtype, shape, data bytes)], laid out in this order."""
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in tensors:
            f.write(data)


def write_index(directory, weight_map, total_size):
    with open(os.path.join(directory, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f,
                  indent=2, sort_keys=True)
        f.write("\n")


def write_spec(spec):
    directory = spec["dir"]
    os.makedirs(directory, exist_ok=True)
    weight_map = {}
    total = 0
    for file_name, names in spec["files"].items():
        tensors = []
        for name in names:
            t = spec["tensors"][name]
            n = nbytes(t["dtype"], t["shape"])
            tensors.append((name, t["dtype"], t["shape"], pattern_bytes(name, n)))
            weight_map[name] = file_name
            total += n
        write_safetensors(os.path.join(directory, file_name), tensors, spec.get("metadata"))
    if spec.get("index"):
        write_index(directory, weight_map, total)


if __name__ == "__main__":
    write_spec(json.loads(sys.argv[1]))
