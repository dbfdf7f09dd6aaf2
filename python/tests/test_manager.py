"""tessera.CheckpointManager: saves in the background, latest from what is committed, restore
with fallback, retention, leases, per-rank state, failures never lost (next call, exit status),
and a training loop killed with SIGKILL at random moments."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import tessera


def _state(step):
    """A state whose every byte depends on the step."""
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32),
            "opt": {"m": rng.integers(0, 1 << 30, 100, dtype=np.int64)},
            "step": step}


def _blank():
    return {"w": np.zeros((64, 32), np.float32), "opt": {"m": np.zeros(100, np.int64)},
            "step": None}


def _assert_holds(state, step):
    want = _state(step)
    assert state["step"] == step
    assert state["w"].tobytes() == want["w"].tobytes()
    assert state["opt"]["m"].tobytes() == want["opt"]["m"].tobytes()


def _corrupt(directory):
    name = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))[0]
    path = os.path.join(directory, name)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 64)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_save_restore_latest_and_the_step_where_ls_shows_it(tmp_path, cli):
    root = tmp_path / "run"
    with tessera.CheckpointManager(root, keep_last=2) as manager:
        assert manager.latest_step() is None
        assert manager.restore(_blank()) is None  # a fresh run
        for step in range(1, 5):
            saved = manager.save(step, _state(step))
            assert not saved.skipped and saved.path == str(root / f"iter_{step:07d}")
        manager.wait()
        assert manager.all_steps() == [3, 4]
        assert manager.latest_step() == 4
        state = _blank()
        restored = manager.restore(state)
        assert restored.step == 4 and restored.skipped == []
        assert restored.user_metadata["step"] == "4"
        _assert_holds(state, 4)
        assert [r.reason for r in manager.last_retention.steps][-1] == "the newest committed"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert tessera.read_metadata(root / "iter_0000003").user_metadata["step"] == "3"
    listing = json.loads(subprocess.run([cli, "ls", "--json", str(root)], check=True,
                                        capture_output=True, text=True).stdout)
    assert {c["path"]: c["step"] for c in listing["checkpoints"]} == {"iter_0000003": "3",
                                                                      "iter_0000004": "4"}
    out = subprocess.run([cli, "latest", "--step", str(root)], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "4"


def test_a_damaged_newest_checkpoint_falls_back_loudly(tmp_path):
    root = tmp_path / "run"
    manager = tessera.CheckpointManager(root, async_save=False)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    _corrupt(root / "iter_0000003")
    resumed = tessera.CheckpointManager(root)
    state = _blank()
    with pytest.warns(tessera.CheckpointWarning, match="step 3 of .* failed its checks"):
        restored = resumed.restore(state)
    assert restored.step == 2
    (step, error, failed_checks), = restored.skipped
    assert step == 3 and failed_checks and isinstance(error, tessera.CorruptCheckpointError)
    _assert_holds(state, 2)
    # The run goes on from step 2: step 3 is saved again, and is the latest.
    resumed.save(3, _state(3))
    resumed.close()
    assert resumed.latest_step() == 3
    # Asked for by number, a damaged step is an error, not a fallback.
    _corrupt(root / "iter_0000003")
    with pytest.raises(tessera.CorruptCheckpointError, match="restoring step 3"):
        tessera.CheckpointManager(root).restore(_blank(), step=3)


def test_a_missing_key_is_an_error_not_a_fresh_start(tmp_path):
    root = tmp_path / "run"
    manager = tessera.CheckpointManager(root, async_save=False)
    manager.save(1, _state(1))
    with pytest.raises(tessera.MissingKeysError):
        manager.restore({**_blank(), "extra": np.zeros(3)})


def test_a_failed_background_save_raises_in_the_next_call(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "iter_0000002").write_text("a file where step 2's directory goes")
    manager = tessera.CheckpointManager(root)
    manager.save(1, _state(1))
    manager.save(2, _state(2))  # fails in the background
    with pytest.raises(tessera.FailedPreconditionError,
                       match=r"nothing was saved for step 3: the save of step 2 .* failed"):
        manager.save(3, _state(3))
    manager.save(4, _state(4))  # told once; the run may go on
    manager.close()
    assert manager.all_steps() == [1, 4]
    with pytest.raises(tessera.FailedPreconditionError, match="closed"):
        manager.save(5, _state(5))


_UNSEEN = """
import sys, numpy as np, tessera
root = sys.argv[1]
how = sys.argv[2]
if how.startswith("manager"):
    manager = tessera.CheckpointManager(root)
    manager.save(1, {"w": np.ones(4)})   # root/iter_0000001 is a file: fails in the background
    if how == "manager-waited":
        try:
            manager.wait()
        except tessera.Error as e:
            print("seen:", type(e).__name__)
    if how == "manager-dropped":
        del manager                        # destroyed with the failure unseen
