"""Multi-rank saves and loads with ranks as threads (tessera.run_local), resharding between
layouts, and asynchronous saves."""

import gc
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import tessera
from conftest import raw_bytes


def rows(n, parts, part):
    """The rows [begin, end) of part `part` of `parts` (uneven when n % parts)."""
    edges = [n * i // parts for i in range(parts + 1)]
    return edges[part], edges[part + 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("save_ranks, load_ranks", [(2, 3), (3, 2), (4, 1), (1, 4)])
def test_rows_to_columns(ckpt, dtype, save_ranks, load_ranks):
    full = torch.arange(7 * 10).reshape(7, 10).to(dtype)

    def save(comm):
        b, e = rows(7, comm.size, comm.rank)
        state = {"layer": {"w": tessera.ShardedTensor(full[b:e].clone(), (7, 10), (b, 0))}}
        return tessera.save(state, ckpt, comm=comm).bytes_written

    written = tessera.run_local(save_ranks, save)
    assert sum(written) == full.numel() * full.element_size()

    def load(comm):
        b, e = rows(10, comm.size, comm.rank)
        local = torch.zeros(7, e - b, dtype=dtype)
        tessera.load({"layer": {"w": tessera.ShardedTensor(local, (7, 10), (0, b))}}, ckpt,
                     comm=comm)
        return raw_bytes(local) == raw_bytes(full[:, b:e].contiguous())

    assert all(tessera.run_local(load_ranks, load))
    assert torch.equal(tessera.load_all(ckpt)["layer"]["w"], full)


def test_replicated_plain_tensors_are_written_once(ckpt):
    def save(comm):
        state = {"bias": torch.ones(1000), "step": 7}
        return tessera.save(state, ckpt, comm=comm).bytes_written

    written = tessera.run_local(3, save)
    assert written[1] == written[2] == 0 and written[0] >= 4000
    assert tessera.load_all(ckpt)["step"] == 7

    def save_balanced(comm):
        state = {f"b{i}": torch.ones(1000) for i in range(6)}
        return tessera.save(state, ckpt, comm=comm, balance_writes=True).bytes_written

    assert all(w > 0 for w in tessera.run_local(3, save_balanced))


def test_flat_ranges_of_a_distributed_optimizer(ckpt):
    """Adam moments of a TP shard, split over DP ranks as flat ranges of the shard."""
    full = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)

    def save(comm):  # 4 ranks: tp = rank // 2 holds rows [3 tp, 3 tp + 3); dp = rank % 2
        tp, dp = divmod(comm.rank, 2)
        shard = full[3 * tp:3 * tp + 3].reshape(-1)
        begin, end = (0, 10) if dp == 0 else (10, 24)  # uneven on purpose
        state = {"exp_avg": tessera.ShardedTensor(
            shard[begin:end].copy(), (6, 8), (3 * tp, 0), local_shape=(3, 8),
            flat_range=(begin, end))}
        tessera.save(state, ckpt, comm=comm)

    tessera.run_local(4, save)
    assert np.array_equal(tessera.load_all(ckpt)["exp_avg"], full)

    def load(comm):  # 2 ranks, each a flat range of the whole tensor
        begin, end = (0, 17) if comm.rank == 0 else (17, 48)
        local = np.zeros(end - begin, np.float32)
        tessera.load({"exp_avg": tessera.ShardedTensor(local, (6, 8), local_shape=(6, 8),
                                                        flat_range=(begin, end))},
                     ckpt, comm=comm)
        return np.array_equal(local, full.reshape(-1)[begin:end])

    assert all(tessera.run_local(2, load))


def megatron_state(config, tp, dp, rank, fill):
    """A Megatron-style state (cf. src/workload/model_state.h): qkv and fc1 split along dim 0
    over TP, proj and fc2 along dim 1, norms replicated over TP; parameters replicated over DP
    (replica id (tp_replica, dp)); Adam moments as flat ranges of the TP shard over DP."""
    h, ffn = config
    t, d = rank % tp, rank // tp
    shapes = {"qkv": ((3 * h, h), 0), "proj": ((h, h), 1), "fc1": ((ffn, h), 0),
              "fc2": ((h, ffn), 1), "norm": ((h,), None)}
    params, moments = {}, {}
    for name, (shape, dim) in shapes.items():
        gen = torch.Generator().manual_seed(sum(map(ord, name)))
        full = torch.randn(shape, generator=gen).to(torch.bfloat16)
        if dim is None:
            local, offset, replica = full, (0,) * len(shape), (t, d)
        else:
            b, e = rows(shape[dim], tp, t)
            local = full.narrow(dim, b, e - b)
            offset = tuple(b if i == dim else 0 for i in range(len(shape)))
            replica = (0, d)
        local = local.contiguous() if fill else torch.zeros_like(local.contiguous())
        params[name] = tessera.ShardedTensor(local, shape, offset, replica_id=replica)
        moment = torch.randn(shape, generator=gen)
        local_box = moment[tuple(slice(o, o + s) for o, s in zip(offset, local.shape))]
        flat = local_box.reshape(-1)
        fb, fe = rows(flat.numel(), dp, d)
        data = flat[fb:fe].clone() if fill else torch.zeros(fe - fb)
        moments[name] = tessera.ShardedTensor(
            data, shape, offset, local_shape=tuple(local.shape), flat_range=(fb, fe),
            replica_id=(t, 0) if dim is None else ())
    return {"model": {"decoder": params}, "optimizer": {"exp_avg": moments},
            "iteration": 100}


@pytest.mark.parametrize("save_layout, load_layout", [((2, 2), (4, 1)), ((4, 1), (1, 2)),
                                                      ((1, 3), (2, 1))])
def test_megatron_style_resharding(ckpt, save_layout, load_layout):
    config = (8, 20)

    def save(comm):
        state = megatron_state(config, *save_layout, comm.rank, fill=True)
        tessera.save(state, ckpt, comm=comm)

    tessera.run_local(save_layout[0] * save_layout[1], save)

    def load(comm):
        expected = megatron_state(config, *load_layout, comm.rank, fill=True)
        state = megatron_state(config, *load_layout, comm.rank, fill=False)
        tessera.load(state, ckpt, comm=comm)
        for group in ("model", "optimizer"):
            a, b = expected[group], state[group]
            for sub in a:
                for name in a[sub]:
                    assert raw_bytes(a[sub][name].data) == raw_bytes(b[sub][name].data), name
        assert state["iteration"] == 100
        return True

    assert all(tessera.run_local(load_layout[0] * load_layout[1], load))


def test_partial_load_across_ranks(ckpt):
    def save(comm):
        tessera.save({"a": torch.ones(4), "b": torch.zeros(2), f"only{comm.rank}": torch.ones(1)},
                     ckpt, comm=comm)

    with pytest.raises(ValueError, match="main replica"):
        tessera.run_local(2, save)  # "only1" is held by rank 1 with replica id (1,): not main

    def save_sharded(comm):
        tessera.save({"a": torch.ones(4), "b": torch.zeros(2),
                      f"only{comm.rank}": tessera.ShardedObject(comm.rank)}, ckpt, comm=comm)

    tessera.run_local(2, save_sharded)

    def load(comm):
        state = {"a": torch.zeros(4), "c": torch.zeros(1)}
        report = tessera.load(state, ckpt, comm=comm, strict=False)
        assert torch.equal(state["a"], torch.ones(4))
        return report.missing_keys, sorted(report.unexpected_keys)

    with pytest.warns(tessera.PartialLoadWarning, match="4 keys not loaded"):
        results = tessera.run_local(2, load)
    assert results == [(["c"], ["b", "only0", "only1"])] * 2
    assert {k: v for k, v in tessera.load_all(ckpt).items() if k.startswith("only")} == {
        "only0": 0, "only1": 1}


def test_ranks_run_in_parallel_without_the_gil():
    """Rank 0 blocks in a collective (GIL released) while rank 1 runs Python code first."""
    def fn(comm):
        if comm.rank == 1:
            time.sleep(0.2)
        comm.barrier()
        return comm.all_gather(bytes([comm.rank])), comm.broadcast(b"root", 0), \
            comm.all_reduce([comm.rank, 1], "sum")

    assert tessera.run_local(2, fn) == [([b"\x00", b"\x01"], b"root", [1, 2])] * 2


def test_run_local_timeout():
    def fn(comm):
        if comm.rank == 0:
            comm.barrier()
        else:
            time.sleep(1.0)  # stays in the rank function: rank 0 times out

    with pytest.raises(tessera.CommTimeoutError):
        tessera.run_local(2, fn, timeout=0.2)


def test_async_save_single_process(ckpt):
    w = torch.arange(1000, dtype=torch.float32)
    handle = tessera.async_save({"w": w, "step": 1}, ckpt)
    w.fill_(-1)  # after staging: does not change the checkpoint
    report = handle.wait()
    assert handle.done() and handle.exception() is None and handle.report.save_id == report.save_id
    assert report.total_bytes > 4000
    loaded = tessera.load_all(ckpt)
    assert torch.equal(loaded["w"], torch.arange(1000, dtype=torch.float32))
    assert loaded["step"] == 1
    handles = [tessera.async_save({"w": torch.full((10,), float(i))}, ckpt, when_busy="queue")
               for i in range(4)]
    for h in handles:
        h.wait()
    assert torch.equal(tessera.load_all(ckpt)["w"], torch.full((10,), 3.0))


def test_async_save_failure(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    handle = tessera.async_save({"w": np.zeros(2)}, str(tmp_path / "file" / "ckpt"))
    with pytest.raises(OSError):
        handle.wait()
    assert handle.done() and isinstance(handle.exception(), OSError) and handle.report is None
    with pytest.raises(ValueError, match="not contiguous"):  # staging errors: at once
        tessera.async_save({"w": np.zeros((3, 3)).T}, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("staging", ["blocking", "deferred"])
def test_async_save_with_local_ranks(ckpt, staging):
    full = torch.randn(6, 4)

    def fn(comm):
        b, e = rows(6, comm.size, comm.rank)
        local = full[b:e].clone()
        handles = []
        for step in range(3):
            if handles:
                handles[-1].wait_staged()  # before the "optimizer step"
            local.add_(1)
            handles.append(tessera.async_save(
                {"w": tessera.ShardedTensor(local, (6, 4), (b, 0)), "step": step},
                f"{ckpt}/{step}", comm=comm, staging=staging))
            comm.barrier()  # the caller's collectives do not mix with the save's
        return [h.wait().save_id for h in handles]

    ids = tessera.run_local(2, fn)
    assert ids[0] == ids[1] and len(set(ids[0])) == 3
    for step in range(3):
        loaded = tessera.load_all(f"{ckpt}/{step}")
        assert torch.allclose(loaded["w"], full + step + 1) and loaded["step"] == step


def test_async_save_deferred(ckpt):
    w = torch.randn(1 << 20)  # 4 MiB
    a = np.arange(100_000, dtype=np.int64)
    expected_w, expected_a = w.clone(), a.copy()
    handle = tessera.async_save({"w": w, "a": a, "step": 3}, ckpt, staging="deferred",
                                staging_threads=2)
    torch.mul(w, 2.0)  # reading the tensors meanwhile is fine (the forward pass)
    handle.wait_staged()
    assert handle.staged()
    w.fill_(-1)  # the optimizer step: after wait_staged, not in the checkpoint
    a[:] = -1
    report = handle.wait()
    assert handle.done() and handle.exception() is None and report.total_bytes > 4 << 20
    loaded = tessera.load_all(ckpt)
    assert torch.equal(loaded["w"], expected_w) and np.array_equal(loaded["a"], expected_a)
    assert loaded["step"] == 3


def test_async_save_deferred_keeps_the_tensors_alive_until_staged(ckpt):
    w = torch.full((4 << 20,), 7.0)  # 16 MiB, copied by one thread in pieces
    ref = weakref.ref(w)
    state = {"w": w}
    handle = tessera.async_save(state, ckpt, staging="deferred", staging_threads=1)
    del w, state  # the caller lets go at once: the handle holds the tensor
    gc.collect()
    assert ref() is not None or handle.staged()
    handle.wait_staged()
    gc.collect()
    assert ref() is None  # released once staged
    junk = [torch.full((4 << 20,), -1.0) for _ in range(2)]  # reuse freed memory, if any
    handle.wait()
    assert torch.equal(tessera.load_all(ckpt)["w"], torch.full((4 << 20,), 7.0))
    del junk


def test_async_save_deferred_check_catches_a_change_before_wait_staged(tmp_path):
    w = torch.zeros(1000)
    good = str(tmp_path / "good")
    handle = tessera.async_save({"w": w}, good, staging="deferred",
                                check_unchanged_until_staged=True)
    handle.wait_staged()
    w.add_(1)
    handle.wait()
    assert torch.equal(tessera.load_all(good)["w"], torch.zeros(1000))

    bad = str(tmp_path / "bad")
    handle = tessera.async_save({"w": w}, bad, staging="deferred",
                                check_unchanged_until_staged=True)
    while not handle.staged():
        time.sleep(0.001)
    w.add_(1)  # too early: the copy is made but wait_staged() was not called
    with pytest.raises(tessera.FailedPreconditionError, match="tensor 'w' changed before"):
        handle.wait_staged()
    with pytest.raises(tessera.FailedPreconditionError, match="tensor 'w' changed before"):
        handle.wait()
    assert isinstance(handle.exception(), tessera.FailedPreconditionError)
    with pytest.raises(tessera.Error):
        tessera.read_metadata(bad)  # nothing committed


def test_async_save_deferred_errors(tmp_path):
    with pytest.raises(ValueError, match="staging must be 'blocking' or 'deferred'"):
        tessera.async_save({"w": np.zeros(2)}, str(tmp_path / "a"), staging="lazy")
    with pytest.raises(ValueError, match="staging_threads must be at least 1"):
        tessera.async_save({"w": np.zeros(2)}, str(tmp_path / "a"), staging="deferred",
                           staging_threads=0)
    with pytest.raises(TypeError):
        tessera.async_save({"w": np.zeros(2)}, str(tmp_path / "a"), staging_threads="two")
    # The state is flattened after a deferred call returns: wait_staged() raises what is wrong
    # with it (InvalidArgumentError is a ValueError), and so do wait() and exception().
    handle = tessera.async_save({"w": np.zeros((3, 3)).T}, str(tmp_path / "a"),
                                staging="deferred")
    with pytest.raises(ValueError, match="not contiguous"):
        handle.wait_staged()
    with pytest.raises(tessera.InvalidArgumentError, match="not contiguous"):
        handle.wait()
    assert isinstance(handle.exception(), tessera.InvalidArgumentError)
    assert handle.done() and handle.staged()
    with pytest.raises(ValueError, match="not contiguous"):  # blocking: raised by the call
        tessera.async_save({"w": np.zeros((3, 3)).T}, str(tmp_path / "a"))
    (tmp_path / "file").write_bytes(b"x")
    handle = tessera.async_save({"w": np.zeros(2)}, str(tmp_path / "file" / "ckpt"),
                                staging="deferred")
    handle.wait_staged()  # staging worked; the write fails
    with pytest.raises(OSError):
        handle.wait()


def test_python_threads_save_concurrently(tmp_path):
    """Independent single-rank saves from several Python threads at once."""
    errors = []

    def work(i):
        try:
            for step in range(5):
                tessera.save({"w": np.full(1000, i + step)}, str(tmp_path / str(i)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(4):
        assert (tessera.load_all(str(tmp_path / str(i)))["w"] == i + 4).all()


def test_load_all_places_what_only_other_ranks_saved(ckpt):
    """Pipeline-style: each rank holds its own layers and RNG state; rank 0's structure lacks
    the others', which load_all places by their paths."""
    def save(comm):
        r = comm.rank
        state = {"model": {"layers": {str(r): {"w": tessera.ShardedTensor(torch.full((2,), r))}},
                           "flat": {f"block.{r}.bias": tessera.ShardedTensor(torch.ones(1) * r)}},
                 "rng": [{str(r): tessera.ShardedObject({"seed": r})}],
                 "raw": {str(r): tessera.ShardedObject(bytes([r]))}}
        tessera.save(state, ckpt, comm=comm)

    tessera.run_local(3, save)
    loaded = tessera.load_all(ckpt)
    layers = loaded["model"]["layers"]
    assert sorted(layers) == ["0", "1", "2"]
    assert all(torch.equal(layers[str(r)]["w"], torch.full((2,), r)) for r in range(3))
    assert sorted(loaded["model"]["flat"]) == ["block.0.bias", "block.1.bias", "block.2.bias"]
    assert loaded["rng"][0] == {"0": {"seed": 0}, "1": {"seed": 1}, "2": {"seed": 2}}
    assert loaded["raw"] == {"0": b"\x00", "1": b"\x01", "2": b"\x02"}


@pytest.mark.parametrize("sharing", ["broadcast", "all_gather", "read_once"])
def test_read_sharing_and_the_plan_cache(ckpt, sharing):
    n = 1 << 16

    def fn(comm):
        state = {"w": torch.arange(n, dtype=torch.float32), "step": 1}  # replicated
        first = tessera.save(state, ckpt, comm=comm, sync=False)
        second = tessera.save(state, ckpt, comm=comm, sync=False)
        target = {"w": torch.zeros(n), "step": 0}
        report = tessera.load(target, ckpt, comm=comm, read_sharing=sharing,
                              exchange_bytes=1 << 14)
        assert torch.equal(target["w"], state["w"]) and target["step"] == 1
        return (first.plan_cache_hit, second.plan_cache_hit, report.bytes_read,
                report.bytes_received, report.bytes_needed)

    results = tessera.run_local(2, fn)
    assert [r[:2] for r in results] == [(False, True)] * 2
    # Every rank needs every byte; what it does not read from storage it receives, and the
    # tensor is read from storage once between the ranks.
    for _, _, read, received, needed in results:
        assert needed > 4 * n and read + received == needed
    assert sum(r[2] for r in results) < 4 * n + 100  # + the small object, read by each
