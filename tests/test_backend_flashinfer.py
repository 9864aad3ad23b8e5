"""The FLASHINFER backend: reasons and selection everywhere, FlashInfer's published API, numerics on the GPU.

* CPU: the reasons of both phases on impersonated A100 / H100 / H200 / B200 and
  MI300X with a fake probe (installed, old, missing, no way to get kernels);
  the selection rules.
* Contract: every call into FlashInfer (`FLASHINFER_CALLS`) against the
  published flashinfer-python 0.7.2.post1 source, read with `ast` and never
  imported (`MLA_MULTI_FLASHINFER_WHEEL` points at a local wheel for offline runs).
* GPU (marked ``gpu``, needs flashinfer importable): decode and prefill against
  float64 references, FP8, heads 16/32/64/128, block sizes 1/16/64, empty and
  mixed lengths, LSE, `MLAAttention` with FLASHINFER forced for both phases
  over chunked context, and CUDA-graph replay after re-planning.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import zipfile

import pytest
import torch

import mla_multi as mm
from mla_multi import platforms, registry
from mla_multi.backends import flashinfer as fi
from mla_multi.backends.base import DecodeSelectorConfig, PrefillSelectorConfig
from mla_multi.platforms import override
from mla_multi.platforms.specs import SPECS
from published import published_distribution, published_parameters

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
requires_flashinfer = pytest.mark.skipif(
    not (HAS_FLASHINFER and torch.cuda.is_available()), reason="needs flashinfer and a CUDA device"
)


def _fake_flashinfer(monkeypatch, prefill_wrapper, mla_wrapper):
    """A fake flashinfer package whose ragged-prefill and MLA wrapper classes are the ones given; returns its
    `flashinfer.mla` module."""
    import sys
    import types

    package = types.ModuleType("flashinfer")
    package.BatchPrefillWithRaggedKVCacheWrapper = prefill_wrapper
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = mla_wrapper
    package.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    return mla


@pytest.fixture
def installed(monkeypatch):
    """Pretend FlashInfer 0.7.2.post1 is installed with nvcc (the reasons then come from the configuration)."""
    probe = fi.FlashInferProbe("0.7.2.post1", None, "nvcc at /usr/local/cuda/bin/nvcc (built at first use)")
    monkeypatch.setattr(fi, "probe_flashinfer", lambda: probe)
    registry.default_registry.clear_cache()
    yield probe
    registry.default_registry.clear_cache()


def dconfig(num_heads=128, dtype=BF16, kv=None, block_size=64, max_query_len=1, lora=512, rope=64):
    dims = mm.MLADims(num_heads, kv_lora_rank=lora, qk_rope_head_dim=rope)
    return DecodeSelectorConfig(dims, dtype, kv or dtype, block_size, max_query_len)


# --------------------------------------------------------------------------- reasons


@pytest.mark.parametrize("spec", ["A100", "H100", "H200", "B200"])
def test_decode_and_prefill_run_on_nvidia_sm80_plus(installed, spec):
    assert fi.FlashInferDecodeBackend.validate_configuration(SPECS[spec], dconfig()) == []
    config = PrefillSelectorConfig(mm.MLADims.deepseek_v3(), BF16)
    assert fi.FlashInferPrefillBackend.validate_configuration(SPECS[spec], config) == []


@pytest.mark.parametrize("spec, fragment", [("MI300X", "supported vendors: cuda"), ("CPU", "supported vendors: cuda")])
def test_not_on_amd_or_cpu(installed, spec, fragment):
    reasons = fi.FlashInferDecodeBackend.validate_configuration(SPECS[spec], dconfig())
    assert any(fragment in r for r in reasons), reasons


@pytest.mark.parametrize(
    "spec, config, fragment",
    [
        ("H200", dconfig(kv=FP8), None),
        ("A100", dconfig(kv=FP8), "an FP8 cache needs FlashInfer's sm_90 MLA kernel"),
        ("B200", dconfig(kv=FP8), "an FP8 cache needs FlashInfer's sm_90 MLA kernel"),
        ("H200", dconfig(dtype=FP16, kv=FP8), "an FP8 cache needs bfloat16 queries"),
        ("H200", dconfig(kv=torch.float8_e4m3fnuz), "kv_cache_dtype float8_e4m3fnuz is not supported"),
        ("H200", dconfig(dtype=BF16, kv=FP16), "differs from the query dtype"),
        ("H200", dconfig(dtype=torch.float32), "dtype float32 is not supported"),
        ("H200", dconfig(lora=384), "kv_lora_rank 384; FlashInfer's sm_90 MLA kernel takes 128, 256, 512"),
        ("A100", dconfig(lora=384), None),
        ("H200", dconfig(rope=32), "multiples of 128 / 64"),
        ("H200", dconfig(max_query_len=4), None),
        ("H200", dconfig(num_heads=48, max_query_len=2), "dividing 128"),
        ("H200", dconfig(num_heads=48), None),
        ("H200", dconfig(max_query_len=9), "max_query_len 9"),
        ("H200", dconfig(block_size=1), None),
        ("H200", dconfig(block_size=16), None),
    ],
)
def test_decode_limits_are_reasons(installed, spec, config, fragment):
    reasons = fi.FlashInferDecodeBackend.validate_configuration(SPECS[spec], config)
    if fragment is None:
        assert reasons == []
    else:
        assert any(fragment in r for r in reasons), reasons


@pytest.mark.parametrize(
    "probe, fragment",
    [
        (fi.FlashInferProbe(None, "flashinfer is not installed (pip install 'mla-multi[flashinfer]')", None), "not installed"),
        (fi.FlashInferProbe("0.6.1", "flashinfer 0.6.1 is older than 0.7.2, the oldest release with this MLA API", None),
         "older than 0.7.2"),
    ],
)
def test_library_reasons_reach_selection(monkeypatch, probe, fragment):
    monkeypatch.setattr(fi, "probe_flashinfer", lambda: probe)
    registry.default_registry.clear_cache()
    try:
        with pytest.raises(mm.NoBackendError) as error:
            registry.select_decode_backend(mm.MLADims.deepseek_v3(), BF16, backend="FLASHINFER", platform=SPECS["H200"])
        assert fragment in str(error.value)
    finally:
        registry.default_registry.clear_cache()


def test_probe_of_this_machine_never_raises():
    fi.clear_probe_cache()
    probe = fi.probe_flashinfer()
    assert (probe.error is None) == HAS_FLASHINFER or probe.error


def test_no_compiler_and_no_prebuilt_kernels_is_a_reason(monkeypatch):
    """The probe's kernel check, on a fake flashinfer module tree without nvcc or flashinfer-jit-cache."""
    _fake_flashinfer(monkeypatch, object, object).MLAPlanMetadata = object
    monkeypatch.setattr(fi.importlib.metadata, "version", lambda name: "0.7.2.post1")
    real_find_spec = fi.importlib.util.find_spec
    monkeypatch.setattr(fi.importlib.util, "find_spec", lambda name: None if name == "flashinfer_jit_cache" else real_find_spec(name))
    monkeypatch.setattr(fi, "_nvcc_path", lambda: None)
    fi.clear_probe_cache()
    try:
        probe = fi.probe_flashinfer()
        assert probe.error and "neither nvcc" in probe.error and "flashinfer-jit-cache" in probe.error
        monkeypatch.setattr(fi, "_nvcc_path", lambda: "/opt/cuda/bin/nvcc")
        fi.clear_probe_cache()
        probe = fi.probe_flashinfer()
        assert probe.error is None and "/opt/cuda/bin/nvcc" in probe.kernels
        monkeypatch.setattr(fi.importlib.metadata, "version", lambda name: "0.6.0")
        fi.clear_probe_cache()
        assert "older than 0.7.2" in fi.probe_flashinfer().error
    finally:
        fi.clear_probe_cache()