else:
    handle = tessera.async_save({"w": np.ones(4)}, root + "/iter_0000001")
    if how == "async-waited":
        try:
            handle.wait()
        except tessera.Error as e:
            print("seen:", type(e).__name__)
print("the script ends normally")
"""


@pytest.mark.parametrize("how,status", [("manager", 1), ("manager-dropped", 1),
                                        ("manager-waited", 0), ("async", 1), ("async-waited", 0)])
def test_the_exit_status_says_when_a_save_failed_unseen(tmp_path, how, status):
    root = tmp_path / "run"
    root.mkdir()
    (root / "iter_0000001").write_text("in the way")
    done = subprocess.run([sys.executable, "-c", _UNSEEN, str(root), how], capture_output=True,
                          text=True, timeout=120)
    assert "the script ends normally" in done.stdout
    assert done.returncode == status, done.stderr
    if status:
        assert "tessera: error:" in done.stderr and "nothing reported it before exit" in done.stderr
        assert "iter_0000001" in done.stderr
    else:
        assert "seen: FailedPreconditionError" in done.stdout
        assert "tessera: error" not in done.stderr


def test_a_run_that_forgot_to_restore_cannot_overwrite_newer_checkpoints(tmp_path):
    root = tmp_path / "run"
    first = tessera.CheckpointManager(root, async_save=False)
    for step in (1, 2, 3):
        first.save(step, _state(step))
    fresh = tessera.CheckpointManager(root, async_save=False)
    with pytest.raises(tessera.FailedPreconditionError, match="committed checkpoint of step 3"):
        fresh.save(1, _state(1))
    assert fresh.restore(_blank()).step == 3
    fresh.save(4, _state(4))


def test_prune_dry_run_marks_and_leases(tmp_path, cli):
    root = tmp_path / "run"
    manager = tessera.CheckpointManager(root, async_save=False)
    for step in range(1, 7):
        manager.save(step, _state(step))
    manager.mark(1, "best eval loss")
    before = sorted(os.listdir(root))
    dry = manager.prune(keep_last=2, dry_run=True)
    assert dry.dry_run and dry.deleted == 3 and sorted(os.listdir(root)) == before
    with manager.lease(2) as path:
        assert path == str(root / "iter_0000002")
        report = manager.prune(keep_last=2)
        assert report.deleted == 2
        fate = {d.step: (d.deleted, d.reason) for d in report.steps}
        assert fate[1] == (False, "marked to be kept")
        assert not fate[2][0] and fate[2][1].startswith("being read by process")
        assert fate[3][0] and fate[4][0]
    assert manager.all_steps() == [1, 2, 5, 6]
    assert [s.marked for s in manager.steps()] == [True, False, False, False]
    # The CLI prunes the same way once the lease is gone.
    done = subprocess.run([cli, "prune", str(root), "--keep-last", "2", "--json"], check=True,
                          capture_output=True, text=True)
    assert json.loads(done.stdout)["deleted"] == 1
    assert manager.all_steps() == [1, 5, 6]


def test_per_rank_state_keeps_its_world_size(tmp_path):
    root = str(tmp_path / "run")

    def save(comm):
        manager = tessera.CheckpointManager(root, comm=comm, layout="dp4")
        state = {"w": tessera.ShardedTensor(np.full((2, 4), comm.rank, np.float32), (8, 4),
                                            (2 * comm.rank, 0))}
        manager.save(1, state, per_rank={"rng": ("seed", 100 + comm.rank),
                                         "loader": {"position": 10 * comm.rank}})
        manager.close()

    tessera.run_local(4, save)

    def restore(comm, per_rank_map=None):
        manager = tessera.CheckpointManager(root, comm=comm, layout=f"dp{comm.size}")
        rows = 8 // comm.size
        state = {"w": tessera.ShardedTensor(np.zeros((rows, 4), np.float32), (8, 4),
                                            (rows * comm.rank, 0))}
        return manager.restore(state, per_rank_map=per_rank_map).per_rank

    assert tessera.run_local(4, restore) == [
        {"rng": ("seed", 100 + r), "loader": {"position": 10 * r}} for r in range(4)]
    with pytest.raises(tessera.InvalidArgumentError,
                       match=r"per-rank state 'loader', 'rng' of step 1 was saved by 4 ranks "
                             r"\(layout dp4\); this run has 2 ranks \(layout dp2\)"):
        tessera.run_local(2, restore)
    halves = tessera.run_local(2, lambda comm: restore(comm, lambda r, n, saved: [2 * r, 2 * r + 1]))
    assert halves[1]["rng"] == [("seed", 102), ("seed", 103)]


def test_torch_save_state_through_the_manager_and_its_async_form(tmp_path):
    import torch
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    root = tmp_path / "run"
    manager = tessera.CheckpointManager(root, keep_last=1)
    rng = torch.get_rng_state()
    saved = tessera.torch.save_state(manager, model=net, optimizer=opt, step=7,
                                     rng=tessera.torch.per_rank(rng))
    assert saved.step == 7
    manager.close()
    assert tessera.read_metadata(root / "iter_0000007").user_metadata["step"] == "7"
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    extra = tessera.torch.load_state(tessera.CheckpointManager(root), model=fresh,
                                     optimizer=fresh_opt)
    assert extra["step"] == 7 and torch.equal(extra["rng"], rng)
    assert torch.equal(fresh.weight, net.weight)
    assert tessera.torch.load_state(tessera.CheckpointManager(tmp_path / "empty"),
                                    model=fresh) is None
    # The async form with a path, which records the step too.
    handle = tessera.torch.async_save_state(tmp_path / "one", model=net, step=9)
    handle.wait()
    assert tessera.read_metadata(tmp_path / "one").user_metadata["step"] == "9"
    # A save_state of 2 ranks restored by 1: its per-rank RNG says so, unless mapped.
    two = str(tmp_path / "two")

    def save2(comm):
        tessera.torch.save_state(two, comm=comm, step=1, rng=tessera.torch.per_rank(comm.rank))

    tessera.run_local(2, save2)
    with pytest.raises(tessera.InvalidArgumentError,
                       match="extra 'rng' was saved per rank by 2 ranks; this run has 1"):
        tessera.torch.load_state(two)
    assert tessera.torch.load_state(two, per_rank_map=lambda r, n, saved: 1)["rng"] == 1


_LOOP = """
import sys, numpy as np, tessera
root, seed_steps = sys.argv[1], int(sys.argv[2])

