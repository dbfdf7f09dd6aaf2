"""tessera.async_save hands the save to a thread of its own (tessera/_handover.py): the caller's
call makes no collective after the first one over a comm, flattens nothing, and copies only the
containers of its state dict; errors reach every rank through the handle."""

import gc
import pickle
import threading
import weakref

import numpy as np
import pytest

import tessera
from tessera import _tessera


class CountingComm:
    """A Python Comm (tessera.python_comm) over a tessera Comm, counting its collectives."""

    def __init__(self, inner):
        self.inner = inner
        self.rank, self.size = inner.rank, inner.size
        self.calls = 0

    def barrier(self):
        self.calls += 1
        self.inner.barrier()

    def broadcast(self, data, root):
        self.calls += 1
        return self.inner.broadcast(data, root)

    def all_gather(self, data):
        self.calls += 1
        return self.inner.all_gather(data)

    def gather(self, data, root):
        self.calls += 1
        return self.inner.gather(data, root)

    def scatter(self, data, root):
        self.calls += 1  # tessera.Comm has no scatter of its own: root's list, broadcast
        blob = self.inner.broadcast(pickle.dumps(data) if self.rank == root else None, root)
        return pickle.loads(blob)[self.rank]

    def all_reduce(self, values, op):
        self.calls += 1
        return self.inner.all_reduce(values, op)

    def split(self, color, key):
        self.calls += 1
        assert (color, key) == (0, self.rank)
        return CountingComm(_tessera._split_comm(self.inner))


def rank_state(comm, value):
    """Rank r holds rows [2r, 2r + 2) of a [2 * size, 3] tensor, and a step."""
    rows = np.full((2, 3), value + comm.rank, dtype=np.float32)
    return {"w": tessera.ShardedTensor(rows, (2 * comm.size, 3), (2 * comm.rank, 0)),
            "step": value}


def test_after_the_first_call_a_deferred_save_makes_no_collective_in_the_call(tmp_path):
    def run(inner):
        counting = CountingComm(inner)
        comm = tessera.python_comm(counting)
        first = tessera.async_save(rank_state(comm, 1), str(tmp_path / "a"), comm=comm,
                                   staging="deferred")
        after_first = counting.calls  # the split of the hand-over's communicator
        handles = [tessera.async_save(rank_state(comm, v), str(tmp_path / f"s{v}"), comm=comm,
                                      staging="deferred") for v in (2, 3)]
        in_calls = counting.calls - after_first
        for h in [first] + handles:
            h.wait()
        return after_first, in_calls, counting.calls - after_first

    for after_first, in_calls, total in tessera.run_local(2, run):
        assert after_first >= 1  # the split
        assert in_calls == 0
        assert total == 0  # the saves talk over the private communicators only
    for v in (1, 2, 3):
        path = str(tmp_path / ("a" if v == 1 else f"s{v}"))
        loaded = tessera.load_all(path)
        np.testing.assert_array_equal(
            loaded["w"], np.concatenate([np.full((2, 3), v + r, np.float32) for r in (0, 1)]))
        assert loaded["step"] == v


def test_a_bad_state_on_one_rank_fails_wait_staged_on_every_rank_naming_it(tmp_path):
    def run(comm):
        state = rank_state(comm, 1)
        if comm.rank == 1:
            state["bad"] = np.zeros((3, 3)).T  # not contiguous
        handle = tessera.async_save(state, str(tmp_path / "bad"), comm=comm, staging="deferred")
        with pytest.raises(tessera.InvalidArgumentError) as staged:
            handle.wait_staged()
        with pytest.raises(tessera.InvalidArgumentError):
            handle.wait()
        assert handle.done() and isinstance(handle.exception(), tessera.InvalidArgumentError)
        # The comm still works for the next save, on every rank.
        tessera.async_save(rank_state(comm, 5), str(tmp_path / "good"), comm=comm,
                           staging="deferred").wait()
        return str(staged.value)

    messages = tessera.run_local(2, run)
    assert "not contiguous" in messages[1]
    assert "rank 1" in messages[0] and "not contiguous" in messages[0]
    assert tessera.load_all(str(tmp_path / "good"))["step"] == 5
    with pytest.raises(tessera.Error):
        tessera.read_metadata(str(tmp_path / "bad"))  # nothing committed


