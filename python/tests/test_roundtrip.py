"""Single-process round trips: every dtype, every container, load in place, load_all."""

import collections
import json

import numpy as np
import pytest
import torch

import tessera
from conftest import raw_bytes

Point = collections.namedtuple("Point", "x y")

NUMPY_DTYPES = ["float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8",
                "uint16", "uint32", "uint64", "bool"]
TORCH_DTYPES = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool"]
TESSERA_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                 "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int64": "I64",
                 "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16",
                 "uint32": "U32", "uint64": "U64", "bool": "BOOL"}


def random_numpy(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    # Random bits: every pattern round-trips, NaNs and infinities included.
    n = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(rng.bytes(n), dtype=dtype).reshape(shape).copy()


def random_torch(dtype, shape, seed=0):
    if dtype == torch.bool:
        return torch.from_numpy(random_numpy("bool", shape, seed))
    size = torch.empty((), dtype=dtype).element_size()
    ints = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
    bits = torch.from_numpy(random_numpy(ints[size], shape, seed))
    return bits.view(dtype)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_dtype_round_trip(ckpt, dtype):
    saved = {"a": random_numpy(dtype, (3, 5)), "scalar": random_numpy(dtype, ()),
             "empty": np.zeros((0, 4), dtype=dtype)}
    tessera.save(saved, ckpt)
    info = tessera.read_metadata(ckpt).find_tensor("a")
    assert info.dtype == TESSERA_NAMES[dtype] and info.shape == [3, 5]
    loaded = {k: np.zeros_like(v) for k, v in saved.items()}
    report = tessera.load(loaded, ckpt)
    assert report.state_dict is loaded
    for k in saved:
        assert loaded[k].dtype == saved[k].dtype and loaded[k].shape == saved[k].shape
        assert raw_bytes(loaded[k]) == raw_bytes(saved[k]), k
    again = tessera.load_all(ckpt)
    for k in saved:
        assert type(again[k]) is np.ndarray and again[k].dtype == saved[k].dtype
        assert raw_bytes(again[k]) == raw_bytes(saved[k])


# torch 1.13 (the legacy run) lacks the float8 and the wide unsigned types: those run under
# torch 2.x only, and the test below keeps the list from shrinking there unnoticed.
TORCH_DTYPES_HERE = [name for name in TORCH_DTYPES if hasattr(torch, name)]


def test_torch_2_has_every_dtype_tessera_maps():
    if int(torch.__version__.split(".")[0]) >= 2:
        assert TORCH_DTYPES_HERE == TORCH_DTYPES, torch.__version__


@pytest.mark.parametrize("name", TORCH_DTYPES_HERE)
def test_torch_dtype_round_trip(ckpt, name):
    dtype = getattr(torch, name)
    saved = {"t": random_torch(dtype, (4, 6)), "scalar": random_torch(dtype, ()),
             "empty": torch.zeros((2, 0), dtype=dtype)}
    tessera.save(saved, ckpt)
    assert tessera.read_metadata(ckpt).find_tensor("t").dtype == TESSERA_NAMES[name]
    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    tessera.load(loaded, ckpt)
    for k in saved:
        assert loaded[k].dtype == dtype and loaded[k].shape == saved[k].shape
        assert raw_bytes(loaded[k]) == raw_bytes(saved[k]), k
    again = tessera.load_all(ckpt)
    for k in saved:
        assert type(again[k]) is torch.Tensor and again[k].dtype == dtype
        assert raw_bytes(again[k]) == raw_bytes(saved[k])


def test_load_writes_into_the_callers_memory(ckpt):
    saved = {"t": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
             "a": np.arange(6, dtype=np.float32)}
    tessera.save(saved, ckpt)
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    a = np.zeros(6, dtype=np.float32)
    t_ptr, a_ptr = t.data_ptr(), a.ctypes.data
    state = {"t": t, "a": a}
    tessera.load(state, ckpt)
    assert state["t"] is t and state["a"] is a
    assert t.data_ptr() == t_ptr and a.ctypes.data == a_ptr
    assert torch.equal(t, saved["t"]) and np.array_equal(a, saved["a"])
    # A view into a bigger buffer (contiguous): only its elements are written.
    big = torch.full((5, 4), -1.0, dtype=torch.bfloat16)
    tessera.load({"t": big[1:4], "a": a}, ckpt)
    assert torch.equal(big[1:4], saved["t"])
    assert (big[0] == -1).all() and (big[4] == -1).all()


def nested_state():
    return {
        "model": collections.OrderedDict(
            [("layers.0.weight", torch.randn(4, 3)), ("layers.0.bias", torch.randn(4))]),
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)},
                      1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4)}},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "list": [np.arange(3), [np.ones((2, 2), dtype=np.float16), "text"], ()],
        "tuple": (np.int64(5), None, {"deep": np.zeros(2, dtype=np.int8)}),
        "point": Point(np.arange(2.0), "y"),
        "empty_dict": {},
        "empty_list": [],
        "raw": b"\x00\x01\xff",
        "raw_mutable": bytearray(b"abc"),
        "rng": np.random.default_rng(1).bit_generator.state,
        "step": 1000,
        "zero_d": np.array(7.5),
    }


