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


def test_mma_repeat_reads_the_dot_layouts():
    """Warps on an M x N product beyond its instruction tiles repeat it: read from the TTGIR."""
    mfma = (
        "#mma = #ttg.amd_mfma<{version = 3, warpsPerCTA = [4, 1], instrShape = [16, 16, 16], isTransposed = true}>\n"
        "#mma1 = #ttg.amd_mfma<{version = 3, warpsPerCTA = [1, 4], instrShape = [16, 16, 16], isTransposed = true}>\n"
    )
    qk_rows_as_m = "%1 = tt.dot %a, %b, %c : tensor<16x64xbf16> * tensor<64x16xbf16> -> tensor<16x16xf32, #mma>\n"
    pv = "%2 = tt.dot %p, %v, %acc : tensor<16x16xbf16> * tensor<16x256xbf16> -> tensor<16x256xf32, #mma1>\n"
    qk_tokens_as_m = "%3 = tt.dot %k, %q, %c : tensor<64x64xbf16> * tensor<64x16xbf16> -> tensor<64x16xf32, #mma>\n"
    assert compile_check.mma_repeat(mfma + qk_rows_as_m + pv) == 4
    assert compile_check.mma_repeat(mfma + qk_tokens_as_m + pv) == 1
    assert compile_check.mma_repeat(mfma) is None
    nvidia = (
        "#mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 8], CTAsPerCGA = [1, 1], "
        "CTASplitNum = [1, 1], CTAOrder = [1, 0], instrShape = [16, 8]}>\n"
        "#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], CTAsPerCGA = [1, 1], "
        "CTASplitNum = [1, 1], CTAOrder = [1, 0], instrShape = [16, 64, 16]}>\n"
    )
    # 8 warps on 32 columns of 8: 4 distinct; a 64-row wgmma tile on two warpgroups: 4 distinct
    assert compile_check.mma_repeat(nvidia + "%1 = tt.dot %a, %b, %c -> tensor<32x32xf32, #mma>\n") == 2
    assert compile_check.mma_repeat(nvidia + "%1 = tt.dot %a, %b, %c -> tensor<32x64xf32, #mma>\n") == 1
    assert compile_check.mma_repeat(nvidia + "%1 = ttng.warp_group_dot %a, %b, %c -> tensor<64x64xf32, #mma1>\n") == 2


@pytest.mark.parametrize("target", ["gfx942", "gfx950"])
def test_amd_decode_tables_compute_qk_once_from_17_rows(target):
    """From 17 rows the AMD tables take the tokens as M (gfx950 FP8: up to 32 rows): every warp
    computes its own part of QK, without spills; the same tile with the rows as M computes each QK
    element in several warps."""
    import dataclasses

    from mla_multi.kernels.launch_config import _decode_table
    from mla_multi.kernels.mla_decode import compile_specs
    from mla_multi.platforms import SPECS

    platform = SPECS[compile_check.TARGETS[target].platform_name]
    tables = [_decode_table(platform, fp8=fp8) for fp8 in (False, True)]
    assert all(table["32"].tokens_as_m for table in tables)
    wide = {config.name for table in tables for key in ("32", "64") if (config := table[key]).tokens_as_m}
    specs = [s for s in compile_specs(platform) if "page=64" in s.name and any(f"[{name}," in s.name for name in wide)]
    assert len(specs) == 2, [s.name for s in specs]
    for spec in specs:
        assert spec.constexprs["TOKENS_AS_M"] is True
        result = compile_check.compile_spec(spec, target)
        assert result.passed and result.spills == 0 and result.mma_repeat == 1, result
        rows_as_m = compile_check.compile_spec(
            dataclasses.replace(spec, constexprs={**spec.constexprs, "TOKENS_AS_M": False}), target
        )
        assert rows_as_m.ok and rows_as_m.mma_repeat > 1, rows_as_m
