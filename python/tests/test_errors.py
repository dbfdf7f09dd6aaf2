"""Bad input and broken checkpoints raise the right exceptions, with the library's message;
nothing aborts the interpreter."""

import os

import numpy as np
import pytest
import torch

import tessera
from tessera import _tessera


@pytest.mark.parametrize("code, cls, builtin", [
    (1, tessera.InvalidArgumentError, ValueError),
    (2, tessera.NotFoundError, FileNotFoundError),
    (3, tessera.AlreadyExistsError, FileExistsError),
    (4, tessera.FailedPreconditionError, OSError),
    (5, tessera.InvalidArgumentError, ValueError),
    (6, tessera.CorruptCheckpointError, RuntimeError),
    (7, tessera.StorageError, OSError),
    (8, tessera.UnimplementedError, NotImplementedError),
    (9, tessera.InternalError, RuntimeError),
    (10, tessera.CommError, RuntimeError),
    (11, tessera.CommTimeoutError, TimeoutError),
])
def test_status_codes_map_to_exception_classes(code, cls, builtin):
    with pytest.raises(cls) as info:
        _tessera._raise_status(code, "the message")
    assert isinstance(info.value, builtin) and isinstance(info.value, tessera.Error)
    assert str(info.value) == "the message" and info.value.status_code == code
    assert info.type is cls


def test_not_found_of_keys_is_a_value_error():
    with pytest.raises(tessera.MissingKeysError) as info:
        _tessera._raise_status(2, "the checkpoint at /x has no key 'a'",
                               {"kind": 1, "keys": ["a"], "options": ["LoadOptions::missing_keys"]})
    assert isinstance(info.value, ValueError) and info.value.code == "NotFound"
    assert info.value.detail == tessera.ErrorDetail(kind="missing_keys", keys=("a",),
                                                    options=("missing_keys",))


def test_errors_map_by_fields_never_by_text():
    # The words of a missing key, without the detail: a NotFound of a file, as the code says.
    with pytest.raises(tessera.NotFoundError) as info:
        _tessera._raise_status(2, "the checkpoint at /x has no key 'a' (set "
                               "LoadOptions::missing_keys = kSkip to load the rest)")
    assert not isinstance(info.value, tessera.MissingKeysError) and info.value.detail is None
    assert "LoadOptions::missing_keys" in str(info.value)  # no detail names it: left as is
    # The advice is reworded from the detail's option and advice fields.
    with pytest.raises(tessera.InvalidArgumentError) as info:
        _tessera._raise_status(1, "key 'w': saved dtype F32, requested I32 (set it up)",
                               {"kind": 4, "keys": ["w"], "options": ["LoadOptions::cast_dtypes"],
                                "advice": "set it up"})
    assert str(info.value) == ("key 'w': saved dtype F32, requested I32 (pass cast_dtypes=True "
                               "to convert between float dtypes)")
    assert info.value.detail.kind == "dtype_mismatch"


def test_a_bad_option_is_named_as_the_argument(tmp_path):
    with pytest.raises(tessera.InvalidArgumentError) as info:
        tessera.save({"w": np.zeros(2, np.float32)}, tmp_path / "c", num_io_threads=-1)
    assert str(info.value).startswith("num_io_threads must be at least 1"), str(info.value)
    assert info.value.detail == tessera.ErrorDetail(kind="bad_option",
                                                    options=("num_io_threads",))


@pytest.fixture
def saved(ckpt):
    tessera.save({"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": 5}, ckpt)
    return ckpt


def test_missing_key(saved):
    with pytest.raises(tessera.MissingKeysError, match="has no key 'absent'") as info:
        tessera.load({"w": np.zeros((3, 4), np.float32), "step": 0, "absent": np.zeros(1)},
                     saved)
    # Python words: the argument to pass, no C++ option, no rank in a one-rank run.
    message = str(info.value)
    assert message.endswith("has no key 'absent' (pass strict=False to load the rest)"), message
    assert message.startswith("the checkpoint at "), message


