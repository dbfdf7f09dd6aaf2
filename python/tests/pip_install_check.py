"""`pip wheel .` builds a wheel the way a user's pip does, and it works in a fresh environment.

1. `pip wheel --no-deps .` with build isolation: pip fetches the build requirements of
   pyproject.toml (scikit-build-core, pybind11) into a throw-away environment; nothing of this
   environment's packages is used.
2. A fresh virtual environment of the same interpreter gets the wheel, torch 2.13.0 (the CPU
   build on this machine's disk) and NumPy 2, and from another directory, with nothing of the
   source tree on the path, imports tessera, saves and loads NumPy arrays and torch tensors, and
   runs the `tessera` command the wheel installed.
3. The extension links neither libtorch (one build serves any torch version) nor libmpi (only
   tessera.mpi_comm() loads tessera's MPI module).

Run by ctest (python_pip_wheel). Exit status 0 when every check holds.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]

CHECK = r"""
import os, subprocess, sys
import numpy as np
import torch
import tessera, tessera.megatron, tessera.torch
site = sys.argv[1]
assert tessera.__file__.startswith(site), tessera.__file__
assert np.__version__.startswith("2."), np.__version__
assert torch.__version__.startswith("2.13"), torch.__version__
assert "mpi4py" not in sys.modules, "importing tessera imported mpi4py"
path = os.path.join(sys.argv[2], "ckpt")
state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "t": torch.arange(4.0), "step": 4}
tessera.save(state, path)
loaded = tessera.load_all(path)
assert loaded["step"] == 4 and loaded["w"].tolist() == [[0, 1, 2], [3, 4, 5]], loaded
assert torch.equal(loaded["t"], torch.arange(4.0)), loaded
out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "tessera"), "verify", path],
                     check=True, capture_output=True, text=True).stdout
print(out)
print("installed tessera", tessera.__version__, "works from", site)
"""


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, check=True, **kwargs)


def shared_libraries(path: pathlib.Path) -> list[str]:
    """The names of the shared libraries `path` needs (ldd), without load addresses."""
    out = run(["ldd", str(path)], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        env.pop("PYTHONPATH", None)
        wheels = pathlib.Path(tmp, "wheels")
        # The build type of scripts/build, so that ccache serves the objects it compiled (a
        # Release build of the whole library would add minutes to every test run); everything
        # else is what a user's `pip wheel .` does.
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels),
             "--config-settings=cmake.build-type=RelWithDebInfo", str(ROOT)], env=env)
        built = sorted(wheels.glob("tessera-*.whl"))
        assert len(built) == 1, built

        venv = pathlib.Path(tmp, "venv")
        run([sys.executable, "-m", "venv", str(venv)], env=env)
        python = venv / "bin" / "python"
        run([str(python), "-m", "pip", "install", "-q", str(built[0]), "torch==2.13.0",
             "numpy>=2"], env=env)
        site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                   capture_output=True, text=True, env=env).stdout.strip()

        extension = sorted(pathlib.Path(site, "tessera").glob("_tessera.*.so"))
        assert len(extension) == 1, extension
        names = shared_libraries(extension[0])
        assert not any("torch" in n or "c10" in n for n in names), names
        assert not any("mpi" in n for n in names), names

        work = pathlib.Path(tmp, "work")
        work.mkdir()
        run([str(python), "-c", CHECK, site, str(work)], env=env, cwd=work)


if __name__ == "__main__":
    main()