# --------------------------------------------------------------------------- selection


def _sm90_warpgroup_kernels() -> bool:
    from mla_multi.kernels.mla_decode_wgmma import gluon_available

    return gluon_available()[0]


# where the installed Triton builds the sm_90 warpgroup decode kernels, TRITON
# is chosen on sm_90 for every head count (measured); elsewhere the
# FlashInfer-first rules stand
_WG = "TRITON" if _sm90_warpgroup_kernels() else "FLASHINFER"


@pytest.mark.parametrize(
    "spec, config, expected",
    [
        ("H200", dconfig(num_heads=128), _WG),
        ("H100", dconfig(num_heads=64), _WG),
        ("H100", dconfig(num_heads=65), _WG),
        ("H200", dconfig(num_heads=128, max_query_len=4), _WG),
        ("H200", dconfig(num_heads=16), "TRITON"),
        ("H200", dconfig(num_heads=32), _WG),
        ("H200", dconfig(num_heads=128, kv=FP8), _WG),
        ("H200", dconfig(num_heads=32, kv=FP8), "TRITON"),
        ("H200", dconfig(num_heads=64, kv=FP8), _WG),
        ("H200", dconfig(num_heads=16, kv=FP8), "TRITON"),
        ("A100", dconfig(num_heads=128), "FLASHINFER"),
        ("B200", dconfig(num_heads=32), "FLASHINFER"),
        ("H200", dconfig(num_heads=48, max_query_len=2), "TRITON"),
        ("MI300X", dconfig(num_heads=128), "TRITON"),
    ],
)
def test_decode_selection_follows_the_rules(installed, monkeypatch, spec, config, expected):
    from mla_multi.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "_triton_import_error", lambda: None)
    platform = SPECS[spec]
    rule = registry.default_registry.rule_for("decode", platform, config)
    order = registry.default_registry.priority("decode", platform, config)
    chosen = registry.default_registry.select("decode", config, platform).name
    assert chosen == expected, (order, rule)
    if rule is not None:
        assert rule.measured.startswith("bench/RESULTS.md")