def state(step):
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(1 << 16).astype(np.float32), "step": step}

manager = tessera.CheckpointManager(root, keep_last=2)
blank = {"w": np.zeros(1 << 16, np.float32), "step": None}
restored = manager.restore(blank)
step = 0
if restored is not None:
    step = restored.step
    assert blank["step"] == step and blank["w"].tobytes() == state(step)["w"].tobytes()
print("resumed", step, flush=True)
while step < seed_steps:
    step += 1
    manager.save(step, state(step))
manager.close()
"""


def test_a_loop_killed_at_random_moments_resumes_from_a_latest_that_loads(tmp_path):
    seed = int(os.environ.get("TESSERA_KILL_SEED", "7"))
    trials = int(os.environ.get("TESSERA_KILL_TRIALS", "10"))
    print(f"kill test: seed {seed}, {trials} trials")
    rng = random.Random(seed)
    root = str(tmp_path / "run")
    previous = None
    for trial in range(trials):
        loop = subprocess.Popen([sys.executable, "-c", _LOOP, root, "1000000"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # Past the interpreter's start (about 0.3-1 s here), then anywhere in the saves.
        assert loop.stdout.readline().startswith("resumed"), loop.stderr.read()
        time.sleep(rng.uniform(0, 0.3))
        loop.send_signal(signal.SIGKILL)
        loop.communicate()
        assert loop.returncode == -signal.SIGKILL, f"seed {seed}, trial {trial}"
        manager = tessera.CheckpointManager(root)
        latest = manager.latest_step()
        if previous is not None:
            assert latest is not None and latest >= previous, f"seed {seed}, trial {trial}"
        if latest is not None:
            assert manager.all_steps()[-1] == latest
            state = {"w": np.zeros(1 << 16, np.float32), "step": None}
            restored = manager.restore(state, step=latest)
            want = np.random.default_rng(latest).standard_normal(1 << 16).astype(np.float32)
            assert state["step"] == latest and state["w"].tobytes() == want.tobytes(), (
                f"seed {seed}, trial {trial}: step {restored.step} restored other bytes")
        previous = latest
    assert previous is not None, f"seed {seed}: no save ever committed"


def test_torchtitan_and_hugging_face_roots_with_their_step_naming(tmp_path, cli):
    """Issue 30, item 3: roots written by torch DCP as torchtitan names steps (step-<N>) and by
    safetensors as transformers' Trainer does (checkpoint-<N>) are read with step_naming; without
    it, every reader says what it found and which naming to pass, never "a fresh run"."""
    import torch  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    titan = tmp_path / "titan"
    for step in (100, 200, 300):
        dcp.save({"w": torch.full((4, 8), float(step))}, checkpoint_id=str(titan / f"step-{step}"))
    (titan / "tb_logs").mkdir()
    with pytest.raises(tessera.InvalidArgumentError) as error:
        tessera.CheckpointManager(titan).latest_step()
    assert '"step-100", "step-200", "step-300"' in str(error.value)
    assert 'step_naming="torchtitan"' in str(error.value)
    with pytest.raises(tessera.InvalidArgumentError):
        tessera.CheckpointManager(titan).restore({"w": np.zeros((4, 8), np.float32)})
    with pytest.raises(tessera.InvalidArgumentError):
        tessera.CheckpointManager(titan).prune(keep_last=1)

    manager = tessera.CheckpointManager(titan, step_naming="torchtitan")
    assert manager.latest_step() == 300 and manager.all_steps() == [100, 200, 300]
    state = {"w": np.zeros((4, 8), np.float32)}
    restored = manager.restore(state)
    assert restored.step == 300 and restored.path == str(titan / "step-300")
    assert (state["w"] == 300).all()
    report = manager.prune(keep_last=2)
    assert report.deleted == 1
    assert sorted(os.listdir(titan)) == ["step-200", "step-300", "tb_logs"]
    out = subprocess.run([cli, "latest", "--step-naming", "torchtitan", "--step", str(titan)],
                         check=True, capture_output=True, text=True).stdout
    assert out.strip() == "300"

    hf = tmp_path / "hf"
    for step in (500, 1000):
        (hf / f"checkpoint-{step}").mkdir(parents=True)
        save_file({"w": torch.full((2, 2), float(step))},
                  str(hf / f"checkpoint-{step}" / "model.safetensors"))
    (hf / "runs").mkdir()
    with pytest.raises(tessera.InvalidArgumentError, match='step_naming="huggingface"'):
        tessera.CheckpointManager(hf, step_naming="torchtitan").latest_step()
    assert tessera.CheckpointManager(hf, step_naming="hf").latest_step() == 1000
    with pytest.raises(tessera.InvalidArgumentError, match=re.escape("{step:0N}")):
        tessera.CheckpointManager(hf, step_naming="checkpoint-{step:4}")


def test_a_root_that_cannot_be_opened_raises_when_the_manager_is_made() -> None:
    """The manager opens through CheckpointManager::Open: its error comes at construction."""
    with pytest.raises(tessera.InvalidArgumentError, match="names no bucket"):
        tessera.CheckpointManager("s3:///run")

