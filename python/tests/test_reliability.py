"""Issue 11 (reliability), the Python side: bytes that are not UTF-8 in a checkpoint (item 6),
and the trust model of objects and the structure record (item 9)."""

import collections
import json
import os
import pickle
import struct
import subprocess

import numpy as np
import pytest

import tessera
from tessera import _tessera


def _newest_commit(path):
    """The name of the commit that holds the checkpoint at `path`: "tessera.manifest.<n>" with
    the highest n (docs/FORMAT.md, section 4); None when there is none."""
    commits = sorted(n for n in os.listdir(path) if n.startswith("tessera.manifest.")
                     and n.rsplit(".", 1)[1].isdigit()) if os.path.isdir(path) else []
    return commits[-1] if commits else None


def patch_manifest(path, old, new):
    """Replaces `old` by `new` (same length) in the manifest at checkpoint `path` and fixes its
    checksum, as a corrupt or foreign writer would leave it."""
    assert len(old) == len(new)
    manifest = os.path.join(path, _newest_commit(path))
    data = bytearray(open(manifest, "rb").read())
    at = data.find(old)
    assert at >= 0 and data.find(old, at + 1) < 0, f"{old!r} must appear once"
    data[at:at + len(old)] = new
    data[-8:] = struct.pack("<Q", _tessera._checksum(bytes(data[:-8])))
    open(manifest, "wb").write(bytes(data))


@pytest.fixture
def non_utf8(tmp_path):
    """Three checkpoints whose manifests hold a byte that is not UTF-8: in a user metadata
    value, in a tensor key, in an object key."""
    out = {}
    for what, old, new in [("metadata", b"caf\xc3\xa9", b"caf\xff\xa9"),
                           ("tensor", b"weight_\xc3\xa9", b"weight_\xff\xa9"),
                           ("object", b"blob_\xc3\xa9", b"blob_\xff\xa9")]:
        path = str(tmp_path / what)
        tessera.save({"weight_\u00e9": np.arange(6, dtype=np.float32), "blob_\u00e9": b"xy"},
                     path, user_metadata={"note": "caf\u00e9"})
        patch_manifest(path, old, new)
        out[what] = path
    return out


# ---- item 6 ----------------------------------------------------------------------------------

def test_non_utf8_checkpoint_raises_a_tessera_error_not_unicode_decode_error(non_utf8):
    # Before: read_metadata returned an object whose strings raised UnicodeDecodeError, and
    # load_all raised it.
    for what, path in non_utf8.items():
        for call in (tessera.read_metadata, tessera.load_all):
            with pytest.raises(tessera.CorruptCheckpointError, match="not valid UTF-8") as info:
                call(path)
            assert "\\xff" in str(info.value), what


def test_lenient_load_reports_non_utf8_keys_escaped(non_utf8):
    w = np.zeros(6, np.float32)
    report = tessera.load({"weight_\u00e9": w}, non_utf8["object"], strict=False)
    assert report.unexpected_keys == ["blob_\\xff\\xa9"]
    assert w.tolist() == list(range(6))
    # Strict: the error message quotes the key; it arrives escaped.
    with pytest.raises(tessera.InvalidArgumentError, match=r"blob_\\xff"):
        tessera.load({"weight_\u00e9": w}, non_utf8["object"])


def test_save_refuses_user_metadata_and_keys_that_are_not_utf8(ckpt):
    # A lone surrogate is how Python spells bytes that are not UTF-8 (os.fsdecode). Before: a
    # TypeError from pybind11 ("incompatible function arguments") that named nothing.
    for kwargs, state, what in [
            ({"user_metadata": {"k": "\udcff"}}, {"w": np.zeros(2)}, "user_metadata['k']"),
            ({"user_metadata": {"\udcff": "v"}}, {"w": np.zeros(2)}, "user_metadata key"),
            ({}, {"w\udcff": np.zeros(2)}, "key 'w\\udcff'"),
            ({}, {"w": tessera.ShardedObject(b"x", key="o\udcff")}, "key 'o\\udcff'")]:
        with pytest.raises(tessera.InvalidArgumentError, match="not valid UTF-8") as info:
            tessera.save(state, ckpt, **kwargs)
        assert what in str(info.value)
    assert _newest_commit(ckpt) is None


def test_cli_inspect_json_escapes_non_utf8_and_text_escapes_it(cli, non_utf8):
    # Before issue 11: `tessera inspect --json` aborted (rc 134) in nlohmann::json; then it
    # refused. Since issue 22 every JSON document prints, the bad bytes replaced by U+FFFD and
    # listed under "non_utf8" with their exact bytes (tools/json_output.h).
    for what, path in non_utf8.items():
        result = subprocess.run([cli, "inspect", "--json", path], capture_output=True,
                                timeout=60)
        assert result.returncode == 0, (what, result.returncode, result.stderr)
        doc = json.loads(result.stdout.decode("utf-8"))
        escaped = {e["bytes"] for e in doc["non_utf8"]}
        assert escaped & {"caf\\xff\\xa9", "weight_\\xff\\xa9", "blob_\\xff\\xa9"}, doc["non_utf8"]
        text = subprocess.run([cli, "inspect", path], capture_output=True, timeout=60)
        assert text.returncode == 0, text.stderr
        assert b"\xff" not in text.stdout and b"\\xff" in text.stdout
        assert "caf\u00e9".encode() in text.stdout or what == "metadata"


