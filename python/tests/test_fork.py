"""A process forked after an async_save (issue 30, item 16): the child has none of its
parent's threads, so it must neither wait for nor join them. The child exits cleanly and its
own async_save works. Each case runs in a subprocess under a timeout: a hang fails the test."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import tessera

    root, mode = sys.argv[1], sys.argv[2]
    if mode == "parent_failed":
        os.makedirs(root + "/failed")
        open(root + "/failed/iter_0000001", "w").write("in the way")
        m = tessera.CheckpointManager(root + "/failed")
        m.save(1, {"w": np.arange(4.0)})  # fails in the background
        del m  # destroyed with its failure unseen: the parent reports it at its exit
    elif mode == "manager":
        m = tessera.CheckpointManager(root + "/mgr", async_save=True)
        m.save(1, {"w": np.arange(4.0)})
        m.wait()
    else:
        tessera.async_save({"w": np.arange(4.0)}, root + "/parent").wait()
        kept = tessera.async_save({"w": np.arange(5.0)}, root + "/parent2")  # a live handle
        kept.wait()
    pid = os.fork()
    if pid == 0:
        if mode in ("child_saves", "manager"):
            tessera.async_save({"w": np.arange(6.0)}, root + "/child").wait()
            assert list(tessera.load_all(root + "/child")["w"]) == list(range(6))
        if mode == "manager":
            c = tessera.CheckpointManager(root + "/child_mgr", async_save=True)
            c.save(2, {"w": np.arange(3.0)})
            c.wait()
            assert c.latest_step() == 2
        sys.exit(0)  # a normal interpreter exit: atexit hooks and finalisation run
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        print(f"child killed by signal {os.WTERMSIG(status)}")
        sys.exit(3)
    print(f"child exit status {os.WEXITSTATUS(status)}")
    sys.exit(os.WEXITSTATUS(status))
""")


@pytest.mark.parametrize("mode", ["child_exits", "child_saves", "manager", "parent_failed"])
def test_forked_child_after_async_save(tmp_path, mode):
    # Its own session: on a hang, the whole group (the forked child too) is killed.
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{mode}: the forked child (or its parent waiting for it) hung")
    assert "child exit status 0" in stdout, (stdout, stderr)
    if mode == "parent_failed":
        # The parent's unseen failure is reported once, by the parent, never by the child.
        assert proc.returncode == 1, (stdout, stderr)
        assert stderr.count("nothing reported it before exit") == 1, stderr
        assert "iter_0000001" in stderr
    else:
        assert proc.returncode == 0, (stdout, stderr)
