"""The ahead-of-time compile check on the CPU: one small kernel, gfx942 and sm_90."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from mla_multi import compile_check  # noqa: E402


def test_reduce_kernel_compiles_for_gfx942_and_sm90(tmp_path):
    report = tmp_path / "report.json"
    code = compile_check.main(
        ["--targets", "gfx942,sm_90", "--kernels", "mla_decode_reduce[dv64s64w4]", "--jobs", "1", "--json", str(report)]
    )
    results = json.loads(report.read_text())
    assert code == 0, results
    assert {r["target"] for r in results} == {"gfx942", "sm_90"}
    for result in results:
        assert result["ok"] and not result["problems"], result
        assert result["kernel"].startswith("mla_decode_reduce")
        assert result["registers"] > 0
        assert result["spills"] == 0
        assert result["shared_bytes"] <= result["shared_limit"]
    amd = next(r for r in results if r["target"] == "gfx942")
    assert amd["sgprs"] > 0 and amd["spill_unit"] == "registers"
    nvidia = next(r for r in results if r["target"] == "sm_90")
    assert nvidia["spill_unit"] == "stack bytes"


def test_every_module_lists_its_specs():
    from mla_multi.platforms import SPECS

    for module_name in compile_check.KERNEL_MODULES:
        module = __import__(module_name, fromlist=["compile_specs"])
        for target in compile_check.TARGETS.values():
            specs = module.compile_specs(SPECS[target.platform_name])
            assert specs, (module_name, target.name)
            names = [spec.name for spec in specs]
            assert len(names) == len(set(names)), names


def test_unknown_target_is_an_error(capsys):
    assert compile_check.main(["--targets", "gfx000"]) == 2
    assert "gfx000" in capsys.readouterr().err


def test_no_match_fails():
    assert compile_check.main(["--targets", "sm_90", "--kernels", "no-such-kernel"]) == 1
