"""The README's Python blocks run as written (each in a fresh interpreter), its commands are the ones CI runs,
and its links into bench/RESULTS.md name sections that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
README = (REPO_ROOT / "README.md").read_text()


def _blocks(language: str) -> list[tuple[str, str]]:
    """(the heading above it, code) of every fenced block of `language`, in order."""
    blocks, heading = [], "top"
    lines = README.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.strip() == f"```{language}":
            end = lines.index("```", index + 1)
            blocks.append((heading, "\n".join(lines[index + 1:end]) + "\n"))
            index = end
        index += 1
    return blocks


PYTHON_BLOCKS = _blocks("python")


def _block_id(number: int, heading: str) -> str:
    return f"{number}-" + re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


def test_the_readme_has_its_python_blocks():
    # A README whose blocks were dropped or re-fenced must not pass by running nothing.
    assert len(PYTHON_BLOCKS) >= 5, [heading for heading, _ in PYTHON_BLOCKS]


@pytest.mark.parametrize("heading, code", PYTHON_BLOCKS,
                         ids=[_block_id(i, heading) for i, (heading, _) in enumerate(PYTHON_BLOCKS)])
def test_python_block_runs(heading, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"README block under {heading!r} failed:\n{code}\n{done.stdout}\n{done.stderr[-4000:]}"
    # Every block shows what it computes.
    assert done.stdout.strip(), f"README block under {heading!r} printed nothing"


def test_the_two_commands_open_the_readme_and_ci_runs_the_test_command_verbatim():
    commands = [code.strip() for heading, code in _blocks("bash") if heading == "Two commands"]
    assert len(commands) == 2, commands
    demo, tests = commands
    assert demo.startswith("python3 -m venv .venv && ") and demo.endswith("mla-multi demo")
    assert tests.startswith("python3 -m venv .venv && ") and tests.endswith("-m pytest")
    # Only Python on a fresh machine: the CPU build of torch, and never a bare range that pulls a CUDA build.
    for command in commands:
        assert "torch==" in command, command
    ci = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    # As a line of its own, or as one in a subshell (so that `set -e` stops at a failed install inside the list).
    assert tests in ci or f"({tests})" in ci, f".ci/run does not run the README's test command verbatim: {tests!r}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_results_name_existing_sections():
    results = (REPO_ROOT / "bench" / "RESULTS.md").read_text()
    anchors = {_slug(line.lstrip("#")) for line in results.splitlines() if line.startswith("#")}
    links = re.findall(r"\(bench/RESULTS\.md#([^)]+)\)", README)
    assert links, "the README's performance figures link no bench/RESULTS.md section"
    missing = sorted(set(links) - anchors)
    assert not missing, f"README links to sections bench/RESULTS.md does not have: {missing}"


def test_local_links_resolve():
    for target in re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", README):
        assert (REPO_ROOT / target).exists(), f"README links to {target}, which does not exist"


# README platform row -> the impersonated devices it stands for
PLATFORM_ROWS = {"AMD gfx942 / gfx950": ("MI300X", "MI355X"), "other AMD": ("MI250X", "RX7900XTX"),
                 "NVIDIA sm_80+": ("A100", "H100", "B200"), "CPU": ("CPU",)}


def test_the_priority_table_is_the_registrys():
    from mla_multi import registry
    from mla_multi.platforms.specs import SPECS

    section = README.split("## Backend selection", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for prefix, specs in PLATFORM_ROWS.items():
            if len(cells) == 4 and cells[0].startswith(prefix):
                rows[prefix] = cells[1:]
    assert set(rows) == set(PLATFORM_ROWS), rows
    tables = {"prefill": registry.PREFILL_PRIORITIES, "decode": registry.DECODE_PRIORITIES,
              "sparse_decode": registry.SPARSE_DECODE_PRIORITIES, "sparse_prefill": registry.SPARSE_PREFILL_PRIORITIES}
    for prefix, (prefill, decode, sparse) in rows.items():
        for name in PLATFORM_ROWS[prefix]:
            spec = SPECS[name]
            for phase, written in (("prefill", prefill), ("decode", decode), ("sparse_decode", sparse),
                                   ("sparse_prefill", sparse)):
                table = tables[phase]
                listed = table.get((spec.vendor, spec.arch)) or table.get((spec.vendor, None))
                assert written == " > ".join(listed), f"README's {phase} list for {prefix} ({name}): {written!r}; " \
                                                      f"the registry's: {' > '.join(listed)!r}"
