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


def test_sm90_wide_decode_tile_spills_with_loop_invariant_code_motion():
    """The check fails a spilling sm_90 instance: the 64-row decode tile with its tile loop's
    invariants hoisted keeps stack; as configured (no hoisting) it has none."""
    import dataclasses

    from mla_multi.kernels.launch_config import tl_range_disables_licm
    from mla_multi.kernels.mla_decode import compile_specs
    from mla_multi.platforms import SPECS

    if not tl_range_disables_licm():
        pytest.skip("this Triton's tl.range has no disable_licm (3.5+)")
    spec = next(s for s in compile_specs(SPECS["H100"]) if s.name == "mla_decode_split[h64n64w8s2nolicm,kv=bf16,page=64,partial]")
    assert spec.constexprs["DISABLE_LICM"] is True
    configured = compile_check.compile_spec(spec, "sm_90")
    assert configured.passed and configured.spills == 0, configured
    hoisted = compile_check.compile_spec(
        dataclasses.replace(spec, constexprs={**spec.constexprs, "DISABLE_LICM": False}), "sm_90"
    )
    assert hoisted.ok and hoisted.spills > 0 and not hoisted.passed, hoisted
    assert hoisted.problems == [f"{hoisted.spills} spilled stack bytes"]