def test_exception_texts_escape_control_characters(ckpt):
    # Issue 22, defect 10: a hostile key's terminal escape sequences reached exception texts
    # raw (the tables escaped them). Now every tessera exception's text has them as \\xNN.
    key = "w\x1b]0;pwned\x07\x1b[31m"
    tessera.save({key: np.arange(1024, dtype=np.float32)}, ckpt)
    data = [os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".safetensors")][0]
    raw = bytearray(open(data, "rb").read())
    raw[-100] ^= 0x10
    open(data, "wb").write(bytes(raw))
    for call in (lambda: tessera.verify(ckpt), lambda: tessera.load_all(ckpt)):
        with pytest.raises(tessera.CorruptCheckpointError) as info:
            call()
        text = str(info.value)
        assert "\x1b" not in text and "\x07" not in text, repr(text)
        assert "w\\x1b]0;pwned\\x07\\x1b[31m" in text, text
    # Raised by the Python layer itself: the same.
    with pytest.raises(tessera.InvalidArgumentError) as info:
        tessera.load({"\x1b[2Jx": np.zeros(2)}, ckpt)
    assert "\x1b" not in str(info.value) and "\\x1b[2Jx" in str(info.value)


# ---- item 9 ----------------------------------------------------------------------------------

class _Boom:
    """Unpickling it runs code: it writes a marker file (what a hostile checkpoint could do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_objects_bytes_never_unpickles(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    marker = str(tmp_path / "pwned")
    Point = collections.namedtuple("Point", ["x", "y"])
    tessera.save({"w": np.arange(4, dtype=np.float32), "evil": _Boom(marker), "raw": b"\x01",
                  "p": Point(1, 2)}, ckpt)
    # The safe mode: nothing is unpickled, pickled objects come back as their bytes.
    state = tessera.load_all(ckpt, objects="bytes")
    assert not os.path.exists(marker)
    assert isinstance(state["evil"], bytes) and state["evil"].startswith(b"\x80")
    assert state["raw"] == b"\x01" and state["w"].tolist() == [0, 1, 2, 3]
    assert [pickle.loads(v) for v in state["p"]] == [1, 2]  # the pickles of the ints
    assert type(state["p"]).__name__ == "Point" and state["p"]._fields == ("x", "y")
    target = {"w": np.zeros(4, np.float32), "evil": None, "raw": b"", "p": Point(0, 0)}
    report = tessera.load(target, ckpt, objects="bytes")
    assert not os.path.exists(marker)
    assert isinstance(report.state_dict["evil"], bytes) and target["w"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="objects must be one of"):
        tessera.load_all(ckpt, objects="pickle-me")
    # The default unpickles, and so runs the checkpoint's code: what the docs warn about.
    tessera.load_all(ckpt)
    assert os.path.exists(marker)
    for function in (tessera.load_all, tessera.load):
        assert "Load only checkpoints you trust" in " ".join(function.__doc__.split())


def _with_structure(ckpt, text):
    """Rewrites the structure record of the checkpoint at `ckpt` to `text` (same length)."""
    old = json.dumps(json.loads(tessera.read_metadata(ckpt).user_metadata[tessera.STRUCTURE_KEY]),
                     separators=(",", ":")).encode()
    new = text.encode().ljust(len(old))
    assert len(new) == len(old), "the replacement must not be longer"
    patch_manifest(ckpt, old, new)


@pytest.mark.parametrize("text", [
    '{"version":1,"root":{"dict":[["w",{"tensor":"w"',   # not JSON
    '[1,2,3]',                                            # not an object
    '{"version":1}',                                      # no root
    '{"version":1,"root":{"dict":[["w"]]}}',              # an entry without a node
    '{"version":1,"root":{"dict":[["w",7]]}}',            # a node that is not an object
    '{"version":1,"root":{"tuple":5}}',                   # children that are not a list
    '{"version":1,"root":{"weird":[]}}',                  # an unknown node
    '{"version":1,"root":{"dict":[["w",{"tensor":"nope"}]]}}',  # a tensor that is not there
    '{"version":1,"root":{"dict":[]},"extra":[1]}',        # extra not an object
])
def test_malformed_structure_record_is_a_corrupt_checkpoint_error(ckpt, text):
    # Before: a raw json.JSONDecodeError (or KeyError, TypeError) out of load_all.
    tessera.save({"w": np.arange(4, dtype=np.float32), "s": b"pad" * 20}, ckpt)
    _with_structure(ckpt, text)
    with pytest.raises(tessera.CorruptCheckpointError, match="saved structure .* is malformed"):
        tessera.load_all(ckpt)


def test_resharded_load_catches_a_corrupt_byte_in_a_block_it_touches(tmp_path):
    """Issue 11.4: a load of part of a chunk checks the checksum blocks it reads, so a corrupt
    byte it does not itself need, in such a block, fails the load (and with checks off, loads)."""
    path = str(tmp_path / "ck")
    full = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)
    tessera.save({"m": full}, path, sync=False)

    def load_columns(**options):
        target = {"m": tessera.ShardedTensor(np.zeros((8, 4), np.int32), (8, 16), (0, 2))}
        tessera.load(target, path, **options)
        return target["m"].data

    np.testing.assert_array_equal(load_columns(), full[:, 2:6])
    [data_file] = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    with open(os.path.join(path, data_file), "r+b") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        [entry] = [v for k, v in header.items() if k != "__metadata__"]
        f.seek(8 + header_len + entry["data_offsets"][0] + (3 * 16 + 10) * 4)  # row 3, col 10
        f.write(b"\x7f")
    with pytest.raises(tessera.CorruptCheckpointError, match="checksum mismatch in key 'm'"):
        load_columns()
    with pytest.raises(tessera.CorruptCheckpointError):
        load_columns(verify_partial_chunks=True)
    np.testing.assert_array_equal(load_columns(verify_checksums=False), full[:, 2:6])