def test_an_option_one_rank_got_wrong_is_raised_there_at_once_and_fails_the_others(tmp_path):
    def run(comm):
        options = {"num_io_threads": "two"} if comm.rank == 0 else {}
        try:
            handle = tessera.async_save(rank_state(comm, 1), str(tmp_path / "c"), comm=comm,
                                        staging="deferred", **options)
        except TypeError as e:
            return f"call: {e}"
        with pytest.raises(tessera.InvalidArgumentError) as e:
            handle.wait()
        return f"wait: {e.value}"

    at_rank0, at_rank1 = tessera.run_local(2, run)
    assert at_rank0.startswith("call: ")
    assert at_rank1.startswith("wait: ") and "rank 0" in at_rank1


def test_the_containers_are_the_callers_once_the_call_returns(tmp_path):
    w = np.arange(6, dtype=np.float32)
    state = {"model": {"w": w}, "extra": [1, 2]}
    handle = tessera.async_save(state, str(tmp_path / "c"), staging="deferred")
    state["model"]["v"] = np.ones(4)  # the dicts and lists may change at once
    state["extra"].append(3)
    del state["model"]["w"]
    handle.wait()
    loaded = tessera.load_all(str(tmp_path / "c"))
    assert sorted(loaded) == ["extra", "model"] and sorted(loaded["model"]) == ["w"]
    np.testing.assert_array_equal(loaded["model"]["w"], w)
    assert loaded["extra"] == [1, 2]


def test_background_nice_is_checked_and_passed_on(tmp_path):
    with pytest.raises(tessera.InvalidArgumentError, match="background_nice must be 0 to 19"):
        tessera.async_save({"w": np.zeros(2)}, str(tmp_path / "n"), background_nice=25)
    tessera.async_save({"w": np.zeros(2)}, str(tmp_path / "n"), background_nice=0).wait()
    assert tessera.read_metadata(str(tmp_path / "n")).find_tensor("w") is not None


def test_a_staging_budget_streams_the_state_and_saves_it_whole(tmp_path):
    rng = np.random.default_rng(3)
    state = {"w": rng.standard_normal((256, 1024)).astype(np.float32),  # 1 MiB
             "b": rng.integers(0, 255, 100, dtype=np.uint8), "step": 4}
    for staging in ("blocking", "deferred"):
        path = str(tmp_path / staging)
        handle = tessera.async_save(state, path, staging=staging, staging_budget_bytes=64 << 10)
        handle.wait_staged()
        handle.wait()
        loaded = tessera.load_all(path)
        np.testing.assert_array_equal(loaded["w"], state["w"])
        np.testing.assert_array_equal(loaded["b"], state["b"])
        assert loaded["step"] == 4
    with pytest.raises(tessera.InvalidArgumentError, match="staging_budget_bytes must be >= 0"):
        tessera.async_save(state, str(tmp_path / "neg"), staging_budget_bytes=-1)
    with pytest.raises(tessera.InvalidArgumentError, match="check_unchanged_until_staged"):
        tessera.async_save(state, str(tmp_path / "check"), staging="deferred",
                           check_unchanged_until_staged=True,
                           staging_budget_bytes=64 << 10).wait_staged()


def test_the_manager_passes_its_staging_budget_on(tmp_path):
    state = {"w": np.arange(1 << 16, dtype=np.float64)}  # 512 KiB
    with pytest.raises(tessera.InvalidArgumentError, match="staging_budget_bytes"):
        tessera.CheckpointManager(str(tmp_path / "bad"), staging_budget_bytes=-5)
    manager = tessera.CheckpointManager(str(tmp_path / "m"), staging_budget_bytes=32 << 10)
    manager.save(1, state)
    manager.wait()
    np.testing.assert_array_equal(tessera.load_all(str(tmp_path / "m" / "iter_0000001"))["w"],
                                  state["w"])


def handover_threads():
    return [t for t in threading.enumerate() if t.name == "tessera-async-handover"]


def test_dropping_the_comm_ends_its_hand_over_thread(tmp_path):
    gc.collect()  # comms of earlier tests end their threads now, not in the middle
    before = set(handover_threads())
    comm = tessera.single_rank_comm()
    tessera.async_save({"w": np.zeros(2)}, str(tmp_path / "d"), comm=comm,
                       staging="deferred").wait()
    new = set(handover_threads()) - before
    assert len(new) == 1
    del comm
    gc.collect()
    assert not new & set(handover_threads())


def test_a_rank_local_save_keeps_no_reference_to_the_comm(tmp_path):
    def run(comm):
        tessera.async_save(rank_state(comm, 7), str(tmp_path / "local"), comm=comm,
                           collective=False, save_tag="step-7", staging="deferred").wait()
        return weakref.ref(comm)

    refs = tessera.run_local(2, run)
    gc.collect()
    assert all(ref() is None for ref in refs)  # its submitter did not keep it alive
    assert tessera.load_all(str(tmp_path / "local"))["step"] == 7
