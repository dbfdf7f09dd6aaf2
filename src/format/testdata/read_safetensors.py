#!/usr/bin/env python3
"""An independent reader of one tessera data file, using the Python standard library only.

Checks the safetensors rules of docs/FORMAT.md section 2 and compares each entry's bytes with
the expectations in a JSON file. Used by src/format/format_test.cc; also handy by hand:

    read_safetensors.py FILE                  # check the file, list its entries
    read_safetensors.py FILE EXPECTED.json    # ... and compare with EXPECTED

EXPECTED.json: {"metadata": {...}, "entries": [{"name", "dtype", "shape", "hex"}, ...]} in
data order. Exit status 0 when everything holds, 1 (with a message) otherwise.
"""
import json
import struct
import sys

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8,
}
ALIGNMENT = 4096
MAX_HEADER = 100_000_000


class Invalid(Exception):
    pass


def no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise Invalid(f"duplicate key {k!r}")
        out[k] = v
    return out


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise Invalid(f"{len(blob)} bytes, fewer than the 8-byte header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER:
        raise Invalid(f"header length {n} over the limit")
    if 8 + n > len(blob):
        raise Invalid(f"header length {n} runs past the end of the file ({len(blob)} bytes)")
    raw = blob[8:8 + n]
    if not raw.startswith(b"{"):
        raise Invalid("header does not start with '{'")
    text = raw.decode("utf-8")  # strict: raises on invalid UTF-8
    body = text.rstrip(" ")
    if not body.endswith("}"):
        raise Invalid("header is not a JSON object padded with spaces")
    header = json.loads(body, object_pairs_hook=no_duplicates)
    if not isinstance(header, dict):
        raise Invalid("header is not an object")
    # tessera's writer: data starts on a 4096-byte boundary.
    data_start = 8 + n
    if data_start % ALIGNMENT:
        raise Invalid(f"data starts at {data_start}, not a multiple of {ALIGNMENT}")

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise Invalid("__metadata__ is not a string -> string map")

    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or sorted(info) != ["data_offsets", "dtype", "shape"]:
            raise Invalid(f"entry {name!r}: fields {sorted(info) if isinstance(info, dict) else info}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise Invalid(f"entry {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise Invalid(f"entry {name!r}: bad shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or
                not all(isinstance(o, int) and o >= 0 for o in offsets)):
            raise Invalid(f"entry {name!r}: bad data_offsets {offsets!r}")
        count = 1
        for d in shape:
            count *= d
        begin, end = offsets
        if end - begin != count * DTYPE_SIZES[dtype]:
            raise Invalid(f"entry {name!r}: data_offsets {offsets} do not match {dtype} {shape}")
        entries.append((begin, end, name, dtype, shape))

    pos = 0
    for begin, end, name, _, _ in sorted(entries):
        if begin != pos:
            raise Invalid(f"entry {name!r}: starts at {begin}, expected {pos} (hole or overlap)")
        pos = end
    if data_start + pos != len(blob):
        raise Invalid(f"entries end at {data_start + pos}, file has {len(blob)} bytes")

    result = []
    for begin, end, name, dtype, shape in entries:  # header order
        result.append({"name": name, "dtype": dtype, "shape": shape,
                       "hex": blob[data_start + begin:data_start + end].hex()})
    return metadata, result


def main(argv):
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        metadata, entries = read(argv[1])
    except (Invalid, ValueError) as e:
        print(f"{argv[1]}: INVALID: {e}")
        return 1
    for e in entries:
        print(f"{e['name']!r} {e['dtype']} {e['shape']} {len(e['hex']) // 2} bytes")
    if len(argv) == 3:
        with open(argv[2], encoding="utf-8") as f:
            expected = json.load(f)
        if metadata != expected.get("metadata", {}):
            print(f"MISMATCH: metadata {metadata!r} != expected {expected.get('metadata')!r}")
            return 1
        if len(entries) != len(expected["entries"]):
            print(f"MISMATCH: {len(entries)} entries, expected {len(expected['entries'])}")
            return 1
        for got, want in zip(entries, expected["entries"]):
            for field in ("name", "dtype", "shape", "hex"):
                if got[field] != want[field]:
                    print(f"MISMATCH: entry {want['name']!r} field {field}: "
                          f"{got[field]!r} != expected {want[field]!r}")
                    return 1
    print(f"OK {len(entries)} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
