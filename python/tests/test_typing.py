"""Type information of the installed package (py.typed, tessera/_tessera.pyi, annotations):
`mypy --strict` accepts a script that uses the public API as documented (and the script runs),
rejects one with a misspelt report attribute, a wrong argument type and a misspelt option,
naming each; the stubs of the extension modules name exactly what the bindings define
(mypy's stubtest) and the TypedDicts of the keyword options every option the functions take;
the package's own sources type-check; help() and inspect.signature show the public functions'
parameters. mypy is pinned in requirements/dev.txt: without it these
tests fail, they never skip."""

import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import tessera
import tessera.megatron
import tessera.torch

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Uses every public function, report attribute and class the way docs/PYTHON.md does: mypy
# --strict must find nothing wrong, and the script must run (so the types it relies on are
# what tessera really returns).
GOOD = '''
import datetime
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import tessera
import tessera.megatron
import tessera.torch


def progress(done: int, total: int) -> None:
    assert 0 <= done <= total


class OneRank:
    """A tessera.python_comm implementation of one rank."""

    rank = 0
    size = 1

    def barrier(self) -> None:
        pass

    def broadcast(self, data: bytes | None, root: int) -> bytes:
        return data or b""

    def gather(self, data: bytes, root: int) -> list[bytes]:
        return [data]

    def all_gather(self, data: bytes) -> list[bytes]:
        return [data]

    def scatter(self, chunks: list[bytes] | None, root: int) -> bytes:
        return chunks[0] if chunks else b""

    def all_reduce(self, values: list[int], op: str) -> list[int]:
        return values

    def split(self, color: int, key: int) -> "OneRank":
        return self


def arrays(base: str) -> None:
    path = os.path.join(base, "arrays")
    state: dict[str, Any] = {"w": np.arange(12, dtype=np.float32).reshape(3, 4),
                             "piece": tessera.ShardedTensor(np.ones(2, np.float32),
                                                            global_shape=(2,),
                                                            global_offset=[0], replica_id=0),
                             "meta": tessera.ShardedObject({"lr": 0.1}, replica_id=(0,)),
                             "step": 3}
    saved: tessera.SaveReport = tessera.save(state, path, num_io_threads=2, sync="none",
                                             user_metadata={"run": "a"}, check_replicas=False,
                                             separate_prefixes=["piece"], progress=progress)
    written: int = saved.bytes_written + saved.total_bytes + saved.files_written
    assert written > 0 and isinstance(saved.plan_cache_hit, bool) and saved.save_id

    loaded: tessera.LoadReport = tessera.load(state, path, strict=False, objects="unpickle",
                                              read_sharing="none", cast_dtypes=False,
                                              verify_checksums=True, progress=progress)
    left_out: list[str] = (loaded.missing_keys + loaded.unexpected_keys
                           + loaded.shape_mismatched_keys)
    read: int = (loaded.bytes_read + loaded.bytes_needed + loaded.read_calls
                 + loaded.bytes_received)
    assert not left_out and read > 0 and loaded.state_dict is state

    everything = tessera.load_all(path, tensor_type="numpy", objects="bytes")
    assert everything["w"].shape == (3, 4)

    handle: tessera.AsyncSaveHandle = tessera.async_save(state, path, staging="deferred",
                                                         when_busy="queue", sync=False,
                                                         user_metadata={"run": "b"})
    handle.wait_staged()
    report: tessera.SaveReport = handle.wait()
    done: bool = handle.done() and handle.staged()
    same: tessera.SaveReport | None = handle.report
    error: tessera.Error | None = handle.exception()
    assert done and same is not None and error is None and report.total_bytes > 0

    metadata: tessera.Metadata = tessera.read_metadata(path)
    shapes: dict[str, list[int]] = {t.key: t.shape for t in metadata.tensors}
    info = metadata.find_tensor("w")
    assert info is not None and info.dtype == "F32" and info.nbytes == 48
    assert shapes["w"] == [3, 4] and metadata.user_metadata["run"] == "b"
    names: list[str] = [o.key for o in metadata.objects] + [f.name for f in metadata.files]
    assert names and metadata.format == "tessera" and metadata.num_ranks == 1

    verified: tessera.VerifyReport = tessera.verify(path, num_threads=2, progress=progress)
    assert verified.chunks_checked > 0 and verified.checksums and verified.format == "tessera"

    converted: tessera.ConvertReport = tessera.convert(path, os.path.join(base, "st"),
                                                       to="safetensors", dtype="bf16",
                                                       max_shard_size="1GB", keys=["w"])
    files: list[str] = converted.files
    assert files and converted.tensors == 1 and converted.source_format == "tessera"

    removed: tessera.RemoveKeysReport = tessera.remove_keys(path, ["piece"], dry_run=True)
    freed: int = removed.bytes_freed + removed.files_dropped + removed.files_rewritten
    assert removed.removed_tensors == ["piece"] and removed.dry_run and freed >= 0

    try:
        tessera.load({"absent": np.zeros(1)}, path, strict=False)
    except tessera.MissingKeysError as e:
        raise AssertionError("strict=False loads what is there") from e
    except tessera.InvalidArgumentError as e:
        code: str = e.code
        number: int = e.status_code
        raise AssertionError(f"{code} ({number})") from e
    try:
        tessera.read_metadata(os.path.join(base, "nothing"))
    except (tessera.NotFoundError, tessera.CorruptCheckpointError, tessera.StorageError):
        pass
    warnings.simplefilter("error", tessera.PartialLoadWarning)
    assert issubclass(tessera.CheckpointWarning, UserWarning)
    assert isinstance(tessera.STRUCTURE_KEY, str) and isinstance(tessera.HAS_MPI, bool)


def managed(base: str) -> None:
    def blank() -> dict[str, Any]:
        return {"w": np.zeros(4, np.float32), "step": 0}

    with tessera.CheckpointManager(os.path.join(base, "run"), keep_last=2,
                                   sync=False) as manager:
        assert manager.restore(blank()) is None
        for step in (1, 2, 3):
            saved: tessera.ManagedSave = manager.save(step, {"w": np.full(4, step, np.float32),
                                                             "step": step},
                                                      per_rank={"rng": step},
                                                      user_metadata={"k": "v"})
            saved.wait_staged()
            assert not saved.skipped and saved.handle is not None and saved.report is None
        manager.wait()
        latest: int | None = manager.latest_step()
        steps: list[int] = manager.all_steps()
        assert latest == 3 and steps == [2, 3] and manager.steps()[0].state == "committed"
        restored: tessera.RestoreResult | None = manager.restore(blank(), verify_checksums=True)
        assert restored is not None and restored.step == 3 and restored.per_rank["rng"] == 3
        assert restored.report is not None and not restored.report.missing_keys
        pruned = manager.prune(keep_last=1, dry_run=True)
        kept: list[str] = [d.reason for d in pruned.steps if not d.deleted]
        assert pruned.deleted == 1 and kept
        with manager.lease(3) as step_path:
            assert os.path.isdir(step_path)
        manager.mark(3, "best")
        manager.unmark(3)
        retention = manager.last_retention
        assert retention is None or retention.deleted >= 0


def communicators() -> None:
    def rank_function(comm: tessera.Comm) -> int:
        comm.barrier()
        everyone: list[bytes] = comm.all_gather(bytes([comm.rank]))
        sums: list[int] = comm.all_reduce([comm.rank], "sum")
        return len(everyone) + sums[0]

    results: list[int] = tessera.run_local(2, rank_function, timeout=60.0)
    assert results == [3, 3]
    one: tessera.Comm = tessera.single_rank_comm()
    python: tessera.Comm = tessera.python_comm(OneRank())
    assert one.size == python.size == 1
    makers: list[Callable[..., tessera.Comm]] = [tessera.torch_dist_comm, tessera.mpi_comm]
    assert makers


def over_torch_distributed() -> tessera.Comm:  # type-checked only: needs torch.distributed
    return tessera.torch_dist_comm(None, timeout=datetime.timedelta(minutes=5))


def with_torch(base: str) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = os.path.join(base, "torch")
    saved: tessera.SaveReport = tessera.torch.save_state(
        path, model=model, optimizer=optimizer, step=3,
        rng=tessera.torch.per_rank(torch.get_rng_state()), save_options={"sync": False})
    extra: dict[str, Any] = tessera.torch.load_state(path, model=model, optimizer=optimizer)
    assert extra["step"] == 3 and saved.bytes_written > 0
    handle = tessera.torch.async_save_state(path, model=model)
    handle.wait()
    with tessera.CheckpointManager(os.path.join(base, "torch_run")) as manager:
        managed_save: tessera.ManagedSave = tessera.torch.save_state(manager, model=model, step=1)
        managed_save.wait_staged()
        manager.wait()
        resumed: dict[str, Any] | None = tessera.torch.load_state(manager, model=model)
        assert resumed is not None and resumed["step"] == 1

    megatron_path = os.path.join(base, "megatron")
    state = {"w": tessera.ShardedTensor(torch.zeros(4), key="w")}
    assert tessera.megatron.save(state, megatron_path, format="tessera") is None
    loaded = tessera.megatron.load(state, megatron_path, strict="log_all")
    assert set(loaded) == {"w"}
    tensors: dict[str, torch.Tensor] = tessera.megatron.load_plain_tensors(megatron_path)
    assert list(tensors) == ["w"]
    tessera.megatron.remove_sharded_tensors(megatron_path, "w")


arrays(sys.argv[1])
managed(sys.argv[1])
communicators()
with_torch(sys.argv[1])
print("ok")
'''

