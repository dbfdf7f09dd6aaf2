#!/usr/bin/python3
"""torch.load's items written by tessera and compares them with expectations.

    check_torch_items.py EXPECTED.json

EXPECTED.json: {"items": [{"path", "kind": "tensor", "dtype", "size", "requires_grad",
"values_hex"} or {"path", "kind": "bytes", "bytes_hex"}]}. Each file must also pass Python's
zipfile.testzip (every record's CRC-32). Prints "OK <n> items" and exits 0, or MISMATCH lines
and exits 1. Used by src/format/torch_dist/torch_zip_test.cc.
"""
import json
import os
import sys
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch113_compat  # noqa: E402,F401
import torch  # noqa: E402

from make_fixtures import dtype_name, raw_hex  # noqa: E402


def main():
    with open(sys.argv[1]) as f:
        expected = json.load(f)["items"]
    problems = []
    for e in expected:
        path = e["path"]
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
            if bad is not None:
                problems.append(f"{path}: zipfile finds a bad record {bad}")
        obj = torch.load(path)
        if e["kind"] == "tensor":
            got = {"dtype": dtype_name(obj.dtype), "size": list(obj.shape),
                   "requires_grad": obj.requires_grad, "values_hex": raw_hex(obj)}
            want = {k: e[k] for k in got}
            if got != want:
                problems.append(f"{path}: got {got}, expected {want}")
        elif not isinstance(obj, bytes) or obj.hex() != e["bytes_hex"]:
            problems.append(f"{path}: loaded {obj!r}, expected bytes {e['bytes_hex']}")
    for p in problems:
        print("MISMATCH", p)
    if problems:
        sys.exit(1)
    print(f"OK {len(expected)} items")


if __name__ == "__main__":
    main()
