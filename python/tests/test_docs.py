"""Every ```python block of README.md and docs/PYTHON.md runs as written: each in a fresh
interpreter, as a script in an empty directory (relative checkpoint paths land there), with
only the installed package importable (examples never import test helpers). A block that
names an "s3://" path runs against moto on loopback, with the AWS variables set as a user sets
them and the bucket "my-bucket" created. A block whose first line starts with "# illustrative"
cannot run here (it says why) and is only compiled."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import moto_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/PYTHON.md")
ILLUSTRATIVE = "# illustrative"


def blocks():
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text.count("\n", 0, match.start()) + 1
            found.append(pytest.param(match.group(1), id=f"{doc}:{line}"))
    return found


BLOCKS = blocks()
RUNNABLE = [b for b in BLOCKS if not b.values[0].startswith(ILLUSTRATIVE)]
ILLUSTRATIVE_BLOCKS = [b for b in BLOCKS if b.values[0].startswith(ILLUSTRATIVE)]


def test_the_docs_have_examples_and_few_illustrative_ones():
    assert len(BLOCKS) >= 6
    illustrative = [b for b in BLOCKS if b.values[0].startswith(ILLUSTRATIVE)]
    assert len(illustrative) <= 2, [b.id for b in illustrative]


@pytest.mark.parametrize("code", ILLUSTRATIVE_BLOCKS)
def test_illustrative_example_compiles(code):
    compile(code, "example.py", "exec")


@pytest.fixture(scope="module")
def s3_environment():
    """The variables of a user of an S3-compatible server: moto's, with "my-bucket" in it."""
    with moto_server() as values:
        env = {k: v for k, v in values.items() if k.startswith("AWS_")}
        env["AWS_CONFIG_FILE"] = env["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
        import boto3
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"],
                     aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]).create_bucket(
                         Bucket="my-bucket")
        yield env


@pytest.mark.parametrize("code", RUNNABLE)
def test_example_runs(code, tmp_path, request):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if "s3://" in code:
        env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
        env.update(request.getfixturevalue("s3_environment"))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def sh_blocks(doc):
    """The ```sh blocks of `doc`, with backslash-continued lines joined."""
    text = (ROOT / doc).read_text()
    return [m.group(1).replace("\\\n", " ")
            for m in re.finditer(r"^```sh\n(.*?)^```", text, re.S | re.M)]


def install_recipe(doc):
    recipes = [b for b in sh_blocks(doc) if b.startswith("apt-get install")]
    assert len(recipes) == 1, f"{doc} has {len(recipes)} install recipes, not one"
    return recipes[0]


def test_readme_and_python_guide_give_one_install_recipe():
    assert install_recipe("README.md") == install_recipe("docs/PYTHON.md")


def test_install_recipe_names_every_debian_library_of_the_build():
    """The apt line holds every -dev package scripts/setup installs for the C++ build (a line
    without the S3 libraries builds a package that lacks S3)."""
    recipe = install_recipe("README.md").split()
    setup = (ROOT / "scripts/setup").read_text()
    listed = re.search(r"^packages=\((.*?)^\)", setup, re.S | re.M).group(1)
    libraries = {w for w in re.sub(r"#[^\n]*", "", listed).split()
                 if w.startswith("lib") and w.endswith("-dev") and "mpi" not in w
                 and w not in ("libgtest-dev", "libgmock-dev", "libbenchmark-dev",
                               "libclang-rt-14-dev")}
    assert libraries, "no library packages found in scripts/setup"
    assert libraries <= set(recipe), sorted(libraries - set(recipe))


def test_megatron_install_line_matches_the_tested_pins():
    """docs/PYTHON.md's Megatron line pins what requirements/dev.txt tests (triton and psutil
    included: megatron.core imports the one, its save needs the other)."""
    lines = [b for b in sh_blocks("docs/PYTHON.md") if "megatron-core==" in b]
    assert len(lines) == 1, lines
    pins = dict(w.split("==") for w in lines[0].split() if "==" in w)
    assert {"torch", "megatron-core", "triton", "psutil"} <= set(pins), pins
    tested = dict(line.split("==", 1) for line in
                  (ROOT / "requirements/dev.txt").read_text().splitlines()
                  if "==" in line and not line.startswith("#"))
    for name, version in pins.items():
        assert tested.get(name) == version, (name, version, tested.get(name))
