#!/usr/bin/python3
"""Unpickles a torch 2.x flavoured .metadata with the stand-in classes of dcp2_standins.py
(registered under torch.distributed.checkpoint.*) and compares its content with expectations.

    check_dcp2_metadata.py METADATA_FILE EXPECTED.json

EXPECTED.json is in make_fixtures.describe_metadata's format. Prints "OK" and exits 0 on a
match, "MISMATCH ..." and exits 1 otherwise. Used by src/format/torch_dist/dcp_metadata_test.cc.
"""
import json
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch113_compat  # noqa: E402,F401

import dcp2_standins  # noqa: E402
from make_fixtures import describe_metadata  # noqa: E402


def main():
    dcp2_standins.install()
    with open(sys.argv[1], "rb") as f:
        meta = pickle.load(f)
    with open(sys.argv[2]) as f:
        expected = json.load(f)
    got = describe_metadata(meta)
    if type(meta) is not dcp2_standins.Metadata:
        print("MISMATCH class", type(meta))
        sys.exit(1)
    if got != expected:
        print("MISMATCH got", json.dumps(got, sort_keys=True))
        print("expected", json.dumps(expected, sort_keys=True))
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