# Each line marked "# error: <text>" must get exactly that error from mypy, and no other line
# any: a misspelt report attribute, a path of the wrong type, a misspelt option.
BAD = '''
import numpy as np

import tessera

state = {"w": np.zeros(3, np.float32)}
report = tessera.save(state, "ckpt")
print(report.bytes_writen)  # error: "SaveReport" has no attribute "bytes_writen"
tessera.load(state, 42)  # error: Argument 2 to "load" has incompatible type "int"
tessera.save(state, "ckpt", num_io_thread=2)  # error: Unexpected keyword argument "num_io_thread"
tessera.load_all("ckpt", tensor_type="jax")  # error: Argument "tensor_type" to "load_all"
'''


def mypy_env():
    """The environment of a mypy run of this interpreter (so that it sees the tessera this
    test imports, nothing on MYPYPATH or PYTHONPATH). Fails without mypy."""
    assert importlib.util.find_spec("mypy") is not None, (
        "mypy is not installed in this environment (requirements/dev.txt pins it; run "
        "scripts/setup)")
    return {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}


@pytest.fixture(scope="module")
def strict_cache(tmp_path_factory):
    """One mypy cache for the --strict runs of this module: the second reuses what the first
    learnt of torch and numpy (some 20 s a run on 2 cores)."""
    return tmp_path_factory.mktemp("mypy_strict_cache")


