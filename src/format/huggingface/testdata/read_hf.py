#!/usr/bin/env python3
"""An independent reader of a Hugging Face safetensors checkpoint directory, with the Python
standard library only: model.safetensors.index.json and its shards, or one model.safetensors.
Checks what transformers relies on and prints one JSON document:

    {"files": [names], "index": {"metadata": ..., "weight_map": ...} or null,
     "tensors": {name: {"dtype", "shape", "file", "hex"}}}

Checks: each file's header (8-byte length, JSON object, entries back to back from offset 0 to
the end of the file, sizes matching dtype and shape); with an index, every tensor of the
weight map is in the file it names, every tensor of every file is in the weight map, and
total_size is the sum of the tensors' bytes; without one, exactly one model.safetensors.
Exit status 0 when all holds, 1 with a message otherwise.

Usage: read_hf.py DIR
"""

import json
import os
import struct
import sys

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
    "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8,
}


def fail(message):
    print(message, file=sys.stderr)
    sys.exit(1)


def read_file(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"])
    pos = 0
    out = {}
    for name, e in entries:
        begin, end = e["data_offsets"]
        size = DTYPE_SIZES[e["dtype"]]
        for d in e["shape"]:
            size *= d
        if begin != pos or end - begin != size:
            fail(f"{path}: entry {name}: offsets {begin}, {end} (expected {pos}, {pos + size})")
        out[name] = {"dtype": e["dtype"], "shape": e["shape"], "hex": data[begin:end].hex()}
        pos = end
    if pos != len(data):
        fail(f"{path}: entries end at {pos}, the data section has {len(data)} bytes")
    return out


def main(directory):
    names = sorted(os.listdir(directory))
    tensors = {}
    index = None
    if "model.safetensors.index.json" in names:
        index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
        files = sorted(set(index["weight_map"].values()))
        total = 0
        for f in files:
            for name, t in read_file(os.path.join(directory, f)).items():
                if index["weight_map"].get(name) != f:
                    fail(f"{f} holds {name}, which the weight map puts in "
                         f"{index['weight_map'].get(name)}")
                t["file"] = f
                tensors[name] = t
                total += len(t["hex"]) // 2
        if set(tensors) != set(index["weight_map"]):
            fail(f"the weight map names tensors no file holds: "
                 f"{sorted(set(index['weight_map']) - set(tensors))}")
        if index["metadata"]["total_size"] != total:
            fail(f"total_size {index['metadata']['total_size']}, the tensors have {total} bytes")
    else:
        files = [n for n in names if n.endswith(".safetensors")]
        if files != ["model.safetensors"]:
            fail(f"without an index, expected model.safetensors alone, found {files}")
        for name, t in read_file(os.path.join(directory, "model.safetensors")).items():
            t["file"] = "model.safetensors"
            tensors[name] = t
    print(json.dumps({"files": files, "index": index, "tensors": tensors}))


if __name__ == "__main__":
    main(sys.argv[1])
