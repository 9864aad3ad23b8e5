"""The backends each CI runner must select (ci/expected_backends.json).

With MLA_MULTI_CI_PLATFORM=cpu|cuda|rocm (set by ci/run-tests.sh and .ci/run)
the import-time selection must equal that runner's row; without it only the
file itself is checked, since a developer's machine may hold other libraries.
"""

import json
import os
import pathlib

import pytest

import mla_multi as mm
from mla_multi import registry

EXPECTED_PATH = pathlib.Path(__file__).resolve().parents[1] / "ci" / "expected_backends.json"


def load_expected():
    return json.loads(EXPECTED_PATH.read_text())


def test_expected_backends_file_names_registered_backends():
    expected = load_expected()
    assert set(expected) - {"_doc"} == {"cpu", "cuda", "rocm"}
    for platform_name in ("cpu", "cuda", "rocm"):
        row = expected[platform_name]
        assert set(row) == {"prefill", "decode"}
        for phase, name in row.items():
            assert name in registry.names(phase), f"{platform_name}/{phase}: {name} is not a registered {phase} backend"


@pytest.mark.skipif(not os.environ.get("MLA_MULTI_CI_PLATFORM"), reason="MLA_MULTI_CI_PLATFORM is not set (not a CI runner)")
def test_runner_selects_expected_backends():
    runner = os.environ["MLA_MULTI_CI_PLATFORM"]
    expected = load_expected()
    assert runner in expected, f"MLA_MULTI_CI_PLATFORM={runner!r}; accepted: cpu, cuda, rocm"
    assert mm.current_platform().vendor == runner, (
        f"this runner is declared {runner} but the detected platform is {mm.current_platform().vendor}"
    )
    assert mm.selected_backends() == expected[runner]