def run_mypy(tmp_path, cache, *args):
    """`python -m mypy --strict ARGS`, with no configuration file and its cache in `cache`."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file=", "--no-color-output",
         "--cache-dir", str(cache), *args],
        cwd=tmp_path, env=mypy_env(), capture_output=True, text=True, timeout=600)


def test_the_installed_package_ships_its_type_information():
    package = pathlib.Path(tessera.__file__).parent
    for name in ("py.typed", "_tessera.pyi"):
        assert (package / name).is_file(), f"{name} is missing from {package}"
    if tessera.HAS_MPI:
        assert (package / "_tessera_mpi.pyi").is_file()


def test_mypy_strict_accepts_the_documented_use_and_it_runs(tmp_path, strict_cache):
    script = tmp_path / "good.py"
    script.write_text(GOOD)
    result = run_mypy(tmp_path, strict_cache, str(script))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run([sys.executable, str(script), str(work)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout + ran.stderr


def test_mypy_strict_names_a_misspelt_attribute_a_wrong_type_and_a_misspelt_option(
        tmp_path, strict_cache):
    script = tmp_path / "bad.py"
    script.write_text(BAD)
    result = run_mypy(tmp_path, strict_cache, str(script))
    assert result.returncode == 1, result.stdout + result.stderr
    expected = {number: line.split("# error: ")[1]
                for number, line in enumerate(BAD.splitlines(), 1) if "# error: " in line}
    errors = {}
    for line in result.stdout.splitlines():
        match = re.match(r".*bad\.py:(\d+): error: (.*)", line)
        if match:
            errors.setdefault(int(match.group(1)), []).append(match.group(2))
    assert sorted(errors) == sorted(expected), result.stdout
    for number, text in expected.items():
        assert any(text in error for error in errors[number]), (number, text, result.stdout)


# stubtest's reports that every pybind11 stub gets: the classes' metaclass (pybind11_type) has
# no place in a stub, and a class without a bound constructor has pybind11's
# __init__(self, *args, **kwargs) (which raises) where the stub has object's.
PYBIND11_NOISE = (re.compile(r"^error: \S+ is inconsistent, metaclass differs$"),
                  re.compile(r'^error: \S+\.__init__ is inconsistent, stub does not have '
                             r'\*args parameter "args"$'))


def test_the_stubs_name_what_the_bindings_define(tmp_path):
    modules = ["tessera._tessera"] + (["tessera._tessera_mpi"] if tessera.HAS_MPI else [])
    for module in modules:  # without its stub, stubtest compares nothing and reports success
        stub = pathlib.Path(tessera.__file__).parent / (module.split(".")[1] + ".pyi")
        assert stub.is_file(), f"{stub} is missing"
    result = subprocess.run([sys.executable, "-m", "mypy.stubtest", "--mypy-config-file=",
                             *modules], cwd=tmp_path, env=mypy_env(), capture_output=True,
                            text=True, timeout=600)
    output = result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert not [e for e in errors if not any(p.match(e) for p in PYBIND11_NOISE)], output
    # Exit status 1 with only that noise, 0 without any; anything else (a crash) fails.
    assert result.returncode == (1 if errors else 0) and "Traceback" not in output, output


def test_the_package_sources_type_check(tmp_path):
    # The sources beside this test, with the project's settings (pyproject.toml, [tool.mypy]):
    # every call into the extension module is checked against its stubs.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--no-color-output", "--cache-dir", str(tmp_path / "mypy_cache"), "-p", "tessera"],
        cwd=ROOT / "python", env=mypy_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def bound_fields(cls):
    """The fields of an options struct the bindings expose (def_readwrite, def_property)."""
    return {name for name, value in vars(cls).items() if isinstance(value, property)}


def test_the_option_typeddicts_name_every_keyword_option_the_functions_take():
    from tessera import _api, _tessera, _types

    def keys(typed_dict):
        return typed_dict.__required_keys__ | typed_dict.__optional_keys__

    save = bound_fields(_tessera.SaveOptions) - _api._NOT_OPTIONS | {"check_replicas"}
    assert keys(_types.SaveOptions) == save
    assert keys(_types.AsyncSaveOptions) == save - {"progress"}
    assert keys(_types.MegatronSaveOptions) == save - {"format"}
    assert keys(_types.ManagerSaveOptions) == save - {"progress", "save_tag", "format",
                                                      "check_replicas"}
    assert keys(_types.LoadOptions) == bound_fields(_tessera.LoadOptions) - _api._NOT_OPTIONS


PUBLIC_FUNCTIONS = sorted(
    [f"tessera.{name}" for name in tessera.__all__ if inspect.isroutine(getattr(tessera, name))]
    + [f"tessera.torch.{name}" for name in tessera.torch.__all__
       if inspect.isroutine(getattr(tessera.torch, name))]
    + [f"tessera.megatron.{name}" for name in ("save", "load", "load_plain_tensors",
                                                "remove_sharded_tensors")])


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_help_shows_the_signature_and_the_docstring(name):
    module, _, attribute = name.rpartition(".")
    function = getattr(sys.modules[module], attribute)
    assert inspect.isfunction(function), f"{name} is {function!r}, not a Python function"
    signature = inspect.signature(function)
    assert signature.return_annotation is not inspect.Signature.empty, name
    for parameter in signature.parameters.values():
        assert parameter.annotation is not inspect.Parameter.empty, (name, parameter.name)
    assert function.__doc__ and len(function.__doc__) > 40, name


def test_help_of_run_local_is_a_function_not_a_pybind11_record():
    import pydoc
    text = pydoc.render_doc(tessera.run_local, renderer=pydoc.plaintext)
    assert "pybind11" not in text and "PyCapsule" not in text, text
    assert "run_local(num_ranks: 'int', fn: 'Callable[[Comm], _T]', timeout: 'float' = 600.0)" \
        in text, text
    assert textwrap.dedent(tessera.run_local.__doc__).split("\n")[0] in text
