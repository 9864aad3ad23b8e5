"""Every script in examples/ runs to the end, as a user would run it (`python examples/NAME.py`).

The CPU suite runs them on the CPU; on a GPU machine the same test runs them on the GPU
(`python -m pytest tests/test_examples.py`). An example that cannot run on a machine (a missing optional
library, say) prints a line starting with `SKIP:` and its reason, and exits 0: the test then skips with
that reason. Examples known to need an optional module (NEEDS) are skipped before they start when it is
missing; an example with a test file of its own (OWN_TEST) is left to it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Examples with a test file of their own, which checks more than that they run
OWN_TEST = {"deepseek_v3_transformers.py": "tests/test_examples_transformers.py"}
EXAMPLES = sorted(path for path in (REPO_ROOT / "examples").glob("*.py") if path.name not in OWN_TEST)
# example file -> the optional module it needs
NEEDS: dict[str, str] = {}


def test_there_are_examples():
    assert len(EXAMPLES) >= 4, EXAMPLES


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_example_runs(example, tmp_path):
    module = NEEDS.get(example.name)
    if module and importlib.util.find_spec(module) is None:
        pytest.skip(f"{example.name} needs {module}, which is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, str(example)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"{example.name} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIP:")]
    if skips:
        pytest.skip(f"{example.name}: {skips[0][len('SKIP:'):].strip()}")
    assert done.stdout.strip(), f"{example.name} printed nothing"