def test_unexpected_key(saved):
    with pytest.raises(tessera.InvalidArgumentError, match="keys no rank asked for: 'step'") \
            as info:
        tessera.load({"w": np.zeros((3, 4), np.float32)}, saved)
    assert "(pass strict=False to load only the keys asked for)" in str(info.value)


def test_strict_false_loads_what_both_sides_have(saved):
    w = np.zeros((3, 4), np.float32)
    with pytest.warns(tessera.PartialLoadWarning) as warned:
        report = tessera.load({"w": w, "absent": np.full(2, 7.0)}, saved, strict=False)
    assert len(warned) == 1 and str(warned[0].message) == (
        "tessera.load(strict=False): 2 keys not loaded: 1 asked for but absent from the "
        "checkpoint ('absent'); 1 in the checkpoint but asked for by no rank ('step')")
    assert warned[0].filename == __file__  # points at the caller's line
    assert report.missing_keys == ["absent"] and report.unexpected_keys == ["step"]
    assert np.array_equal(w, np.arange(12, dtype=np.float32).reshape(3, 4))
    assert np.array_equal(report.state_dict["absent"], np.full(2, 7.0))


def test_nothing_is_written_when_the_load_fails(saved):
    w = np.full((3, 4), -1, np.float32)
    with pytest.raises(ValueError):
        tessera.load({"w": w, "step": 0, "absent": np.zeros(1)}, saved)
    assert (w == -1).all()


def test_dtype_and_shape_mismatch(saved):
    with pytest.raises(tessera.InvalidArgumentError, match="'w'.*dtype F32"):
        tessera.load({"w": np.zeros((3, 4), np.float64), "step": 0}, saved)
    with pytest.raises(tessera.InvalidArgumentError, match="'w'.*shape"):
        tessera.load({"w": np.zeros((3, 5), np.float32), "step": 0}, saved)


def _message(fn):
    with pytest.raises(tessera.Error) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("comm", [None, "single_rank"])
def test_one_rank_errors_speak_python_and_name_no_rank(saved, comm):
    """No C++ option names, no "rank 0: ... (1 of 1 ranks failed)", with or without a comm."""
    comm = tessera.single_rank_comm() if comm else None
    w = np.zeros((3, 4), np.float32)
    messages = {
        "shape": _message(lambda: tessera.load({"w": np.zeros((3, 5), np.float32), "step": 0},
                                               saved, comm=comm)),
        "partial": _message(lambda: tessera.save(
            {"w": tessera.ShardedTensor(w, (6, 4), (0, 0))}, saved + "2", comm=comm)),
        "replica": _message(lambda: tessera.save(
            {"w": tessera.ShardedTensor(w, replica_id=1)}, saved + "3", comm=comm)),
        "save_threads": _message(lambda: tessera.save({"w": w}, saved + "4", comm=comm,
                                                      num_io_threads=-1)),
        "load_threads": _message(lambda: tessera.load({"w": w, "step": 0}, saved, comm=comm,
                                                      num_io_threads=0)),
        "verify_threads": _message(lambda: tessera.verify(saved, 0)),
        "missing": _message(lambda: tessera.load({"w": w, "step": 0, "x": w}, saved, comm=comm)),
    }
    for name, message in messages.items():
        for cpp in ("Options::", "kSkip", "rank 0", "ranks failed"):
            assert cpp not in message, (name, message)
    assert "(pass allow_shape_mismatch=True to its ShardedTensor to load the common part)" in \
        messages["shape"]
    assert "(pass partial=True to its ShardedTensor if that is intended)" in messages["partial"]
    assert "has replica id [1] and nothing holds its main replica" in messages["replica"]
    assert "num_io_threads must be at least 1 (or 0 for the default), got -1" in \
        messages["save_threads"]
    assert messages["load_threads"] == "num_io_threads must be at least 1, got 0"
    assert messages["verify_threads"] == "num_threads must be at least 1, got 0"


