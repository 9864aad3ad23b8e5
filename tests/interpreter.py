"""Run a test module's Triton cases under the interpreter, in a child process.

TRITON_INTERPRET must be set before Triton is imported, so each kernel test
module re-runs itself as a script with it set and prints its results as one
JSON line after `RESULTS_JSON `.
"""

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "RESULTS_JSON "


def print_results(results: dict) -> None:
    print(MARKER + json.dumps(results))


def run_interpreter_script(script: str, *args: str, timeout: float = 900) -> dict:
    """Run `script` with TRITON_INTERPRET=1 and return the results it printed."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(script), *args], env=env, capture_output=True, text=True,
        timeout=timeout, cwd=REPO_ROOT,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len(MARKER):])
