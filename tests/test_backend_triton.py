"""TRITON backend declarations and selection on impersonated platforms (kernels are tested in test_kernels_*),
and the backend on the CPU under Triton's interpreter through the public API (a child process)."""

import sys

import pytest
import torch
from interpreter import print_results, run_interpreter_script

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


# --------------------------------------------------------------------------- Triton's interpreter (TRITON_INTERPRET=1)


@pytest.fixture
def interpreter_on(monkeypatch):
    import mla_multi.backends.triton as triton_backend

    monkeypatch.setattr(triton_backend, "interpreter_active", lambda: True)


@pytest.mark.parametrize(
    "phase, dtype, fragment",
    [
        ("prefill", torch.float16, None),
        ("prefill", torch.float32, None),
        ("prefill", torch.bfloat16, "which computes bfloat16 tl.dot wrongly; supported there: float16, float32"),
        ("decode", torch.float16, None),
        ("decode", torch.float32, "dtype float32 is not supported under the Triton interpreter"),
        ("decode", torch.bfloat16, "which computes bfloat16 tl.dot wrongly; supported there: float16"),
    ],
)
def test_interpreter_runs_on_the_cpu_in_its_dtypes(interpreter_on, phase, dtype, fragment):
    cpu = platforms.SPECS["CPU"]
    dims = mm.MLADims.deepseek_v3(num_heads=8)
    if phase == "prefill":
        reasons = TritonPrefillBackend.validate_configuration(cpu, registry.prefill_config(dims, dtype))
    else:
        reasons = TritonDecodeBackend.validate_configuration(cpu, registry.decode_config(dims, dtype, platform=cpu))
    if fragment is None:
        assert reasons == []
    else:
        assert any(fragment in reason for reason in reasons), reasons
    assert "Triton interpreter" in TritonDecodeBackend.info()["implementation"]


def test_interpreter_changes_nothing_on_gpus(interpreter_on):
    h100 = platforms.SPECS["H100"]
    config = registry.decode_config(mm.MLADims(16), torch.bfloat16, platform=h100)
    assert TritonDecodeBackend.validate_configuration(h100, config) == []


def _interpreter_main() -> None:
    """Under TRITON_INTERPRET=1: the TRITON backend through the public API on the CPU."""
    from mla_multi.backends.reference import mla_decode_reference, varlen_attention_reference
    from mla_multi.cli import collect_info
    from mla_multi.testing import PagedScenario, relative_error

    results = {}
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(8, 16, 576, generator=generator).half()
    block_table = torch.randperm(8, generator=generator)[:6].reshape(3, 2).int()
    seq_lens = torch.tensor([20, 0, 31], dtype=torch.int32)
    q_nope = torch.randn(3, 4, 512, generator=generator).half()
    q_pe = torch.randn(3, 4, 64, generator=generator).half()
    out, lse = mm.ops.mla_decode(q_nope, q_pe, cache, block_table, seq_lens, 0.05, backend="TRITON", return_lse=True)
    ref_out, ref_lse = mla_decode_reference(q_nope.double(), q_pe.double(), cache, block_table, seq_lens, 0.05)
    results["decode_err"] = relative_error(out, ref_out)
    results["decode_lse_err"] = float((lse[[0, 2]].double() - ref_lse[[0, 2]]).abs().max())
    results["decode_empty"] = bool((out[1] == 0).all() and (lse[1] == float("-inf")).all())
    try:
        mm.ops.mla_decode(q_nope.bfloat16(), q_pe.bfloat16(), cache, block_table, seq_lens, 0.05, backend="TRITON")
        results["bf16"] = "no error"
    except mm.NoBackendError as error:
        results["bf16"] = str(error)
    block_table[2, 1] = 99
    try:
        mm.ops.mla_decode(q_nope, q_pe, cache, block_table, seq_lens, 0.05, backend="TRITON")
        results["bad_block"] = "no error"
    except ValueError as error:  # CPU tensors: the data checks always run
        results["bad_block"] = str(error)

    lens_q, lens_k = [5, 0, 17], [9, 3, 17]
    cu_q = torch.tensor([0, 5, 5, 22], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 12, 29], dtype=torch.int32)
    q = torch.randn(22, 2, 192, generator=generator)
    k = torch.randn(29, 2, 192, generator=generator)
    v = torch.randn(29, 2, 128, generator=generator)
    out, lse = mm.ops.mla_prefill(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), 0.07, return_lse=True, backend="TRITON")
    ref_out, ref_lse = varlen_attention_reference(q.double(), k.double(), v.double(), cu_q, cu_k, 0.07, True)
    results["prefill_err"] = relative_error(out, ref_out)
    results["prefill_lse_err"] = float((lse.double() - ref_lse).abs().max())

    dims = mm.MLADims.deepseek_v3(num_heads=2)
    weight = (torch.randn(2 * 256, 512, generator=generator) / 512**0.5).half()
    scale = dims.qk_head_dim**-0.5
    layer = mm.MLAAttention(dims, scale, weight, block_size=16, max_model_len=256, max_num_seqs=4, workspace_tokens=32,
                            prefill_backend="TRITON", decode_backend="TRITON")
    scenario = PagedScenario(dims, 16, 32, torch.device("cpu"), torch.float16, seed=0)
    kv_cache = torch.full((32, 16, 576), float("nan"), dtype=torch.float16)
    worst = 0.0
    for requests in ([(0, 20), (1, 9)], [(0, 1), (1, 1), (2, 40)]):  # prefills, then decodes and a chunked prefill
        metadata, q, kv_c, k_pe = scenario.step(requests)
        out = layer.forward(q, kv_c, k_pe, kv_cache, metadata)
        worst = max(worst, relative_error(out, scenario.reference(requests, q, scale, weight)))
    results["layer"] = {"backends": layer.backends(), "err": worst}
    results["info"] = collect_info()["triton_interpreter"]
    print_results(results)


@pytest.fixture(scope="module")
def interpreter_api_results():
    return run_interpreter_script(__file__, "--interpreter")


@pytest.mark.interpreter
def test_public_api_runs_triton_under_the_interpreter(interpreter_api_results):
    result = interpreter_api_results
    assert result["decode_err"] <= 3e-3 and result["decode_lse_err"] <= 2e-3 and result["decode_empty"], result
    assert result["prefill_err"] <= 1e-5 and result["prefill_lse_err"] <= 1e-5, result
    assert result["layer"]["backends"] == {"prefill": "TRITON", "decode": "TRITON"}, result
    assert result["layer"]["err"] <= 3e-3, result


@pytest.mark.interpreter
def test_interpreter_bad_data_and_bfloat16_are_value_errors_with_reasons(interpreter_api_results):
    result = interpreter_api_results
    assert result["bad_block"].startswith("block_table[2] uses blocks") and "accepted" in result["bad_block"]
    assert "which computes bfloat16 tl.dot wrongly" in result["bf16"], result["bf16"]
    assert "the interpreter is what makes TRITON run on the CPU" in result["info"]


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _interpreter_main()
