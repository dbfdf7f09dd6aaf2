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
4. The same environment then gets exactly the Megatron-Core install line docs/PYTHON.md gives
   (pinned megatron-core, triton, psutil), and every Python example of README.md and
   docs/PYTHON.md that imports Megatron runs there as written: the docs' line is all a user
   needs.

Run by ctest (python_pip_wheel). Exit status 0 when every check holds.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

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


def megatron_install_line() -> list[str]:
    """The arguments of docs/PYTHON.md's one `pip install ... megatron-core==...` line."""
    text = (ROOT / "docs" / "PYTHON.md").read_text()
    lines = [line for block in re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)
             for line in block.replace("\\\n", " ").splitlines()
             if line.startswith("pip install") and "megatron-core==" in line]
    assert len(lines) == 1, f"docs/PYTHON.md has {len(lines)} Megatron install lines: {lines}"
    return lines[0].split("#")[0].split()[2:]


def megatron_examples() -> list[tuple[str, str]]:
    """(where, code) of every ```python block of the docs that imports Megatron."""
    found = []
    for doc in ("README.md", "docs/PYTHON.md"):
        text = (ROOT / doc).read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            code = match.group(1)
            if re.search(r"^\s*(from|import) megatron", code, re.M) and \
                    not code.startswith("# illustrative"):
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{doc}:{line}", code))
    assert found, "no Megatron example found in the docs"
    return found


def run_megatron_examples(python: pathlib.Path, tmp: str, env: dict) -> None:
    run([str(python), "-m", "pip", "install", "-q", *megatron_install_line()], env=env)
    for where, code in megatron_examples():
        work = pathlib.Path(tempfile.mkdtemp(dir=tmp))
        script = work / "example.py"
        script.write_text(code)
        print(f"+ {where} in the venv of the documented line", flush=True)
        result = subprocess.run([str(python), str(script)], cwd=work, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (
            f"{where} fails in a venv made from the documented install line:\n"
            f"{result.stdout}\n{result.stderr}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        env.pop("PYTHONPATH", None)
        wheels = pathlib.Path(tmp, "wheels")
        # The build type of scripts/build, so that ccache serves the objects it compiled (a
        # Release build of the whole library would add minutes to every test run); everything
        # else is what a user's `pip wheel .` does.
        started = time.monotonic()
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels),
             "--config-settings=cmake.build-type=RelWithDebInfo", str(ROOT)], env=env)
        # The README's build time comes from this line of a CI run.
        print(f"pip wheel took {time.monotonic() - started:.0f} s", flush=True)
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
        run_megatron_examples(python, tmp, env)


if __name__ == "__main__":
    main()
