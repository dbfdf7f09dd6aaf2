"""`python3 -m pip install --no-build-isolation .` builds and installs a working package.

Installs the repository into a scratch directory (--target), then, from another directory
with only that one on the path, imports tessera, saves and loads, and checks that the
extension does not link libtorch (one build serves any torch version). The CMake build
directory is $TESSERA_PIP_BUILD_DIR (kept between runs: an unchanged tree rebuilds nothing).
Run by ctest (python_pip_install)."""

import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]

CHECK = r"""
import os, sys
import numpy as np
import tessera, tessera.megatron, tessera.torch
site = sys.argv[1]
assert tessera.__file__.startswith(site), tessera.__file__
assert tessera._tessera.__file__.startswith(site), tessera._tessera.__file__
path = os.path.join(site, "..", "ckpt")
tessera.save({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": 4}, path)
loaded = tessera.load_all(path)
assert loaded["step"] == 4 and loaded["w"].tolist() == [[0, 1, 2], [3, 4, 5]], loaded
assert "torch" not in sys.modules, "importing tessera imported torch"
print("installed tessera", tessera.__version__, "works from", site)
"""


def main():
    with tempfile.TemporaryDirectory() as tmp:
        site = os.path.join(tmp, "site")
        env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        env.pop("PYTHONPATH", None)  # the build tree's package must not stand in for it
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation",
                        "--no-deps", "--no-index", "--no-cache-dir", "--target", site,
                        str(ROOT)], check=True, env=env)
        installed = sorted(p.name for p in pathlib.Path(site, "tessera").glob("*.py"))
        sources = sorted(p.name for p in (ROOT / "python" / "tessera").glob("*.py"))
        assert installed == sources, (installed, sources)
        extension = list(pathlib.Path(site, "tessera").glob("_tessera*.so"))
        assert len(extension) == 1, extension
        libraries = subprocess.run(["ldd", str(extension[0])], check=True, capture_output=True,
                                   text=True).stdout
        # Library names only: the load addresses ldd prints may spell "c10" (0x...8c10...).
        names = [line.split()[0] for line in libraries.splitlines() if line.strip()]
        assert not any("torch" in n or "c10" in n for n in names), libraries
        run_env = dict(env, PYTHONPATH=site)
        subprocess.run([sys.executable, "-c", CHECK, site], check=True, env=run_env, cwd=tmp)


if __name__ == "__main__":
    main()