def assert_same(a, b, path="root"):
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
    else:
        assert a == b, path


def test_nested_containers_come_back_with_their_types(ckpt):
    saved = nested_state()
    tessera.save(saved, ckpt)
    keys = {t.key for t in tessera.read_metadata(ckpt).tensors}
    assert {"model.layers.0.weight", "optimizer.state.0.exp_avg", "list.1.0",
            "tuple.2.deep", "point.0", "zero_d"} <= keys
    assert_same(tessera.load_all(ckpt), saved)


def test_structure_is_json_in_user_metadata(ckpt):
    tessera.save({"a": [np.ones(2), 3]}, ckpt, user_metadata={"step": "7"})
    metadata = tessera.read_metadata(ckpt).user_metadata
    assert metadata["step"] == "7"
    structure = json.loads(metadata[tessera.STRUCTURE_KEY])
    assert structure == {"version": 1, "root": {"dict": [["a", {"list": [
        {"tensor": "a.0", "lib": "numpy"}, {"object": "a.1", "encoding": "pickle"}]}]]}}


def test_load_into_placeholders_replaces_objects(ckpt):
    saved = nested_state()
    tessera.save(saved, ckpt)
    target = nested_state()
    for t in [target["model"]["layers.0.weight"], target["optimizer"]["state"][0]["exp_avg"]]:
        t.zero_()
    target["step"] = None
    target["raw"] = b""
    target["raw_mutable"] = bytearray()
    target["tuple"] = (None, None, {"deep": np.full(2, 9, dtype=np.int8)})
    target["list"][1][1] = None
    target["optimizer"]["param_groups"][0]["lr"] = None
    target["optimizer"]["param_groups"][0]["betas"] = (None, None)
    report = tessera.load(target, ckpt)
    assert report.state_dict is target
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert_same(target, saved)


def test_root_tuple_comes_back_in_the_report(ckpt):
    tessera.save((np.arange(3), "meta"), ckpt)
    target = (np.zeros(3, dtype=np.int64), None)
    report = tessera.load(target, ckpt)
    assert np.array_equal(target[0], np.arange(3))  # in place
    assert report.state_dict[1] == "meta" and target[1] is None
    assert_same(tessera.load_all(ckpt), (np.arange(3), "meta"))


def test_torch_module_and_optimizer(ckpt):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    tessera.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, ckpt)

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = {"model": fresh.state_dict()}  # views of the parameters: loads in place
    # Every leaf of the optimizer's state dict is a key no one asks for (how many depends on
    # the torch version: its Adam's hyperparameters).
    unasked = sorted(k for k in [t.key for t in tessera.read_metadata(ckpt).tensors] +
                     [o.key for o in tessera.read_metadata(ckpt).objects]
                     if k.startswith("optimizer."))
    assert len(unasked) >= 27 and "optimizer.param_groups.0.lr" in unasked
    with pytest.warns(tessera.PartialLoadWarning,
                      match=f"{len(unasked)} keys not loaded: {len(unasked)} in the ") as seen:
        report = tessera.load(state, ckpt, strict=False)
    assert sorted(report.unexpected_keys) == unasked, seen
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    loaded = tessera.load_all(ckpt)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fresh_optimizer.load_state_dict(loaded["optimizer"])
    assert fresh_optimizer.param_groups[0]["lr"] == 0.01
    assert torch.equal(fresh_optimizer.state[fresh[0].weight]["exp_avg"],
                       optimizer.state[model[0].weight]["exp_avg"])