def test_several_ranks_errors_name_the_rank(saved):
    def load(comm):
        state = {"w": np.zeros((3, 4), np.float32), "step": 0}
        if comm.rank == 1:
            state["x"] = np.zeros(1)
        tessera.load(state, saved, comm=comm)

    with pytest.raises(tessera.MissingKeysError) as info:
        tessera.run_local(2, load)
    assert str(info.value).startswith("rank 1: the checkpoint at ")
    assert str(info.value).endswith("has no key 'x' (pass strict=False to load the rest) "
                                    "(1 of 2 ranks failed)")


def test_allow_shape_mismatch_loads_the_common_part(saved):
    w = np.full((4, 4), -1, np.float32)  # e.g. a padded vocabulary
    report = tessera.load({"w": tessera.ShardedTensor(w, allow_shape_mismatch=True), "step": 0},
                          saved)
    assert report.shape_mismatched_keys == ["w"]
    assert np.array_equal(w[:3], np.arange(12, dtype=np.float32).reshape(3, 4))
    assert (w[3] == -1).all()


def test_missing_checkpoint_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tessera.load({"w": np.zeros(1)}, str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError):
        tessera.read_metadata(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError):
        tessera.load_all(tmp_path / "nothing")


def test_directory_without_manifest(tmp_path):
    with pytest.raises(tessera.FailedPreconditionError, match="no committed checkpoint") as info:
        tessera.verify(str(tmp_path))
    assert isinstance(info.value, OSError)


