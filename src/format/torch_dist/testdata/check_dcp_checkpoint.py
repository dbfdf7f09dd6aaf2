#!/usr/bin/python3
"""Loads a DCP checkpoint with torch 1.13's own reader and compares it with expectations.

    check_dcp_checkpoint.py CKPT_DIR EXPECTED.json

EXPECTED.json: {"metadata": <make_fixtures.describe_metadata format>,
                "state_dict": {fqn: {"kind": "tensor", "dtype", "size", "values_hex"} or
                                    {"kind": "bytes", "bytes_hex"}}}
The .metadata is unpickled by pickle.load (torch's classes), the state dict is loaded with
torch.distributed._shard.checkpoint.load_state_dict(no_dist=True) into zero tensors of the
expected dtypes and shapes. Prints "OK <n> entries" and exits 0 when everything matches;
prints MISMATCH lines and exits 1 otherwise. Used by src/format/torch_dist/dcp_metadata_test.cc.
"""
import json
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch113_compat  # noqa: E402,F401
import torch  # noqa: E402
from torch.distributed._shard import checkpoint as dcp  # noqa: E402

from make_fixtures import describe_metadata, raw_hex  # noqa: E402


def main():
    ckpt, expected_path = sys.argv[1], sys.argv[2]
    with open(expected_path) as f:
        expected = json.load(f)
    problems = []
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    got = describe_metadata(meta)
    if got != expected["metadata"]:
        problems.append(f"metadata: got {json.dumps(got, sort_keys=True)}\n"
                        f"expected {json.dumps(expected['metadata'], sort_keys=True)}")
    sd = {}
    for fqn, e in expected["state_dict"].items():
        if e["kind"] == "tensor":
            sd[fqn] = torch.zeros(e["size"], dtype=getattr(torch, e["dtype"]))
        else:
            sd[fqn] = b""
    dcp.load_state_dict(sd, dcp.FileSystemReader(ckpt), no_dist=True)
    for fqn, e in expected["state_dict"].items():
        v = sd[fqn]
        if e["kind"] == "tensor":
            if raw_hex(v) != e["values_hex"]:
                problems.append(f"{fqn}: values {raw_hex(v)[:80]} != {e['values_hex'][:80]}")
        elif not isinstance(v, bytes) or v.hex() != e["bytes_hex"]:
            problems.append(f"{fqn}: loaded {v!r}, expected bytes {e['bytes_hex']}")
    for p in problems:
        print("MISMATCH", p)
    if problems:
        sys.exit(1)
    print(f"OK {len(expected['state_dict'])} entries")


if __name__ == "__main__":
    main()