def test_prefill_prefers_flashinfer_on_nvidia(installed, monkeypatch):
    from mla_multi.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "_triton_import_error", lambda: None)
    config = PrefillSelectorConfig(mm.MLADims.deepseek_v3(), BF16)
    assert registry.default_registry.select("prefill", config, SPECS["H200"]).name == "FLASHINFER"


def test_forced_flashinfer_raises_with_reasons_never_falls_back(installed):
    with pytest.raises(mm.NoBackendError) as error:
        registry.select_decode_backend(mm.MLADims.deepseek_v3(), BF16, "fp8", backend="FLASHINFER", platform=SPECS["A100"])
    message = str(error.value)
    assert "The forced decode backend FLASHINFER" in message and "sm_90" in message


def test_info_names_the_rule(installed, monkeypatch):
    from mla_multi import cli

    monkeypatch.setattr(platforms, "current_platform", platforms.current_platform)
    info = cli.collect_info("H200")
    assert "rule" in info["phases"]["decode"]
    rows = {r["name"]: r for r in info["phases"]["decode"]["backends"]}
    assert "FLASHINFER" in rows


# --------------------------------------------------------------------------- contract with the published source

FLASHINFER_REQUIREMENT = "flashinfer-python==0.7.2.post1"


@pytest.fixture(scope="module")
def flashinfer_wheel(pytestconfig) -> pathlib.Path:
    return published_distribution(
        pytestconfig, FLASHINFER_REQUIREMENT, "flashinfer_python", ".whl", "MLA_MULTI_FLASHINFER_WHEEL",
        ("--only-binary=:all:",),
    )


def _published_function(wheel: pathlib.Path, source: str, qualname: str) -> ast.FunctionDef:
    with zipfile.ZipFile(wheel) as archive:
        tree = ast.parse(archive.read(source).decode())
    class_name, _, method = qualname.rpartition(".")
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name]
    assert classes, f"{source} defines no class {class_name}"
    # Overloads come first; the implementation is the last definition of the name.
    found = [n for n in classes[0].body if isinstance(n, ast.FunctionDef) and n.name == method]
    assert found, f"{class_name} has no {method}"
    return found[-1]


@pytest.mark.parametrize("call", fi.FLASHINFER_CALLS, ids=[c.qualname for c in fi.FLASHINFER_CALLS])
def test_every_call_matches_the_published_signature(flashinfer_wheel, call):
    names, required = published_parameters(_published_function(flashinfer_wheel, call.source, call.qualname))
    names = [n for n in names if n not in ("self", "cls")]
    missing = [k for k in call.keywords if k not in names]
    assert not missing, f"{call.qualname} has no parameters {missing}; published: {names}"
    unpassed = sorted(r for r in required if r not in ("self", "cls") and r not in call.keywords)
    assert not unpassed, f"{call.qualname} requires {unpassed}, which the backend does not pass"


