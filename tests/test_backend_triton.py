"""TRITON backend declarations and selection on impersonated platforms (kernels are tested in test_kernels_*)."""

import pytest
import torch

import mla_multi as mm
from mla_multi import platforms, registry
from mla_multi.backends.triton import TritonDecodeBackend, TritonPrefillBackend

GPU_SPECS = ["MI300X", "MI325X", "MI355X", "MI250X", "RX7900XTX", "A100", "H100", "H200", "B200"]


@pytest.mark.parametrize("spec", GPU_SPECS)
def test_runs_everywhere_on_gpus(spec):
    platform = platforms.SPECS[spec]
    dims = mm.MLADims.deepseek_v3(num_heads=32)
    assert TritonPrefillBackend.validate_configuration(platform, registry.prefill_config(dims, torch.bfloat16)) == []
    for kv in ("auto", "fp8"):
        config = registry.decode_config(dims, torch.bfloat16, kv, 64, platform=platform)
        assert TritonDecodeBackend.validate_configuration(platform, config) == []


def test_rejected_on_cpu_with_reason():
    reasons = TritonDecodeBackend.validate_configuration(
        platforms.SPECS["CPU"], registry.decode_config(mm.MLADims(16), torch.bfloat16, platform=platforms.SPECS["CPU"])
    )
    assert any("supported vendors: cuda, rocm" in reason for reason in reasons)


def test_rejected_before_sm80():
    old = platforms.Platform("V100", "cuda", "sm_70", 80, 32, None, 96 * 1024, (7, 0))
    reasons = TritonPrefillBackend.validate_configuration(old, registry.prefill_config(mm.MLADims(16), torch.float16))
    assert reasons == ["NVIDIA sm_70 is older than sm_80; the kernels use bf16 MMA of sm_80+"]


@pytest.mark.parametrize(
    "dims, block_size, max_query_len, fragment",
    [
        (mm.MLADims(129), 64, 1, "num_heads 129 is over the maximum of 128"),
        (mm.MLADims(16, kv_lora_rank=256), 64, 1, "kv_lora_rank 256 / qk_rope_head_dim 64; supported: 512 / 64"),
        (mm.MLADims(16), 48, 1, "block_size 48 is not supported"),
        (mm.MLADims(16), 64, 9, "max_query_len 9"),
    ],
)
def test_decode_limits_are_reasons(dims, block_size, max_query_len, fragment):
    h100 = platforms.SPECS["H100"]
    config = registry.decode_config(dims, torch.bfloat16, "auto", block_size, max_query_len, platform=h100)
    reasons = TritonDecodeBackend.validate_configuration(h100, config)
    assert any(fragment in reason for reason in reasons), reasons


@pytest.mark.parametrize("spec, expected", [("MI250X", "TRITON"), ("RX7900XTX", "TRITON"), ("A100", "TRITON"), ("H100", "TRITON")])
def test_selected_first_where_listed_first(spec, expected):
    with platforms.override(spec):
        assert mm.select_decode_backend(mm.MLADims(8), torch.bfloat16).name == expected
        assert mm.select_prefill_backend(mm.MLADims(8), torch.bfloat16).name == expected


def test_float32_falls_back_to_reference_on_gpus_with_reasons():
    with platforms.override("H100"):
        backend = mm.select_prefill_backend(mm.MLADims(8), torch.float32)
        assert backend.name == "REFERENCE"
        rows = registry.default_registry.explain("prefill", registry.prefill_config(mm.MLADims(8), torch.float32))
        triton_row = next(row for row in rows if row["name"] == "TRITON")
        assert any("dtype float32 is not supported" in reason for reason in triton_row["reasons"])
