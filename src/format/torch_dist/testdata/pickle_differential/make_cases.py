#!/usr/bin/env python3
"""Crafted pickles and what Python's unpickler makes of them (issue 30, item 8).

Writes NAME.pkl for each case and cases.json: per case its file, Python's `pickle.loads` result
rendered as text (render(), which the C++ test, PickleDifferentialTest in pickle_test.cc,
mirrors over tessera's tree), and whether the pickle sets one key or attribute twice (by
construction). tessera must read each pickle as Python does, or refuse it naming the key: a
pickle that sets a key twice means its last value to Python. The pickles are also copied into
fuzz/corpus/pickle/ as seeds.

Run from anywhere: python3 make_cases.py (the outputs are checked in; rerun after a change).
"""

import json
import os
import pickle
import shutil
import struct
from typing import Any, Callable, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "..", "..", "..", "..", "fuzz", "corpus", "pickle")


def s(text: str) -> bytes:
    """BINUNICODE of `text`."""
    data = text.encode("utf-8")
    return b"X" + struct.pack("<I", len(data)) + data


def i(v: int) -> bytes:
    """BININT1 (0..255)."""
    return b"K" + bytes([v])


def f(v: float) -> bytes:
    """BINFLOAT."""
    return b"G" + struct.pack(">d", v)


def b(data: bytes) -> bytes:
    """SHORT_BINBYTES (protocol 3)."""
    return b"C" + bytes([len(data)]) + data


PROTO = b"\x80\x04"
NAMESPACE = b"cargparse\nNamespace\n)\x81"  # argparse.Namespace.__new__(Namespace)


def render(v: Any) -> str:
    """Python's value as text: what the C++ test renders tessera's tree as."""
    if v is None:
        return "None"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "f" + format(v, ".17g")
    if isinstance(v, str):
        return "s" + v.encode("utf-8").hex()
    if isinstance(v, bytes):
        return "b" + v.hex()
    if isinstance(v, list):
        return "[" + ",".join(render(x) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + ",".join(render(x) for x in v) + ")"
    if isinstance(v, (set, frozenset)):
        return "{" + ",".join(sorted(render(x) for x in v)) + "}"
    if isinstance(v, dict):
        return "{" + ",".join(render(k) + ":" + render(x) for k, x in v.items()) + "}"
    cls = type(v)
    return "obj(" + cls.__module__ + "." + cls.__qualname__ + "," + render(vars(v)) + ")"


# name -> (opcodes between PROTO and STOP, sets a key twice)
CASES: Dict[str, Tuple[bytes, bool]] = {
    # One SETITEMS naming "a" twice: Python keeps the last value.
    "dup_key_setitems": (b"}(" + s("a") + i(1) + s("b") + i(3) + s("a") + i(2) + b"u", True),
    # SETITEM three times, "a" twice.
    "dup_key_setitem": (b"}" + s("a") + i(1) + b"s" + s("b") + i(3) + b"s" + s("a") + i(2) + b"s",
                        True),
    # The dict memoized, then a second SETITEMS through the memo names "a" again.
    "dup_key_through_memo": (b"}q\x00(" + s("a") + i(1) + b"u0h\x00(" + s("a") + i(2) + b"u",
                             True),
    # 1 == True == 1.0 in Python: one key.
    "dup_key_int_bool": (b"}(" + i(1) + s("x") + b"\x88" + s("y") + b"u", True),
    "dup_key_int_float": (b"}(" + i(1) + s("x") + f(1.0) + s("y") + b"u", True),
    # A set holding one item twice: one item to Python.
    "dup_set_item": (b"\x8f(" + i(7) + i(7) + b"\x90", True),
    # A BUILD state dict naming an attribute twice.
    "dup_build_attr": (NAMESPACE + b"}(" + s("x") + i(1) + s("x") + i(2) + b"ub", True),
    # Two BUILDs of one object: Python applies both, the second's x wins.
    "dup_build_twice": (NAMESPACE + b"}(" + s("x") + i(1) + b"ub}(" + s("x") + i(2) + b"ub", True),
    # A (dict, slots) state naming x in both: the slots value wins (setattr after the dict).
    "dup_build_dict_and_slots": (
        NAMESPACE + b"}(" + s("x") + i(1) + b"u}(" + s("x") + i(2) + b"u\x86b", True),
    # What must read as Python reads it.
    "plain_dict": (b"}(" + s("a") + i(1) + s("b") + i(2) + b"u", False),
    "str_and_bytes_keys": (b"}(" + s("a") + i(1) + b(b"a") + i(2) + b"u", False),
    "int_and_str_keys": (b"}(" + i(1) + s("x") + s("1") + s("y") + b"u", False),
    "float_keys": (b"}(" + f(0.5) + s("x") + f(1.5) + s("y") + b"u", False),
    # A memoized dict appended twice, then mutated through the memo: both references see it.
    "memo_shared_mutation": (b"](}q\x00h\x00eh\x00" + s("k") + i(7) + b"s0", False),
    "memo_reuse_in_tuple": (s("shared") + b"q\x01h\x01h\x01\x87", False),
    "set_items": (b"\x8f(" + i(3) + i(1) + i(2) + b"\x90", False),
    "build_attrs": (NAMESPACE + b"}(" + s("x") + i(1) + s("y") + i(2) + b"ub", False),
    "build_dict_and_slots": (NAMESPACE + b"}(" + s("x") + i(1) + b"u}(" + s("y") + i(2) + b"u\x86b",
                             False),
    "nested": (b"}(" + s("outer") + b"}(" + s("inner") + b"](" + i(1) + i(2) + b"eu" + s("t") +
               i(4) + i(5) + b"\x86u", False),
}


def main() -> None:
    cases: List[Dict[str, Any]] = []
    os.makedirs(CORPUS, exist_ok=True)
    for name, (body, sets_twice) in CASES.items():
        data = PROTO + body + b"."
        value = pickle.loads(data)
        path = os.path.join(HERE, name + ".pkl")
        with open(path, "wb") as out:
            out.write(data)
        shutil.copyfile(path, os.path.join(CORPUS, "differential_" + name))
        cases.append({"name": name, "file": name + ".pkl", "python": render(value),
                      "sets_a_key_twice": sets_twice})
    with open(os.path.join(HERE, "cases.json"), "w") as out:
        json.dump(cases, out, indent=1)
        out.write("\n")


if __name__ == "__main__":
    main()