def test_adapter_passes_exactly_the_recorded_keywords():
    """The backend's source passes each FlashInfer call the keywords `FLASHINFER_CALLS` records."""
    source = pathlib.Path(fi.__file__).read_text()
    tree = ast.parse(source)
    passed: dict[str, set[str]] = {}
    attribute_of = {"BatchMLAPagedAttentionWrapper": "BatchMLAPagedAttentionWrapper.__init__",
                    "BatchPrefillWithRaggedKVCacheWrapper": "BatchPrefillWithRaggedKVCacheWrapper.__init__",
                    "csr": "MLAPlanMetadata.csr"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        keywords = {k.arg for k in node.keywords if k.arg is not None}
        if name in attribute_of:
            passed.setdefault(attribute_of[name], set()).update(keywords)
        elif name == "_timed_first_use":  # wrapper.plan(...) goes through the first-use timer
            target = ast.unparse(node.args[2])
            qualname = "BatchMLAPagedAttentionWrapper.plan" if "metadata" in keywords else "BatchPrefillWithRaggedKVCacheWrapper.plan"
            assert target == "wrapper.plan", target
            passed.setdefault(qualname, set()).update(keywords)
        elif name == "run" and "query" in keywords:
            passed.setdefault("BatchMLAPagedAttentionWrapper.run", set()).update(keywords)
        elif name == "run" and "lse_base" in keywords:
            passed.setdefault("BatchPrefillWithRaggedKVCacheWrapper.run", set()).update(keywords)
    for call in fi.FLASHINFER_CALLS:
        # FP8 scales go through **scales; the published check covers them by name.
        recorded = set(call.keywords) - {"ckv_scale", "kpe_scale"}
        assert passed.get(call.qualname, set()) - {"ckv_scale", "kpe_scale"} == recorded, call.qualname


# --------------------------------------------------------------------------- GPU


def _decode_case(batch, heads, block_size, seq_lens, cache_dtype, seed, q_len=1):
    from test_kernels_decode import _make_case

    return _make_case(batch, heads, q_len, 512, 64, block_size, seq_lens, cache_dtype, BF16, "cuda", seed)


def _decode_errors(tensors, out, lse, scale):
    from test_kernels_decode import _reference

    ref_out, ref_lse = _reference(
        tensors["q_nope"], tensors["q_pe"], tensors["kv_cache"], tensors["block_table"], tensors["seq_lens"], scale,
        tensors.get("k_scale"),
    )
    finite = torch.isfinite(ref_lse)
    rel = ((out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    return {
        "rel_err": rel,
        "lse_err": lse_err,
        "nan": bool(torch.isnan(out).any() or torch.isnan(lse).any()),
        "empty_ok": bool((lse[~finite] == float("-inf")).all() and not out[~finite].any()),
    }


@pytest.mark.gpu
@requires_flashinfer
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_gpu_bf16(heads, block_size):
    seq_lens = [0, 1, 17, 300, 2048 if block_size > 1 else 700]
    tensors = _decode_case(len(seq_lens), heads, block_size, seq_lens, BF16, seed=heads + block_size)
    scale = 192**-0.5
    out, lse = mm.ops.mla_decode(
        tensors["q_nope"], tensors["q_pe"], tensors["kv_cache"], tensors["block_table"], tensors["seq_lens"], scale,
        backend="FLASHINFER", return_lse=True,
    )
    result = _decode_errors(tensors, out, lse, scale)
    assert not result["nan"] and result["empty_ok"], result
    assert result["rel_err"] <= 1e-2 and result["lse_err"] <= 2e-2, result


@pytest.mark.gpu
@requires_flashinfer
def test_decode_op_keeps_its_plan_while_the_lengths_are_unchanged(monkeypatch):
    """`mm.ops.mla_decode(backend="FLASHINFER")` plans FlashInfer (reading the lengths on the host) on its
    first call, reuses the plan while the same seq_lens / block_table tensors come back unmodified, and plans
    again after an in-place update or for a new tensor; every result matches float64."""
    from mla_multi.backends.flashinfer import FlashInferDecodeImpl

    seq_lens = [5, 300, 2048, 17]
    tensors = _decode_case(len(seq_lens), 16, 64, seq_lens, BF16, seed=3)
    plans = []
    real = FlashInferDecodeImpl.plan

    def counting(self, *args, **kwargs):
        plans.append(args[0].tolist())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FlashInferDecodeImpl, "plan", counting)
    scale = 192**-0.5

    def call():
        out, lse = mm.ops.mla_decode(tensors["q_nope"], tensors["q_pe"], tensors["kv_cache"], tensors["block_table"],
                                     tensors["seq_lens"], scale, backend="FLASHINFER", return_lse=True)
        result = _decode_errors(tensors, out, lse, scale)
        assert not result["nan"] and result["rel_err"] <= 1e-2 and result["lse_err"] <= 2e-2, result

    call()
    call()
    assert len(plans) == 1
    tensors["seq_lens"][1] = 40  # in place: a new version
    call()
    assert plans[-1] == [5, 40, 2048, 17]
    tensors["seq_lens"] = tensors["seq_lens"].clone()  # the same values in a new tensor
    call()
    call()
    assert len(plans) == 3


@pytest.mark.gpu
@requires_flashinfer
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_gpu_fp8(heads):
    seq_lens = [0, 33, 4096, 1000]
    tensors = _decode_case(len(seq_lens), heads, 64, seq_lens, FP8, seed=7)
    scale = 192**-0.5
    out, lse = mm.ops.mla_decode(
        tensors["q_nope"], tensors["q_pe"], tensors["kv_cache"], tensors["block_table"], tensors["seq_lens"], scale,
        k_scale=tensors["k_scale"], backend="FLASHINFER", return_lse=True,
    )
    result = _decode_errors(tensors, out, lse, scale)
    assert not result["nan"] and result["empty_ok"], result
    # FP8 cache dequantised exactly in the reference; bf16 query and P@V rounding remain.
    assert result["rel_err"] <= 2e-2, result


@pytest.mark.gpu
@requires_flashinfer
@pytest.mark.parametrize("q_len", [2, 4])
def test_decode_gpu_multi_token(q_len):
    seq_lens = [q_len, 100, 5000]
    tensors = _decode_case(len(seq_lens), 128, 64, seq_lens, BF16, seed=11, q_len=q_len)
    scale = 192**-0.5
    out, lse = mm.ops.mla_decode(
        tensors["q_nope"], tensors["q_pe"], tensors["kv_cache"], tensors["block_table"], tensors["seq_lens"], scale,
        backend="FLASHINFER", return_lse=True,
    )
    result = _decode_errors(tensors, out, lse, scale)
    assert not result["nan"] and result["rel_err"] <= 1e-2, result


@pytest.mark.gpu
@requires_flashinfer
def test_decode_gpu_cuda_graph_replay_after_replanning():
    heads, block_size, max_blocks, num_blocks = 128, 64, 64, 2048
    scale = 192**-0.5
    impl = fi.FlashInferDecodeImpl(heads, scale, 512, 64, BF16, block_size, torch.device("cuda"))
    impl.reserve_workspace(None, max_num_seqs=16, max_model_len=max_blocks * block_size)
    cache = torch.randn(num_blocks, block_size, 576, device="cuda").to(BF16)
    for batch in (1, 5, 16):
        q_nope = torch.randn(batch, heads, 512, device="cuda", dtype=BF16)
        q_pe = torch.randn(batch, heads, 64, device="cuda", dtype=BF16)
        block_table = torch.randint(0, num_blocks, (batch, max_blocks), device="cuda", dtype=torch.int32)
        seq_lens = torch.full((batch,), 4096, dtype=torch.int32, device="cuda")
        static = {}
        plan = impl.plan(seq_lens.cpu(), block_table, 1, cuda_graph=True)

        def step():
            static["out"], static["lse"] = impl.forward_mqa(q_nope, q_pe, cache, block_table, seq_lens, plan=plan)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for trial in range(3):
            lengths = torch.randint(1, max_blocks * block_size, (batch,), dtype=torch.int32)
            lengths[-1] = trial  # 0, 1, 2
            seq_lens.copy_(lengths)
            block_table.random_(0, num_blocks)
            q_nope.normal_()
            impl.plan(lengths, block_table, 1, cuda_graph=True)  # re-plan into the captured buffers
            static["out"].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            tensors = dict(q_nope=q_nope, q_pe=q_pe, kv_cache=cache, block_table=block_table, seq_lens=seq_lens)
            result = _decode_errors(tensors, static["out"], static["lse"], scale)
            assert not result["nan"] and result["empty_ok"], (batch, trial, result)
            assert result["rel_err"] <= 1e-2 or (batch == 1 and trial == 0), (batch, trial, result)


@pytest.mark.gpu
@requires_flashinfer
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_gpu_against_float64(causal):
    from test_ops import naive_attention

    heads = 16
    q_lens, k_lens = ([5, 130, 1], [5, 130, 1]) if causal else ([5, 130, 1], [64, 0, 300])
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), heads, 192, device="cuda", dtype=BF16)
    k = torch.randn(sum(k_lens), heads, 192, device="cuda", dtype=BF16)
    v = torch.randn(sum(k_lens), heads, 128, device="cuda", dtype=BF16)
    scale = 192**-0.5
    out, lse = mm.ops.mla_prefill(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), scale, causal=causal,
                                  return_lse=True, backend="FLASHINFER")
    for i in range(len(q_lens)):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if k_lens[i] == 0:
            assert not out[qs].any() and (lse[:, qs] == float("-inf")).all()
            continue
        mask = None
        if causal:
            mask = torch.ones(q_lens[i], k_lens[i], dtype=torch.bool, device="cuda").tril(k_lens[i] - q_lens[i])
        ref, ref_lse = naive_attention(q[qs].double(), k[ks].double(), v[ks].double(), scale, mask)
        rel = (out[qs].double() - ref).norm() / ref.norm()
        assert rel <= 1e-2, (i, rel)
        assert (lse[:, qs].double() - ref_lse).abs().max() <= 2e-2