def test_save_under_a_regular_file(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(OSError):
        tessera.save({"w": np.zeros(2)}, str(tmp_path / "file" / "ckpt"))


def data_files(path):
    return [f.name for f in tessera.read_metadata(path).files]


def test_corrupt_chunk(saved):
    metadata = tessera.read_metadata(saved)
    location = metadata.find_tensor("w").chunks[0].location
    name = metadata.files[location.file_index].name
    with open(os.path.join(saved, name), "r+b") as f:
        f.seek(location.offset + 5)
        byte = f.read(1)
        f.seek(location.offset + 5)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(tessera.CorruptCheckpointError, match="checksum mismatch.*'w'") as info:
        tessera.verify(saved)
    assert isinstance(info.value, RuntimeError) and info.value.code == "DataLoss"
    # Where, as fields: the file and the offset of the block whose bytes differ.
    assert info.value.detail.kind == "corruption"
    assert info.value.detail.file.endswith(name) and info.value.detail.offset == location.offset
    with pytest.raises(tessera.CorruptCheckpointError) as info:
        tessera.load({"w": np.zeros((3, 4), np.float32), "step": 0}, saved)
    assert info.value.detail.kind == "corruption" and info.value.detail.keys == ("w",)
    assert info.value.detail.file.endswith(name)


def test_missing_data_file(saved):
    for name in data_files(saved):
        os.remove(os.path.join(saved, name))
    with pytest.raises(tessera.CorruptCheckpointError, match="missing"):
        tessera.load_all(saved)


def test_truncated_manifest(saved):
    # The commit that holds the checkpoint: "tessera.manifest.<n>" (docs/FORMAT.md, section 4),
    # beside the hint "tessera.latest" that only says where to start looking.
    manifest = [n for n in os.listdir(saved)
                if n.startswith("tessera.manifest.") and n.rsplit(".", 1)[1].isdigit()]
    assert len(manifest) == 1, os.listdir(saved)
    path = os.path.join(saved, manifest[0])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(tessera.CorruptCheckpointError):
        tessera.read_metadata(saved)


def test_non_contiguous_tensors(ckpt):
    with pytest.raises(ValueError, match="'t'.*not contiguous"):
        tessera.save({"t": torch.zeros(3, 4).t()}, ckpt)
    with pytest.raises(ValueError, match="'a'.*not contiguous"):
        tessera.save({"a": np.zeros((4, 4))[:, ::2]}, ckpt)
    with pytest.raises(ValueError, match="'a'.*not contiguous"):
        tessera.save({"a": np.asfortranarray(np.zeros((3, 4)))}, ckpt)
    # Non-contiguous strides on dimensions of size 1 do not matter.
    tessera.save({"a": np.zeros((4, 4))[:1, :], "t": torch.zeros(3, 1).t()}, ckpt)


def test_read_only_array_cannot_be_loaded_into(ckpt):
    a = np.ones(3)
    tessera.save({"a": a}, ckpt)
    a.flags.writeable = False
    with pytest.raises(ValueError, match="'a'.*read-only"):
        tessera.load({"a": a}, ckpt)


def test_unsupported_tensors(ckpt):
    with pytest.raises(ValueError, match="'c'.*complex128"):
        tessera.save({"c": np.zeros(2, dtype=np.complex128)}, ckpt)
    with pytest.raises(ValueError, match="'c'.*complex64"):
        tessera.save({"c": torch.zeros(2, dtype=torch.complex64)}, ckpt)
    with pytest.raises(ValueError, match="'m'.*meta"):
        tessera.save({"m": torch.empty(2, device="meta")}, ckpt)
    with pytest.raises(ValueError, match="'s'.*layout"):
        tessera.save({"s": torch.zeros(2, 2).to_sparse()}, ckpt)
    with pytest.raises(ValueError, match="'b'.*byte order|'b'.*>f4"):
        tessera.save({"b": np.zeros(2, dtype=">f4")}, ckpt)
    with pytest.raises(ValueError, match="cannot hold dtype BF16"):
        tessera.save({"w": tessera.ShardedTensor(np.zeros(2, np.float32), dtype="BF16")}, ckpt)
    with pytest.raises(ValueError, match="unknown tessera dtype"):
        tessera.ShardedTensor(np.zeros(2), dtype="F128")


def test_bad_state_dicts(ckpt):
    with pytest.raises(TypeError, match="must be a dict, list or tuple"):
        tessera.save(np.zeros(2), ckpt)
    with pytest.raises(ValueError, match="dict key"):
        tessera.save({("a", 1): np.zeros(2)}, ckpt)
    with pytest.raises(ValueError, match="duplicate key 'a.b'"):
        tessera.save({"a.b": np.zeros(1), "a": {"b": np.zeros(1)}}, ckpt)
    with pytest.raises(ValueError, match="object 'f'.*pickle"):
        tessera.save({"f": lambda: 1}, ckpt)
    with pytest.raises(ValueError, match="outside the global shape"):
        tessera.save({"w": tessera.ShardedTensor(np.zeros(3), (4,), (2,))}, ckpt)
    with pytest.raises(ValueError, match="flat range"):
        tessera.save({"w": tessera.ShardedTensor(np.zeros(3), (4,), flat_range=(0, 2),
                                                 local_shape=(4,))}, ckpt)
    with pytest.raises(ValueError, match="cover"):
        tessera.save({"w": tessera.ShardedTensor(np.zeros(3), (4,))}, ckpt)
    with pytest.raises(OSError):
        tessera.read_metadata(ckpt)


def test_bad_arguments(ckpt):
    with pytest.raises(TypeError, match="unexpected keyword argument 'fsync'"):
        tessera.save({"w": np.zeros(2)}, ckpt, fsync=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'strict_shapes'"):
        tessera.load({"w": np.zeros(2)}, ckpt, strict_shapes=False)
    with pytest.raises(TypeError, match="comm must be a tessera.Comm"):
        tessera.save({"w": np.zeros(2)}, ckpt, comm=object())
    with pytest.raises(ValueError, match="reserved"):
        tessera.save({"w": np.zeros(2)}, ckpt, user_metadata={tessera.STRUCTURE_KEY: "x"})
    with pytest.raises(TypeError):
        tessera.save({"w": np.zeros(2)}, ckpt, user_metadata={"step": 3})
    with pytest.raises(ValueError, match="num_io_threads"):
        tessera.save({"w": np.zeros(2)}, ckpt, num_io_threads=-1)
    with pytest.raises(ValueError, match="sync must be one of"):
        tessera.save({"w": np.zeros(2)}, ckpt, sync="sometimes")
    with pytest.raises(TypeError):
        tessera.save({"w": np.zeros(2)}, ckpt, num_io_threads="two")
    with pytest.raises(ValueError, match="when_busy"):
        tessera.async_save({"w": np.zeros(2)}, ckpt, when_busy="never")


def test_not_a_pickle_in_an_object_placeholder(ckpt):
    tessera.save({"raw": b"\x00not a pickle"}, ckpt)
    with pytest.raises(ValueError, match="'raw'.*not a pickle"):
        tessera.load({"raw": None}, ckpt)
    assert tessera.load({"raw": b""}, ckpt).state_dict["raw"] == b"\x00not a pickle"


def test_interpreter_survives_errors_in_rank_functions(ckpt):
    def fn(comm):
        if comm.rank == 1:
            raise KeyError("rank 1 failed")
        tessera.save({"w": np.zeros(2)}, ckpt, comm=comm)

    with pytest.raises(KeyError, match="rank 1 failed") as info:
        tessera.run_local(3, fn)
    assert "rank 1 of 3" in info.value.__notes__[0]
    with pytest.raises(OSError):  # no checkpoint was committed
        tessera.read_metadata(ckpt)


def test_collective_failure_on_one_rank_fails_every_rank(ckpt):
    def fn(comm):
        data = np.zeros(2) if comm.rank == 0 else np.zeros(3)  # shapes disagree
        tessera.save({"w": data}, ckpt, comm=comm)

    with pytest.raises(tessera.InvalidArgumentError, match="'w'.*global shape"):
        tessera.run_local(2, fn)
    with pytest.raises(FileNotFoundError):
        tessera.read_metadata(ckpt)


def test_bad_input_on_one_rank_fails_every_rank(ckpt):
    """Found by the Python layer on rank 1 before any collective: every rank learns of it."""
    def fn(comm):
        w = np.zeros((4, 4)).T if comm.rank == 1 else np.zeros((4, 4))
        try:
            tessera.save({"w": w}, ckpt, comm=comm)
        except ValueError as e:
            return type(e).__name__, str(e)
        return None

    results = tessera.run_local(3, fn)
    assert results[1][0] == "InvalidArgumentError" and "not contiguous" in results[1][1]
    for r in (0, 2):
        assert results[r][0] == "InvalidArgumentError"
        assert results[r][1].startswith("rank 1: tensor 'w'") and "not contiguous" in results[r][1]

    def load(comm):
        state = {"w": np.zeros(2)} if comm.rank == 0 else {("bad", "key"): np.zeros(2)}
        with pytest.raises(ValueError, match="dict key"):
            tessera.load(state, ckpt, comm=comm)

    tessera.run_local(2, load)


def test_a_comm_outlives_its_rank_function():
    comms = tessera.run_local(2, lambda comm: comm)
    with pytest.raises(RuntimeError, match="run_local"):
        comms[0].barrier()
    assert "finished" in repr(comms[1])


def test_errors_of_a_python_comm_become_comm_errors(ckpt):
    class Broken:
        rank, size = 0, 1

        def all_gather(self, data):
            raise ConnectionError("link down")

        def __getattr__(self, name):
            raise ConnectionError("link down")

    comm = tessera.python_comm(Broken())
    with pytest.raises(tessera.CommError, match="python comm .*ConnectionError: link down"):
        tessera.save({"w": np.zeros(2)}, ckpt, comm=comm)
    with pytest.raises(ValueError, match="not a valid rank"):
        tessera.python_comm(type("Bad", (), {"rank": 2, "size": 2})())
