"""The ahead-of-time compile check on the CPU: one small kernel, gfx942 and sm_90."""

from __future__ import annotations

import json

import pytest

triton = pytest.importorskip("triton")

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
    if hoisted.ok and hoisted.spills == 0:  # Triton 3.8's register allocation keeps the hoisted tile (3.9's does not)
        pytest.skip(f"triton {triton.__version__} does not spill this tile with its invariants hoisted")
    assert hoisted.ok and hoisted.spills > 0 and not hoisted.passed, hoisted
    assert hoisted.problems == [f"{hoisted.spills} spilled stack bytes"]


try:  # Gluon with Hopper's warpgroup MMA (Triton >= 3.6)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
except Exception:  # pragma: no cover - depends on the installed Triton
    gluon = None

if gluon is not None:

    @gluon.jit
    def _rescaled_products(Out, n, IN_FLIGHT: gl.constexpr):
        """acc = (acc / 2) + A B, n times: waited for in each iteration, or (IN_FLIGHT) left running across
        the loop's back edge while the next iteration reads the accumulator."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        shared: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        a = gl.allocate_shared_memory(gl.bfloat16, [64, 64], shared)
        b = gl.allocate_shared_memory(gl.bfloat16, [64, 64], shared)
        acc = gl.zeros([64, 64], gl.float32, layout)
        if IN_FLIGHT:
            acc = warpgroup_mma_init(acc)
        for _ in range(n):
            if IN_FLIGHT:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                acc = warpgroup_mma(a, b, acc * 0.5, is_async=True)
            else:
                acc = warpgroup_mma(a, b, acc * 0.5, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if IN_FLIGHT:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        gl.store(Out + rows[:, None] * 64 + cols[None, :], acc)


def test_wgmma_serialization_reads_the_ptxas_note():
    note = (
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline "
        "stage in the function '_kernel' in line 0\nptxas info    : Used 168 registers"
    )
    assert compile_check.wgmma_serialization(note) == (
        "non wgmma instructions reading accumulator registers of a wgmma between start and end of the pipeline stage"
    )
    assert compile_check.wgmma_serialization("ptxas info    : Used 168 registers, used 4 barriers") == ""


@pytest.mark.skipif(gluon is None, reason="this Triton has no Gluon with Hopper warpgroup MMA")
def test_sm90_check_fails_a_kernel_whose_wgmma_ptxas_serialises():
    """An accumulator kept in flight across the loop's back edge and read there makes ptxas serialise
    every wgmma of the kernel; the check reports it and fails the instance.  Waited for in each
    iteration, the same products pass."""
    from mla_multi.kernels.launch_config import CompileSpec

    def spec(in_flight):
        return CompileSpec(
            name=f"rescaled_products[in_flight={in_flight}]", fn=_rescaled_products,
            signature={"Out": "*fp32", "n": "i32", "IN_FLIGHT": "constexpr"}, constexprs={"IN_FLIGHT": in_flight},
            options={"num_warps": 4},
        )

    waited = compile_check.compile_spec(spec(False), "sm_90")
    assert waited.passed and waited.wgmma_serialized == "", waited
    in_flight = compile_check.compile_spec(spec(True), "sm_90")
    assert in_flight.ok and not in_flight.passed, in_flight
    assert "non wgmma instructions reading accumulator registers" in in_flight.wgmma_serialized, in_flight
    assert in_flight.problems == [f"ptxas serialises its wgmma instructions ({in_flight.wgmma_serialized})"]


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


def test_a_launch_over_the_sm_register_file_is_a_problem():
    """The sm_90 prefill kernel's loader warp is launched as a warpgroup: 12 warps. At 168 registers they fit
    the SM's 64K; at 224 (what 9 warps would allow) the launch fails on the GPU, and the check says so."""
    import dataclasses

    from mla_multi.kernels import prefill_wgmma
    from mla_multi.platforms import SPECS

    if prefill_wgmma.wgmma_prefill_reason(SPECS["H100"], prefill_wgmma.torch.bfloat16, 192, 128):
        pytest.skip("this Triton has no Gluon for sm_90")
    spec = prefill_wgmma.compile_specs(SPECS["H100"])[0]
    fits = compile_check.compile_spec(spec, "sm_90")
    assert fits.passed and fits.launch_threads == 384 and fits.launch_threads * fits.registers <= 65536, fits
    over = compile_check.compile_spec(dataclasses.replace(spec, options={**spec.options, "maxnreg": 224}), "sm_90")
    assert over.ok and not over.passed, over
    assert any("exceed the SM's 65536" in problem for problem in over.problems), over.problems


def test_divisibility_is_keyed_by_the_kernels_parameter_order():
    """A spec's 16-byte-aligned arguments reach the compiler at their place among the kernel's parameters
    (Triton's attributes), whatever the order of the spec's signature: the V4 split kernel's second cache
    among them."""
    from mla_multi.kernels.mla_decode import compile_specs
    from mla_multi.platforms import SPECS

    spec = next(s for s in compile_specs(SPECS["H200"]) if "fp8_ds_mla_v4" in s.name)
    names = spec.fn.arg_names
    assert list(spec.signature) != [n for n in names if n in spec.signature]  # the orders differ
    attrs = compile_check._attrs(spec)
    assert {names[key[0]] for key in attrs} == set(spec.divisible_by_16)
    assert "Extra_cache" in spec.divisible_by_16


@pytest.mark.parametrize("config", ["h16n64w4s2ws", "h64n64w4s2rm"])
def test_v4_wide_loader_loads_sixteen_bytes_a_thread(config):
    """The DeepSeek-V4 loader's wide pieces (`V4_WIDE`) compiled for sm_90: each of a tile's four quarters
    loads its three latent group pairs and its rotary part 16 bytes a thread (`ld.global.v4`), in the
    prologue and in the loop: 32 loads of 16 bytes more than the narrow pieces', whose rows are the same
    (so a compiler that stops seeing the rows' alignment fails this, as Triton 3.9 did for a selected
    pointer)."""
    from mla_multi.kernels.mla_decode import compile_specs
    from mla_multi.platforms import SPECS

    specs = {s.name: s for s in compile_specs(SPECS["H200"])}
    stem = f"mla_decode_split[{config},kv=fp8_ds_mla_v4,page=64,partial,pdl"
    counts = {}
    for wide in (False, True):
        ptx = compile_check.compile_kernel(specs[stem + (",wide]" if wide else "]")], "sm_90").asm["ptx"]
        counts[wide] = ptx.count("ld.global.v4.")
    assert counts[True] - counts[False] == 32, counts