@pytest.mark.gpu
@requires_flashinfer
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_layer_with_flashinfer_for_both_phases(kv_cache_dtype):
    """Mixed steps with chunked context through MLAAttention, FLASHINFER forced, planned once per step."""
    from mla_multi.testing import PagedScenario, relative_error

    dims = mm.MLADims.deepseek_v3(num_heads=32)
    scale = dims.qk_head_dim**-0.5
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                          generator=generator) / dims.kv_lora_rank**0.5).to(BF16).cuda()
    kwargs = dict(block_size=16, max_model_len=4096, max_num_seqs=8, workspace_tokens=128,
                  prefill_backend="FLASHINFER", decode_backend="FLASHINFER", kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype == "fp8":
        kwargs["kv_cache_scale"] = 0.05
    layers = [mm.MLAAttention(dims, scale, weight, **kwargs) for _ in range(2)]
    assert layers[0].backends() == {"prefill": "FLASHINFER", "decode": "FLASHINFER"}
    scenario = PagedScenario(dims, 16, 512, torch.device("cuda"), BF16, seed=1)
    cache = torch.full((512, 16, 576), float("nan"), device="cuda").to(layers[0].kv_cache_dtype)
    steps = [[(0, 200), (1, 7)], [(0, 1), (1, 1), (2, 300)], [(0, 1), (2, 1), (1, 50)]]
    for requests in steps:
        metadata, q, kv_c, k_pe = scenario.step(requests)
        layers[0].plan(metadata)
        planned = dict(metadata.backend_plans)
        outs = [layer.forward(q, kv_c, k_pe, cache, metadata) for layer in layers]
        assert metadata.backend_plans.keys() == planned.keys()  # the second layer planned nothing new
        ref = scenario.reference(requests, q, scale, weight)
        tolerance = 6e-2 if kv_cache_dtype == "fp8" else 2e-2
        for out in outs:
            assert relative_error(out, ref) <= tolerance, (requests, relative_error(out, ref))


def test_first_plan_of_a_configuration_is_logged_once_at_info(caplog):
    calls = []
    key = ("test-first-use", id(calls))
    with caplog.at_level("INFO", logger="mla_multi"):
        for value in (1, 2, 3):
            assert fi._timed_first_use(key, "decode test", lambda v: calls.append(v) or v, value) == value
    assert calls == [1, 2, 3]
    records = [r for r in caplog.records if "FLASHINFER decode test: first plan took" in r.getMessage()]
    assert len(records) == 1 and records[0].levelname == "INFO"
    assert "mla-multi warmup" in records[0].getMessage()


def test_functional_decode_plans_once_per_length_tensors(monkeypatch):
    """forward_mqa without a plan (the decode op) reuses its last plan while the same seq_lens / block_table /
    k_scale tensors come back unchanged (version counters), and plans again after an in-place update, for a
    new tensor with the same values, once the old tensor is freed, or for another query length (a fake
    wrapper stands in for FlashInfer's)."""
    made = []

    class Wrapper:
        def run(self, query, kv_cache, return_lse, return_lse_base_on_e):
            tokens, heads = query[0].shape[:2]
            return torch.full((tokens, heads, 512), float(len(made))), torch.zeros(tokens, heads)

    def plan(self, seq_lens_cpu, block_table, query_len=1, *, k_scale=None, cuda_graph=False):
        made.append((seq_lens_cpu.tolist(), query_len))
        return fi.FlashInferDecodePlan(Wrapper(), seq_lens_cpu.numel(), query_len, seq_lens_cpu, None, None, False)

    monkeypatch.setattr(fi.FlashInferDecodeImpl, "plan", plan)
    impl = fi.FlashInferDecodeImpl(2, 0.1, 512, 64, torch.bfloat16, 16, torch.device("cpu"))
    cache = torch.zeros(4, 16, 576, dtype=torch.bfloat16)

    def call(lens, table, q_len=1):
        shape = (2, q_len, 2) if q_len > 1 else (2, 2)
        q_nope, q_pe = torch.zeros(*shape, 512, dtype=torch.bfloat16), torch.zeros(*shape, 64, dtype=torch.bfloat16)
        return impl.forward_mqa(q_nope, q_pe, cache, table, lens)[0].flatten()[0].item()

    lens = torch.tensor([3, 9], dtype=torch.int32)
    table = torch.zeros(2, 4, dtype=torch.int32)
    assert call(lens, table) == 1 and call(lens, table) == 1 and len(made) == 1
    lens[0] = 4  # in place
    assert call(lens, table) == 2 and made[-1] == ([4, 9], 1)
    assert call(lens.clone(), table) == 3  # the same values, another tensor
    table.add_(0)  # the block table changed in place
    assert call(lens, table) == 4
    assert call(lens, table, q_len=2) == 5 and made[-1] == ([4, 9], 2)
    del lens
    assert call(torch.tensor([3, 9], dtype=torch.int32), table) == 6


def test_functional_prefill_plans_once_per_length_tensors(monkeypatch):
    """forward_varlen reuses its wrapper's plan while the same length tensors come back unchanged, and plans
    again for new tensors, changed contents or another causality (a fake wrapper counts the plans)."""
    import sys
    import types

    fi_backend = fi
    plans = []

    class Wrapper:
        def __init__(self, float_workspace_buffer, kv_layout, backend):
            self.planned = None

        def plan(self, **kwargs):
            plans.append((kwargs["qo_indptr"].tolist(), kwargs["kv_indptr"].tolist(), kwargs["causal"]))
            self.planned = plans[-1]

        def run(self, q, k, v, out, return_lse, lse_base, lse_layout):
            return torch.full((q.shape[0], q.shape[1], v.shape[-1]), float(len(plans)))

    package = types.ModuleType("flashinfer")
    package.BatchPrefillWithRaggedKVCacheWrapper = Wrapper
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setattr(fi_backend, "float_workspace",
                        lambda device, workspace_manager=None: torch.empty(0, dtype=torch.uint8))
    impl = fi_backend.FlashInferPrefillImpl(2, 0.1, 512, 128, 64, 128, torch.device("cpu"))
    q = torch.randn(5, 2, 192)
    v = torch.randn(5, 2, 128)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    for _ in range(3):
        impl.forward_varlen(q, q, v, cu, cu, 3, 3, causal=True, return_softmax_lse=False)
    assert len(plans) == 1
    impl.forward_varlen(q, q, v, cu, cu, 3, 3, causal=False, return_softmax_lse=False)
    assert len(plans) == 2 and plans[-1][2] is False
    cu[1] = 3  # changed in place: the version counter moves
    impl.forward_varlen(q, q, v, cu, cu, 3, 3, causal=False, return_softmax_lse=False)
    assert len(plans) == 3 and plans[-1][0] == [0, 3, 5]
    other = cu.clone()  # equal values, another tensor: planned again (its contents are not compared)
    impl.forward_varlen(q, q, v, other, other, 3, 3, causal=False, return_softmax_lse=False)
    assert len(plans) == 4


def test_prefill_plan_shares_one_plan_among_chunks_of_the_same_lengths(monkeypatch):
    """A step's context chunks of equal lengths (full chunks) share one FlashInfer plan: the new tokens and
    each distinct chunk are planned once, and each chunk runs on the plan of its own lengths."""
    import types

    plans = []

    class Wrapper:
        def __init__(self, float_workspace_buffer, kv_layout, backend):
            self.planned = None

        def plan(self, **kwargs):
            plans.append((kwargs["kv_indptr"].tolist(), kwargs["causal"]))
            self.planned = plans[-1]

    _fake_flashinfer(monkeypatch, Wrapper, None)
    monkeypatch.setattr(fi, "float_workspace", lambda device, workspace_manager=None: torch.empty(0, dtype=torch.uint8))
    impl = fi.FlashInferPrefillImpl(2, 0.1, 512, 128, 64, 128, torch.device("cpu"))
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    chunk_lens = torch.tensor([[64, 64], [64, 64], [32, 64], [64, 64], [0, 16]], dtype=torch.int32)
    chunked = types.SimpleNamespace(num_chunks=5, seq_lens_cpu=chunk_lens)
    metadata = types.SimpleNamespace(query_start_loc_cpu=cu_q, query_start_loc=cu_q, chunked_context=chunked)
    plan = impl.plan(metadata, torch.bfloat16)
    assert plans == [([0, 4, 9], True), ([0, 64, 128], False),
                     ([0, 32, 96], False), ([0, 0, 16], False)]
    assert len(plan.context_chunks) == 5
    for lengths, wrapper in zip(chunk_lens.tolist(), plan.context_chunks):
        assert wrapper.planned == ([0, lengths[0], lengths[0] + lengths[1]], False)
    assert plan.context_chunks[0] is plan.context_chunks[1] is plan.context_chunks[3]


def test_memory_plan_reserves_flashinfer_float_workspace_in_the_shared_workspace(installed):
    """FlashInfer's float workspace is a reservation of the one shared workspace when FLASHINFER serves decode,
    prefill or both: one entry of 128 MiB, and the buffer holds the largest reservation, not the sum."""
    from mla_multi.memory import memory_plan

    dims = mm.MLADims.deepseek_v3(num_heads=16)
    with override("H100"):
        plans = {
            (d, p): memory_plan(dims, 256, 32768, decode_backend=d, prefill_backend=p)
            for d in ("FLASHINFER", "TRITON") for p in ("FLASHINFER", "TRITON")
        }
    for (decode, prefill), plan in plans.items():
        flashinfer = [entry for entry in plan.entries if entry[0] == fi.FLOAT_WORKSPACE_PURPOSE]
        assert len(flashinfer) == (decode == "FLASHINFER" or prefill == "FLASHINFER"), (decode, prefill)
        if flashinfer:
            assert flashinfer[0][1] == fi.FLOAT_WORKSPACE_BYTES
        assert plan.workspace_bytes == max(b for _, b, _ in plan.entries)
        assert str(plan).count("MiB") == len(plan.entries) + 1
    # TRITON decode reserves more than FlashInfer's 128 MiB here: FlashInfer's prefill adds nothing
    assert plans["TRITON", "FLASHINFER"].workspace_bytes == plans["TRITON", "TRITON"].workspace_bytes


def test_flashinfer_wrappers_take_the_shared_workspace_and_follow_its_buffer(monkeypatch):
    """The wrappers' float workspace is a view of the first bytes of the shared workspace (reserved there),
    and a workspace grown to a new buffer gets new wrappers, the old ones dropped (fake FlashInfer classes
    record what they were built with)."""
    from mla_multi.workspace import WorkspaceManager

    built = []

    class Wrapper:
        def __init__(self, float_workspace_buffer, **kwargs):
            built.append(float_workspace_buffer)

    _fake_flashinfer(monkeypatch, Wrapper, Wrapper)
    monkeypatch.setattr(fi, "_decode_wrappers", {})
    cpu = torch.device("cpu")
    manager = WorkspaceManager(cpu)
    manager.reserve(((1 << 20,), torch.uint8), purpose="decode: something smaller")

    def storage(tensor):
        return tensor.untyped_storage().data_ptr()

    prefill = fi.FlashInferPrefillImpl(2, 0.1, 512, 128, 64, 128, cpu)
    prefill.reserve_workspace(manager)
    assert manager.size_bytes == fi.FLOAT_WORKSPACE_BYTES
    assert dict((p, b) for p, b, _ in manager.describe())[fi.FLOAT_WORKSPACE_PURPOSE] == fi.FLOAT_WORKSPACE_BYTES
    first = prefill._wrappers(2, cpu)
    assert len(built) == 2 and all(storage(b) == storage(manager._buffer) and b.numel() == fi.FLOAT_WORKSPACE_BYTES
                                   for b in built)
    assert prefill._wrappers(2, cpu) == first and len(built) == 2  # kept while the buffer stays

    decode = fi.FlashInferDecodeImpl(16, 0.1, 512, 64, torch.bfloat16, 64, cpu)
    decode.reserve_workspace(manager, 8, 4096)
    wrapper, _, _ = decode._wrapper(cpu, 4, 1, False, 16, 0)
    assert storage(built[-1]) == storage(manager._buffer)
    assert decode._wrapper(cpu, 4, 1, False, 16, 0)[0] is wrapper

    manager.reserve(((fi.FLOAT_WORKSPACE_BYTES + (1 << 20),), torch.uint8), purpose="decode: larger")
    grown = storage(manager._buffer)
    assert prefill._wrappers(1, cpu)[0] is not first[0] and storage(built[-1]) == grown
    again, _, _ = decode._wrapper(cpu, 4, 1, False, 16, 0)
    assert again is not wrapper and storage(built[-1]) == grown
    # the old buffer's wrappers are gone from the cache: nothing holds the old bytes
    assert all(key[-1] == grown for key in fi._decode_wrappers)


def test_functional_flashinfer_calls_share_the_device_workspace_unless_it_is_locked_smaller(monkeypatch):
    """Without a layer's workspace, FlashInfer's float workspace is reserved in the device's shared workspace;
    where that one is locked smaller (layers that never reserved FlashInfer's), it is a buffer of its own."""
    from mla_multi.workspace import WorkspaceManager, set_workspace_manager

    cpu = torch.device("cpu")
    monkeypatch.setattr(fi, "_own_float_workspaces", {})
    shared = WorkspaceManager(cpu)
    set_workspace_manager(shared, cpu)
    try:
        buffer = fi.float_workspace(cpu)
        assert shared.size_bytes == fi.FLOAT_WORKSPACE_BYTES
        assert buffer.untyped_storage().data_ptr() == shared._buffer.untyped_storage().data_ptr()
        small = WorkspaceManager(cpu)
        small.reserve(((1024,), torch.uint8))
        small.lock()
        set_workspace_manager(small, cpu)
        own = fi.float_workspace(cpu)
        assert own.numel() == fi.FLOAT_WORKSPACE_BYTES and small.size_bytes == 1024
        assert fi.float_workspace(cpu) is own  # one per device
    finally:
        set_workspace_manager(None, cpu)
