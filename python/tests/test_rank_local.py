"""Rank-local saves (collective=False): no message between ranks, parts merged on read,
tessera.finalize, and the errors of an incomplete save."""
import os

import numpy as np
import pytest

import tessera


def _rank_state(full, comm, bias):
    r = comm.rank
    rows = full.shape[0] // comm.size
    piece = tessera.ShardedTensor(full[rows * r:rows * (r + 1)].copy(), full.shape, (rows * r, 0))
    # The bias is replicated on every rank: only the main replica (rank 0) writes it.
    shared = tessera.ShardedTensor(bias.copy(), bias.shape, (0,), replica_id=r)
    return {"w": piece, "b": shared, "step": 7}


def test_rank_local_save_loads_in_another_layout_and_finalizes(tmp_path):
    path = str(tmp_path / "ck")
    full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    bias = np.arange(6, dtype=np.float32)

    def save(comm):
        return tessera.save(_rank_state(full, comm, bias), path, comm=comm, collective=False,
                            save_tag="step-7", sync=False).bytes_written

    def save_collectively(comm):
        return tessera.save(_rank_state(full, comm, bias), str(tmp_path / "collective"),
                            comm=comm, sync=False).total_bytes

    # Each unique byte written once, as by a collective save (replicas not main write nothing).
    assert sum(tessera.run_local(4, save)) == tessera.run_local(4, save_collectively)[0]
    names = os.listdir(path)
    assert sum(n.startswith("tessera.manifest.rank-") for n in names) == 4
    assert "tessera.manifest" not in names
    loaded = tessera.load_all(path)
    np.testing.assert_array_equal(loaded["w"], full)
    np.testing.assert_array_equal(loaded["b"], bias)

    def load_columns(comm):  # 2 ranks, column split
        c = comm.rank
        target = {"w": tessera.ShardedTensor(np.zeros((8, 3), np.float32), (8, 6), (0, 3 * c))}
        tessera.load(target, path, comm=comm, strict=False)
        return target["w"].data

    with pytest.warns(tessera.PartialLoadWarning):
        halves = tessera.run_local(2, load_columns)
    np.testing.assert_array_equal(np.concatenate(halves, axis=1), full)
    tessera.verify(path)
    merged = tessera.finalize(path)
    assert merged.num_ranks == 4
    names = os.listdir(path)
    # One commit holds the checkpoint now: "tessera.manifest.<n>" (docs/FORMAT.md, 4).
    assert any(n.startswith("tessera.manifest.") and n.rsplit(".", 1)[1].isdigit() for n in names)
    assert not any(n.startswith("tessera.manifest.rank-") for n in names)
    np.testing.assert_array_equal(tessera.load_all(path)["w"], full)
    with pytest.raises(tessera.FailedPreconditionError, match="nothing to finalize"):
        tessera.finalize(path)


def test_incomplete_rank_local_save_names_the_missing_rank(tmp_path):
    path = str(tmp_path / "ck")
    full = np.ones((4, 2), np.float32)
    bias = np.zeros(2, np.float32)

    def save(comm):
        if comm.rank == 1:
            return None  # died before committing its part
        return tessera.save(_rank_state(full, comm, bias), path, comm=comm, collective=False,
                            save_tag="t", sync=False)

    tessera.run_local(2, save)
    with pytest.raises(tessera.FailedPreconditionError, match=r"rank 1 \(of 2\)"):
        tessera.load_all(path)
    with pytest.raises(tessera.FailedPreconditionError, match=r"rank 1 \(of 2\)"):
        tessera.finalize(path)


def test_rank_local_save_needs_a_tag_named_in_python_terms(tmp_path):
    with pytest.raises(tessera.InvalidArgumentError, match="save_tag is required when collective is false"):
        tessera.save({"x": np.ones(3)}, str(tmp_path / "ck"), collective=False)
