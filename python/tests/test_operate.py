"""Operating checkpoints from Python: remove_keys, megatron.remove_sharded_tensors,
separate_prefixes, and progress callbacks (save, load, verify, remove_keys)."""

import os
import threading
import warnings

import numpy as np
import pytest

import tessera
from tessera import megatron

from megatron.core.dist_checkpointing import ShardedTensor as MegatronShardedTensor


def _state(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "model": {"w": rng.standard_normal((256, 64)).astype(np.float32),
                  "b": rng.standard_normal(64).astype(np.float32)},
        "optimizer": {"exp_avg": rng.standard_normal((256, 64)).astype(np.float32),
                      "step": 7},
    }


def _data_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".safetensors"))


def test_remove_keys_frees_the_bytes_and_keeps_the_rest(ckpt):
    state = _state()
    tessera.save(state, ckpt, num_io_threads=1, sync=False)
    before = _data_bytes(ckpt)
    report = tessera.remove_keys(ckpt, "optimizer.")
    assert report.removed_tensors == ["optimizer.exp_avg"]
    assert report.removed_objects == ["optimizer.step"]
    assert report.matches_per_prefix == [2]
    assert report.files_rewritten == 1 and report.files_dropped == 0
    assert report.bytes_freed == report.bytes_before - report.bytes_after > 256 * 64 * 4
    assert _data_bytes(ckpt) == report.bytes_after < before
    keys = {t.key for t in tessera.read_metadata(ckpt).tensors}
    assert keys == {"model.w", "model.b"}
    model = {"w": np.zeros((256, 64), np.float32), "b": np.zeros(64, np.float32)}
    tessera.load({"model": model}, ckpt)
    np.testing.assert_array_equal(model["w"], state["model"]["w"])
    tessera.verify(ckpt)


def test_load_all_after_remove_keys_and_rm_keys(ckpt, cli):
    """The README's sequence (issue 22, defect 4): after removing keys, load_all gives the rest
    in the saved containers (the structure record still names the removed keys); a container
    left with nothing goes, one that keeps something stays. The same after `tessera rm-keys`."""
    import subprocess
    state = _state()
    state["optimizer"]["groups"] = [{"lr": 0.1}]  # a list that loses its only leaf
    state["model"]["names"] = ("w", "b")             # a tuple that keeps its leaves
    tessera.save(state, ckpt)
    tessera.remove_keys(ckpt, "optimizer.")
    loaded = tessera.load_all(ckpt)
    assert sorted(loaded) == ["model"]
    np.testing.assert_array_equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["model"]["names"] == ("w", "b")
    # Part of a container: the rest of it stays.
    tessera.save(state, ckpt + "2")
    subprocess.run([cli, "rm-keys", ckpt + "2", "--prefix", "optimizer.exp_avg"], check=True,
                   capture_output=True)
    loaded = tessera.load_all(ckpt + "2")
    assert sorted(loaded["optimizer"]) == ["groups", "step"] and loaded["optimizer"]["step"] == 7
    # A key missing for another reason is still a corrupt structure record, named.
    meta = tessera.read_metadata(ckpt)
    assert "optimizer." in meta.user_metadata["tessera.removed_key_prefixes"]