def test_load_all_tensor_type(ckpt):
    tessera.save({"a": np.arange(4, dtype=np.int32), "t": torch.ones(2, dtype=torch.bfloat16)},
                 ckpt)
    as_torch = tessera.load_all(ckpt, tensor_type="torch")
    assert as_torch["a"].dtype == torch.int32 and as_torch["t"].dtype == torch.bfloat16
    as_numpy = tessera.load_all(ckpt, tensor_type="numpy")
    assert as_numpy["a"].dtype == np.int32
    # NumPy has no bfloat16: the raw bits, as uint16 (1.0 is 0x3f80).
    assert as_numpy["t"].dtype == np.uint16 and list(as_numpy["t"]) == [0x3F80, 0x3F80]
    with pytest.raises(ValueError):
        tessera.load_all(ckpt, tensor_type="jax")


def test_raw_bits_with_an_explicit_dtype(ckpt):
    bits = np.array([0x3F80, 0x4000, 0xC040], dtype=np.uint16)  # bfloat16 1, 2, -3
    tessera.save({"w": tessera.ShardedTensor(bits, dtype="BF16")}, ckpt)
    assert tessera.read_metadata(ckpt).tensors[0].dtype == "BF16"
    loaded = tessera.load_all(ckpt, tensor_type="torch")
    assert loaded["w"].tolist() == [1.0, 2.0, -3.0]
    back = np.zeros(3, dtype=np.uint16)
    tessera.load({"w": tessera.ShardedTensor(back, dtype="BF16")}, ckpt)
    assert np.array_equal(back, bits)


def test_sharded_object_and_key_override(ckpt):
    state = {"rng": tessera.ShardedObject({"seed": 5}), "bytes": tessera.ShardedObject(b"xyz"),
             "w": tessera.ShardedTensor(np.ones(3), key="renamed.weight")}
    tessera.save(state, ckpt)
    metadata = tessera.read_metadata(ckpt)
    assert [t.key for t in metadata.tensors] == ["renamed.weight"]
    target = {"rng": tessera.ShardedObject(None), "bytes": tessera.ShardedObject(b""),
              "w": tessera.ShardedTensor(np.zeros(3), key="renamed.weight")}
    tessera.load(target, ckpt)
    assert target["rng"].value == {"seed": 5} and target["bytes"].value == b"xyz"
    assert np.array_equal(target["w"].data, np.ones(3))
    assert_same(tessera.load_all(ckpt), {"rng": {"seed": 5}, "bytes": b"xyz", "w": np.ones(3)})


def test_save_again_into_the_same_directory(ckpt):
    for step in range(3):
        tessera.save({"w": np.full(4, step, dtype=np.float32), "step": step}, ckpt, sync=False)
        assert tessera.load_all(ckpt)["step"] == step
    assert np.array_equal(tessera.load_all(ckpt)["w"], np.full(4, 2, dtype=np.float32))
    tessera.verify(ckpt)


def test_options_reach_the_library(ckpt):
    report = tessera.save({"w": np.ones(1 << 16, dtype=np.float32), "x": np.ones(10)}, ckpt,
                          num_io_threads=1, sync="none", remove_stale_files=True)
    assert report.files_written == 1 and report.total_bytes == 4 * (1 << 16) + 80
    target = {"w": np.zeros(1 << 16, dtype=np.float32), "x": np.zeros(10)}
    report = tessera.load(target, ckpt, verify_checksums=False, num_io_threads=3)
    assert report.bytes_read == report.bytes_needed == 4 * (1 << 16) + 80
    assert tessera.verify(ckpt).files_checked == 1
    assert tessera.verify(ckpt, num_threads=4).files_checked == 1
    with pytest.raises(tessera.InvalidArgumentError, match="num_threads must be at least 1"):
        tessera.verify(ckpt, num_threads=0)
