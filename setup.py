"""Builds the `_tessera` extension with CMake for `pip install .` (pyproject.toml has the
metadata). The CMake build directory is kept between installs (build/pip/cmake, or
$TESSERA_PIP_BUILD_DIR) so a reinstall rebuilds only what changed; ccache, when installed,
serves objects already compiled by scripts/build. $TESSERA_JOBS sets the parallel jobs."""

import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = pathlib.Path(os.environ.get("TESSERA_PIP_BUILD_DIR",
                                                ROOT / "build" / "pip" / "cmake"))
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = ["cmake", "-S", str(ROOT), "-B", str(build_dir),
                     "-DCMAKE_BUILD_TYPE=RelWithDebInfo",  # as scripts/build: ccache hits
                     "-DTESSERA_BUILD_TESTS=OFF", "-DTESSERA_BUILD_TOOLS=OFF",
                     "-DTESSERA_WITH_PYTHON=ON", f"-DTESSERA_PYTHON={sys.executable}"]
        try:  # pybind11 from pip (an isolated build) or Debian's python3-pybind11
            import pybind11
            configure.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
        except ImportError:
            pass  # CMake's own search (Debian's pybind11-dev)
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        subprocess.run(configure, check=True)
        jobs = os.environ.get("TESSERA_JOBS", str(os.cpu_count() or 1))
        # Objects compiled with -g hash the build directory into ccache's key unless told not
        # to: then an install into another build directory reuses them.
        env = dict(os.environ, CCACHE_NOHASHDIR="1")
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "_tessera", "-j", jobs],
                       check=True, env=env)
        built = sorted((build_dir / "python" / "tessera").glob("_tessera*.so"))
        if len(built) != 1:
            raise RuntimeError(f"expected one _tessera extension in {build_dir}/python/tessera, "
                               f"found {[p.name for p in built]}")
        destination = pathlib.Path(self.get_ext_fullpath(ext.name))
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], destination)


setup(ext_modules=[CMakeExtension("tessera._tessera")], cmdclass={"build_ext": CMakeBuild},
      options={"build": {"build_base": str(pathlib.Path("build") / "pip")},
               "egg_info": {"egg_base": str(pathlib.Path("build") / "pip")}})