def test_load_state_after_the_optimizer_was_removed(ckpt):
    """load_state no longer claims the checkpoint holds optimizer state once remove_keys took
    it out (issue 22, defect 4): the model loads alone; asking for the optimizer is an error
    that says why."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    tessera.torch.save_state(ckpt, model=model, optimizer=optimizer, step=5)
    tessera.remove_keys(ckpt, "optimizer.")
    fresh = torch.nn.Linear(4, 3)
    assert tessera.torch.load_state(ckpt, model=fresh) == {"step": 5}
    assert torch.equal(fresh.weight, model.weight)
    with pytest.raises(tessera.InvalidArgumentError,
                       match=r"has no optimizer state any more \(tessera.remove_keys removed "
                             r"prefixes \['optimizer.'\]\); pass optimizer=None"):
        tessera.torch.load_state(ckpt, model=fresh,
                                 optimizer=torch.optim.Adam(fresh.parameters()))


def test_separate_prefixes_make_removal_copy_nothing(ckpt):
    tessera.save(_state(1), ckpt, separate_prefixes=["optimizer."], sync=False)
    assert tessera.read_metadata(ckpt).files  # saved
    dry = tessera.remove_keys(ckpt, ["optimizer."], dry_run=True)
    assert dry.dry_run and dry.bytes_copied == 0 and dry.files_rewritten == 0
    assert {t.key for t in tessera.read_metadata(ckpt).tensors} >= {"optimizer.exp_avg"}
    report = tessera.remove_keys(ckpt, ["optimizer."])
    assert report.bytes_copied == 0 and report.files_dropped >= 1
    assert report.bytes_after == dry.bytes_after


def test_remove_keys_errors(ckpt, tmp_path):
    tessera.save(_state(), ckpt, sync=False)
    with pytest.raises(tessera.InvalidArgumentError, match="empty key prefix"):
        tessera.remove_keys(ckpt, [""])
    with pytest.raises(TypeError):
        tessera.remove_keys(ckpt, [1])
    with pytest.raises(TypeError, match="progress must be a callable"):
        tessera.remove_keys(ckpt, ["x"], progress=3)
    # Another format: named, and refused.
    hf = tmp_path / "hf"
    hf.mkdir()
    header = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    (hf / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(tessera.FailedPreconditionError, match="safetensors checkpoint"):
        tessera.remove_keys(str(hf), ["w"])
    assert tessera.remove_keys(ckpt, ["nothing."]).removed_tensors == []


def test_megatron_remove_sharded_tensors(ckpt):
    import torch
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    m = torch.ones(3, 4)
    state = {"w": MegatronShardedTensor.from_rank_offsets("decoder.w", w),
             "m": MegatronShardedTensor.from_rank_offsets("optimizer.m", m)}
    # Megatron's torch_dist format (the default): refused, saying what to do.
    megatron.save(state, ckpt + "_dcp")
    with pytest.raises(tessera.FailedPreconditionError, match="torch_dist checkpoint.*convert"):
        megatron.remove_sharded_tensors(ckpt + "_dcp", "optimizer.")
    megatron.save(state, ckpt, format="tessera")
    megatron.remove_sharded_tensors(ckpt, "optimizer.")
    assert [t.key for t in tessera.read_metadata(ckpt).tensors] == ["decoder.w"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megatron.remove_sharded_tensors(ckpt, "optimizer.")
    assert any("begin with" in str(w.message) for w in caught)


class _Recorder:
    """A tqdm-like consumer: total and n, updated from the calls."""

    def __init__(self):
        self.calls = []
        self.threads = set()

    def __call__(self, done, total):
        self.calls.append((done, total))
        self.threads.add(threading.get_ident())

    def check(self, total):
        assert self.calls, "progress was never called"
        assert self.threads == {threading.get_ident()}
        assert all(t == total for _, t in self.calls)
        assert [d for d, _ in self.calls] == sorted(d for d, _ in self.calls)
        assert self.calls[-1] == (total, total)


def test_progress_callbacks_of_save_load_verify_remove_keys(ckpt):
    state = {"a": np.ones((512, 1024), np.float32), "b": np.zeros(10, np.int64)}
    saved = _Recorder()
    report = tessera.save(state, ckpt, progress=saved, sync=False, num_io_threads=1)
    saved.check(report.bytes_written)

    loaded = _Recorder()
    target = {"a": np.zeros((512, 1024), np.float32), "b": np.ones(10, np.int64)}
    load_report = tessera.load(target, ckpt, progress=loaded)
    loaded.check(load_report.bytes_needed)
    assert load_report.bytes_needed == 512 * 1024 * 4 + 80

    verified = _Recorder()
    verify_report = tessera.verify(ckpt, progress=verified)
    verified.check(verify_report.bytes_checked)

    removed = _Recorder()
    rm = tessera.remove_keys(ckpt, "b", progress=removed)
    removed.check(rm.bytes_copied)
    assert rm.bytes_copied == 512 * 1024 * 4


def test_progress_drives_a_tqdm_style_bar(ckpt):
    class Bar:  # the part of tqdm's interface the docs use
        def __init__(self):
            self.n, self.total = 0, None

        def update(self, k):
            self.n += k

    bar = Bar()

    def progress(done, total):
        bar.total = total
        bar.update(done - bar.n)

    tessera.save({"x": np.ones(1 << 20, np.float32)}, ckpt, progress=progress, sync=False)
    assert bar.n == bar.total == 4 << 20


def test_an_exception_in_progress_is_raised_after_the_call(ckpt):
    calls = []

    def progress(done, total):
        calls.append(done)
        raise KeyError("stop")

    with pytest.raises(KeyError, match="stop"):
        tessera.save({"x": np.ones(1000, np.float32)}, ckpt, progress=progress, sync=False)
    assert len(calls) == 1  # not called again after raising
    # The save itself went through.
    tessera.verify(ckpt)
    with pytest.raises(TypeError, match="async_save"):
        tessera.async_save({"x": np.ones(3)}, ckpt, progress=print)


def test_progress_on_several_ranks(tmp_path):
    path = str(tmp_path / "ck")
    full = np.arange(4 * 1000, dtype=np.float32).reshape(4, 1000)

    def rank(comm):
        r = comm.rank
        piece = tessera.ShardedTensor(full[2 * r:2 * r + 2].copy(), (4, 1000), (2 * r, 0))
        recorder = _Recorder()
        report = tessera.save({"x": piece}, path, comm=comm, progress=recorder, sync=False)
        recorder.check(report.bytes_written)
        return report.bytes_written

    assert sum(tessera.run_local(2, rank)) == full.nbytes
