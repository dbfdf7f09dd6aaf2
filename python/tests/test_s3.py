"""tessera on S3 through "s3://bucket/prefix" paths: save on 4 local ranks, load resharded,
load_all, read_metadata, verify, async_save, remove_keys, convert from S3 to local files and
back, against moto's server on loopback (started by tessera_moto_server, signing enforced; the
AWS variables set as a user sets them). A server that cannot start fails every test."""

import os
import subprocess

import pytest
import torch

import tessera
from conftest import moto_server


@pytest.fixture(scope="module")
def s3():
    """Starts the server, sets AWS_* for this module's tests, yields "s3://bucket/<prefix>"."""
    with moto_server() as values:
        yield from _with_aws_environment(values)


def _with_aws_environment(values):
    """Sets AWS_* as a user of that server sets them, yields the test prefix, restores."""
    saved = {k: os.environ.get(k) for k in list(values) + [
        "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_PROFILE", "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL_S3"]}
    os.environ.update(values)
    os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)
    try:
        yield f"s3://{values['TESSERA_TEST_BUCKET']}/py-{os.getpid()}"
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def full_state():
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(64, 24, generator=g), "b": torch.arange(24, dtype=torch.int64),
            "step": 9}


def save_sharded(path):
    """4 ranks, each a band of rows of w; b and step on every rank (replicas)."""
    full = full_state()

    def save(comm):
        r = comm.rank
        state = {"w": tessera.ShardedTensor(full["w"][16 * r:16 * r + 16].clone(), (64, 24),
                                            (16 * r, 0)),
                 "b": full["b"], "step": full["step"]}
        tessera.save(state, path, comm=comm)

    tessera.run_local(4, save)
    return full


def load_columns(path, ranks, full):
    """Loads w by bands of columns on `ranks` ranks (another layout than the save's)."""
    def load(comm):
        r = comm.rank
        width = 24 // ranks
        w = torch.zeros(64, width)
        state = {"w": tessera.ShardedTensor(w, (64, 24), (0, width * r)),
                 "b": torch.zeros(24, dtype=torch.int64), "step": None}
        report = tessera.load(state, path, comm=comm)
        assert torch.equal(w, full["w"][:, width * r:width * (r + 1)]), r
        assert torch.equal(state["b"], full["b"]) and state["step"] == 9
        return report

    reports = tessera.run_local(ranks, load)
    # On S3 "auto" (the default) reads each block once in the job: the column bands share every
    # block of the row bands, and the replicated "b" is read once, not once per rank.
    for report in reports:
        assert report.read_sharing.name == "READ_ONCE", report
        assert report.job_bytes_exchanged > 0, report
        assert report.job_bytes_needed <= report.job_bytes_read, report
        assert report.job_bytes_read <= report.checkpoint_bytes + 64 * ranks, report


def test_save_load_resharded_verify(s3):
    path = s3 + "/ckpt"
    full = save_sharded(path)
    load_columns(path, 3, full)
    loaded = tessera.load_all(path, tensor_type="torch")
    assert torch.equal(loaded["w"], full["w"]) and loaded["step"] == 9
    metadata = tessera.read_metadata(path)
    assert metadata.num_ranks == 4
    report = tessera.verify(path)
    assert report.bytes_checked >= 64 * 24 * 4


def test_async_save_and_remove_keys(s3):
    path = s3 + "/async"
    full = full_state()
    handle = tessera.async_save(full, path)
    handle.wait()
    assert torch.equal(tessera.load_all(path, tensor_type="torch")["w"], full["w"])
    tessera.remove_keys(path, ["b"])
    keys = {t.key for t in tessera.read_metadata(path).tensors}
    assert keys == {"w"}
    tessera.verify(path)


def test_convert_between_s3_and_local_files(s3, tmp_path):
    path = s3 + "/src"
    full = save_sharded(path)
    tessera.convert(path, tmp_path / "hf", to="safetensors")
    local = tessera.load_all(tmp_path / "hf", tensor_type="torch")
    assert torch.equal(local["w"], full["w"])
    back = s3 + "/back"
    tessera.convert(tmp_path / "hf", back, to="tessera")
    assert torch.equal(tessera.load_all(back, tensor_type="torch")["w"], full["w"])
    tessera.verify(back)
    with pytest.raises(tessera.AlreadyExistsError):
        tessera.convert(tmp_path / "hf", back, to="tessera")


def test_checkpoint_manager_on_a_root_uri(s3):
    root = s3 + "/run"
    with tessera.CheckpointManager(root, keep_last=2) as manager:
        assert manager.latest_step() is None
        for step in range(1, 4):
            saved = manager.save(step, {"w": torch.full((8, 4), float(step)), "step": step})
            assert saved.path == f"{root}/iter_{step:07d}"
        manager.wait()
        assert manager.all_steps() == [2, 3]
    resumed = tessera.CheckpointManager(root)
    state = {"w": torch.zeros(8, 4), "step": None}
    restored = resumed.restore(state)
    assert restored.step == 3 and state["step"] == 3
    assert torch.equal(state["w"], torch.full((8, 4), 3.0))
    resumed.close()
    assert tessera.verify(f"{root}/iter_0000003").bytes_checked >= 8 * 4 * 4


def _saved_steps(root, steps):
    with tessera.CheckpointManager(root) as manager:
        for step in steps:
            manager.save(step, {"w": torch.full((4, 4), float(step)), "step": step})
    return tessera.CheckpointManager(root)


@pytest.mark.parametrize("scheme", ["s3", "file"])
def test_explicit_prune_on_a_root_uri(s3, tmp_path, scheme):
    """Issue 30, defect 5: prune on an s3:// or file:// root found "0 of 0 step directories"
    and exited 0 while latest named the newest step."""
    root = s3 + "/prune" if scheme == "s3" else f"file://{tmp_path}/prune"
    manager = _saved_steps(root, [1, 2, 3, 4])
    assert manager.all_steps() == [1, 2, 3, 4]
    dry = manager.prune(keep_last=3, dry_run=True)
    assert [d.step for d in dry.steps] == [1, 2, 3, 4] and dry.deleted == 1
    assert all(d.path.startswith(root) for d in dry.steps), [d.path for d in dry.steps]
    report = manager.prune(keep_last=3)
    assert report.deleted == 1 and manager.all_steps() == [2, 3, 4]
    manager.close()
    cli = os.environ.get("TESSERA_CLI")
    assert cli and os.path.exists(cli), f"TESSERA_CLI={cli!r}: build the tessera tool"
    out = subprocess.run([cli, "prune", root, "--keep-last", "1"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "2 of 3 step directories" in out.stdout, out.stdout
    latest = subprocess.run([cli, "latest", root], capture_output=True, text=True, timeout=120)
    assert latest.returncode == 0 and latest.stdout.strip().endswith("iter_0000004"), latest
    assert tessera.CheckpointManager(root).all_steps() == [4]


def test_errors_name_the_uri(s3):
    with pytest.raises(tessera.Error) as missing:
        tessera.read_metadata(s3 + "/absent")
    assert "absent" in str(missing.value)
    with pytest.raises(tessera.Error) as scheme:
        tessera.read_metadata("gs://bucket/ckpt")
    assert "gs://" in str(scheme.value)
