"""Every ```python block of README.md and docs/PYTHON.md runs as written: each in a fresh
interpreter, as a script in an empty directory (relative checkpoint paths land there), with
only the installed package importable (examples never import test helpers). A block whose
first line starts with "# illustrative" cannot run here (it says why) and is only compiled."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("code", RUNNABLE)
def test_example_runs(code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
