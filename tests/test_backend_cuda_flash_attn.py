"""CUDA_FLASH_ATTN: calls checked against flash-attention's published source and
PyTorch's own schemas, the FlashAttention-2/3 adapters run on the CPU against
stand-ins with the published signatures, selection on impersonated NVIDIA
devices, and PyTorch's flash kernels on a real GPU (marked gpu).

The published source is flash-attn's source distribution on PyPI (about 8 MB):
`pip download` into the pytest cache, or the file named by
MLA_MULTI_FLASH_ATTN_SDIST. Its Python files are read with `ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import sys
import tarfile
import types

import pytest
import torch
from published import adapter_keywords, published_distribution, published_parameters

from mla_multi.backends import cuda_flash_attn as fa
from mla_multi.backends.base import DecodeSelectorConfig, PrefillSelectorConfig
from mla_multi.backends.reference import mla_decode_reference, varlen_attention_reference
from mla_multi.dims import MLADims
from mla_multi.platforms import SPECS, override
from mla_multi.registry import Registry
from mla_multi.testing import relative_error

FLASH_ATTN_PUBLISHED = os.environ.get("MLA_MULTI_FLASH_ATTN_SPEC", "flash-attn==2.8.3")
ADAPTER_SOURCE = pathlib.Path(fa.__file__)

# --------------------------------------------------------------------------- published source


@pytest.fixture(scope="session")
def flash_attn_sdist(pytestconfig) -> pathlib.Path:
    """flash-attn's published source distribution: MLA_MULTI_FLASH_ATTN_SDIST, or downloaded once into the pytest cache."""
    # pip prepares an sdist's metadata even to download it: flash-attn's
    # setup.py imports torch (hence no build isolation) and skips its CUDA
    # build with this variable.
    return published_distribution(
        pytestconfig, FLASH_ATTN_PUBLISHED, "flash_attn", ".tar.gz", "MLA_MULTI_FLASH_ATTN_SDIST",
        ("--no-binary", ":all:", "--no-build-isolation"), {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"},
    )


def _published_function(sdist: pathlib.Path, source: str, function: str) -> ast.FunctionDef:
    with tarfile.open(sdist) as archive:
        member = next((m for m in archive.getmembers() if m.name.split("/", 1)[-1] == source), None)
        assert member is not None, f"{sdist.name} has no {source}"
        tree = ast.parse(archive.extractfile(member).read().decode("utf-8"), filename=source)
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function]
    assert found, f"{sdist.name}:{source} defines no top-level {function}()"
    return found[-1]


@pytest.mark.parametrize("call", fa.FLASH_ATTN_CALLS, ids=lambda c: f"{c.module}.{c.function}")
def test_adapter_calls_match_published_flash_attn(flash_attn_sdist, call):
    names, required = published_parameters(_published_function(flash_attn_sdist, call.source, call.function))
    unknown = [k for k in call.keywords if k not in names]
    assert not unknown, f"{flash_attn_sdist.name}: {call.function}() has no parameters {unknown}; it has {names}"
    missing = sorted(required - set(call.keywords))
    assert not missing, f"{flash_attn_sdist.name}: {call.function}() requires {missing}, which the adapter does not pass"


@pytest.mark.parametrize(
    "runner, call",
    [("_run_flash_attn_3", fa.FA3_VARLEN), ("_run_flash_attn_2", fa.FA2_VARLEN), ("forward_mqa", fa.FA3_KVCACHE)],
)
def test_adapter_source_passes_exactly_the_declared_keywords(runner, call):
    assert adapter_keywords(ADAPTER_SOURCE, runner, call.function) == set(call.keywords) | set(call.optional_keywords)


def test_published_fa3_varlen_returns_no_lse_in_this_release(flash_attn_sdist):
    """2.8.3's FA3 varlen function has no return_attn_probs: LSE calls must go elsewhere."""
    names, _ = published_parameters(_published_function(flash_attn_sdist, fa.FA3_VARLEN.source, fa.FA3_VARLEN.function))
    assert "return_attn_probs" not in names and "qv" in names


def test_torch_flash_attention_forward_schema():
    schema = torch.ops.aten._flash_attention_forward.default._schema
    positional = [a.name for a in schema.arguments if not a.kwarg_only][:10]
    assert positional == ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                          "is_causal", "return_debug_mask"]
    assert "scale" in [a.name for a in schema.arguments if a.kwarg_only]
    assert [r.name for r in schema.returns][:2] == ["output", "softmax_logsumexp"]


def test_torch_varlen_attn_signature():
    varlen = pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen_attn")
    probe = fa._probe_torch_varlen()
    parameters = probe.parameters["varlen_attn"]
    assert {"scale", "return_aux"} <= set(parameters)
    assert "window_size" in parameters or "is_causal" in parameters
    assert hasattr(varlen, "AuxRequest")


# --------------------------------------------------------------------------- stand-ins with the published signatures


def _attention(q, k, v, cu_q, cu_k, scale, causal):
    """float64 varlen attention for the stand-ins; +inf LSE for rows without keys, as FlashAttention-2 reports."""
    out, lse = varlen_attention_reference(q.double(), k.double(), v.double(), cu_q, cu_k, scale, causal)
    return out.to(q.dtype), torch.where(lse == float("-inf"), float("inf"), lse).float()


def fa2_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FlashAttention-2 needs one head dim"
    out, lse = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return (out, lse, None) if return_attn_probs else out


def fa3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                               k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                               num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0):
    out, _ = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return out


def fa3_flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                return_softmax_lse=False):
    """FA3's MLA semantics: scores = q . k + qv . v over the paged cache, causal bottom-right."""
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    batch, q_len, heads, _ = q.shape
    block_size = k_cache.shape[1]
    out = torch.zeros(batch, q_len, heads, v_cache.shape[-1], dtype=q.dtype)
    lse = torch.full((batch, heads, q_len), float("inf"))
    for b, seq_len in enumerate(cache_seqlens.tolist()):
        positions = torch.arange(seq_len)
        rows = page_table[b].long()[positions // block_size], positions % block_size
        keys, values = k_cache[rows][:, 0].double(), v_cache[rows][:, 0].double()
        for t in range(q_len):
            visible = seq_len - q_len + 1 + t if causal else seq_len
            if visible <= 0:
                continue
            scores = (q[b, t].double() @ keys[:visible].T + qv[b, t].double() @ values[:visible].T) * softmax_scale
            out[b, t] = (torch.softmax(scores, -1) @ values[:visible]).to(q.dtype)
            lse[b, :, t] = torch.logsumexp(scores, -1).float()
    return (out, lse) if return_softmax_lse else out


@pytest.fixture
def installed(monkeypatch):
    """Install stand-in `flash_attn` / `flash_attn_interface` modules: installed("fa2", "fa3")."""

    def install(*which: str) -> None:
        for name in ("flash_attn", "flash_attn_interface"):
            monkeypatch.setitem(sys.modules, name, None)  # import -> ModuleNotFoundError
        if "fa2" in which:
            module = types.ModuleType("flash_attn")
            module.__version__ = "2.8.3"
            module.flash_attn_varlen_func = fa2_flash_attn_varlen_func
            monkeypatch.setitem(sys.modules, "flash_attn", module)
        if "fa3" in which:
            module = types.ModuleType("flash_attn_interface")
            module.flash_attn_varlen_func = fa3_flash_attn_varlen_func
            module.flash_attn_with_kvcache = fa3_flash_attn_with_kvcache
            monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
        fa.clear_probe_cache()

    yield install
    fa.clear_probe_cache()


def test_stand_ins_have_the_published_signatures(flash_attn_sdist):
    import inspect

    for call, stand_in in ((fa.FA2_VARLEN, fa2_flash_attn_varlen_func), (fa.FA3_VARLEN, fa3_flash_attn_varlen_func),
                           (fa.FA3_KVCACHE, fa3_flash_attn_with_kvcache)):
        names, _ = published_parameters(_published_function(flash_attn_sdist, call.source, call.function))
        assert list(inspect.signature(stand_in).parameters) == names


CASES = {
    # new tokens: causal, one cu_seqlens tensor for q and k (as run_prefill_new_tokens passes it)
    "causal": ([6, 0, 9, 1], None, True),
    # a context chunk: non-causal, a sequence without keys
    "context": ([6, 0, 9, 1], [11, 3, 4, 0], False),
    # causal with more keys than queries: the mask is aligned bottom-right
    "causal-unequal": ([6, 0, 9, 1], [8, 2, 9, 5], True),
}


def _prefill_inputs(case, heads=3, dtype=torch.bfloat16, device="cpu"):
    generator = torch.Generator().manual_seed(7)
    lens_q, lens_k, causal = CASES[case]
    cu_q = torch.cumsum(torch.tensor([0] + lens_q), 0).to(torch.int32).to(device)
    cu_k = cu_q if lens_k is None else torch.cumsum(torch.tensor([0] + lens_k), 0).to(torch.int32).to(device)
    q = torch.randn(int(cu_q[-1]), heads, 192, generator=generator).to(dtype)
    k = torch.randn(int(cu_k[-1]), heads, 192, generator=generator).to(dtype)
    v = torch.randn(int(cu_k[-1]), heads, 128, generator=generator).to(dtype)
    move = lambda t: t.to(device)  # noqa: E731
    return move(q), move(k), move(v), cu_q, cu_k, max(lens_q), max(lens_k or lens_q), causal


def _check_prefill(impl, case, device="cpu", dtype=torch.bfloat16):
    q, k, v, cu_q, cu_k, max_q, max_k, causal = _prefill_inputs(case, dtype=dtype, device=device)
    ref, ref_lse = varlen_attention_reference(q.double(), k.double(), v.double(), cu_q, cu_k, impl.scale, causal)
    out, lse = impl.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, True)
    assert out.shape == (q.shape[0], q.shape[1], 128) and out.dtype == dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert relative_error(out, ref) < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "rows without keys give -inf, the others a finite LSE"
    assert (lse[~finite] == float("-inf")).all()
    assert relative_error(lse[finite], ref_lse[finite]) < 1e-3
    only_out = impl.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, False)
    assert relative_error(only_out, ref) < 1e-2


@pytest.mark.parametrize("case", list(CASES))
def test_fa2_pads_v_and_returns_lse(installed, case):
    installed("fa2")
    impl = fa.FlashAttnPrefillImpl(3, 0.09, 512, 128, 64, 128)
    with override("A100"):
        assert impl.implementation(need_lse=True) == fa.FLASH_ATTN_2
        _check_prefill(impl, case)


def test_fa3_serves_calls_without_lse_and_fa2_the_others(installed):
    installed("fa2", "fa3")
    impl = fa.FlashAttnPrefillImpl(3, 0.09, 512, 128, 64, 128)
    with override("H100"):
        assert impl.implementation(need_lse=False) == fa.FLASH_ATTN_3
        assert impl.implementation(need_lse=True) == fa.FLASH_ATTN_2
        _check_prefill(impl, "causal")
    with override("A100"):
        assert impl.implementation(need_lse=False) == fa.FLASH_ATTN_2


def test_fa3_decode_maps_the_latent_cache_onto_qv(installed):
    installed("fa3")
    generator = torch.Generator().manual_seed(3)
    block_size, heads = 16, 4
    seq_lens = torch.tensor([37, 0, 16], dtype=torch.int32)
    kv_cache = torch.randn(12, block_size, 576, generator=generator).to(torch.bfloat16)
    block_table = torch.randperm(12, generator=generator)[:9].reshape(3, 3).to(torch.int32)
    q_nope = torch.randn(3, heads, 512, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(3, heads, 64, generator=generator).to(torch.bfloat16)
    impl = fa.FlashAttnMLADecodeImpl(heads, 0.07, 512, 64, torch.bfloat16, block_size)
    out, lse = impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens)
    ref, ref_lse = mla_decode_reference(q_nope.double(), q_pe.double(), kv_cache.double(), block_table, seq_lens, 0.07)
    assert out.shape == (3, heads, 512) and lse.shape == (3, heads)
    assert relative_error(out, ref) < 1e-2
    assert not out[1].any() and (lse[1] == float("-inf")).all()
    assert relative_error(lse[[0, 2]], ref_lse[[0, 2]]) < 1e-3
    # Two query tokens per request: causal within the request.
    out2, lse2 = impl.forward_mqa(q_nope.unsqueeze(1).repeat(1, 2, 1, 1), q_pe.unsqueeze(1).repeat(1, 2, 1, 1),
                                  kv_cache, block_table, seq_lens)
    ref2, _ = mla_decode_reference(q_nope.unsqueeze(1).repeat(1, 2, 1, 1).double(), q_pe.unsqueeze(1).repeat(1, 2, 1, 1).double(),
                                   kv_cache.double(), block_table, seq_lens, 0.07)
    assert out2.shape == (3, 2, heads, 512) and lse2.shape == (3, 2, heads)
    assert relative_error(out2, ref2) < 1e-2


# --------------------------------------------------------------------------- selection


def _registry() -> Registry:
    return Registry(
        backends={
            "prefill": {"CUDA_FLASH_ATTN": fa.FlashAttnPrefillBackend,
                        "REFERENCE": "mla_multi.backends.reference:ReferencePrefillBackend"},
            "decode": {"CUDA_FLASH_ATTN": fa.FlashAttnMLADecodeBackend,
                       "REFERENCE": "mla_multi.backends.reference:ReferenceDecodeBackend"},
        },
        priorities={
            "prefill": {("cuda", None): ("CUDA_FLASH_ATTN", "REFERENCE"), ("rocm", None): ("REFERENCE",), ("cpu", None): ("REFERENCE",)},
            "decode": {("cuda", None): ("CUDA_FLASH_ATTN", "REFERENCE"), ("rocm", None): ("REFERENCE",), ("cpu", None): ("REFERENCE",)},
        },
    )


def test_selection_by_installed_implementations(installed):
    registry = _registry()
    prefill = PrefillSelectorConfig(MLADims.deepseek_v3(16), torch.bfloat16)
    decode = DecodeSelectorConfig(MLADims.deepseek_v3(16), torch.bfloat16, torch.bfloat16, 64)
    installed("fa2", "fa3")
    assert registry.select("prefill", prefill, SPECS["H100"]).name == "CUDA_FLASH_ATTN"
    assert registry.select("decode", decode, SPECS["H100"]).name == "CUDA_FLASH_ATTN"
    assert fa.FlashAttnPrefillBackend.prefill_implementation(SPECS["H100"], need_lse=False) == fa.FLASH_ATTN_3
    assert registry.reasons("decode", "CUDA_FLASH_ATTN", SPECS["A100"], decode) == [
        "flash_attn_3: needs sm_90 (Hopper); A100 (sm_80) is not"
    ]
    fp8 = DecodeSelectorConfig(MLADims.deepseek_v3(16), torch.bfloat16, torch.float8_e4m3fn, 64)
    assert registry.select("decode", fp8, SPECS["H100"]).name == "REFERENCE"
    assert registry.reasons("prefill", "CUDA_FLASH_ATTN", SPECS["MI300X"], prefill) == [
        "platform MI300X (rocm gfx942) is not supported; supported vendors: cuda"
    ]
    installed()  # nothing installed, and this torch (CPU build) offers no flash kernels
    registry.clear_cache()
    assert registry.select("prefill", prefill, SPECS["H100"]).name == "REFERENCE"
    reasons = registry.reasons("prefill", "CUDA_FLASH_ATTN", SPECS["H100"], prefill)
    assert any("flash_attn_interface is not installed" in r for r in reasons)
    assert any("module flash_attn is not installed" in r for r in reasons)
    if torch.version.cuda is None:
        assert any(r.startswith("torch._flash_attention_forward: torch") for r in reasons)
    decode_reasons = registry.reasons("decode", "CUDA_FLASH_ATTN", SPECS["H100"], decode)
    assert decode_reasons == ["decode needs FlashAttention-3's MLA path; flash_attn_3: module flash_attn_interface is not installed"]


def test_b200_and_old_gpus(installed):
    installed("fa2")
    registry = _registry()
    prefill = PrefillSelectorConfig(MLADims.deepseek_v3(16), torch.bfloat16)
    reasons = registry.reasons("prefill", "CUDA_FLASH_ATTN", SPECS["B200"], prefill)
    assert "flash_attn_2: built for sm_80 .. sm_90; B200 (sm_100) is not" in reasons
    assert registry.select("prefill", prefill, SPECS["A100"]).name == "CUDA_FLASH_ATTN"
    assert registry.reasons("prefill", "CUDA_FLASH_ATTN", SPECS["A100"],
                            PrefillSelectorConfig(MLADims.deepseek_v3(16), torch.float32)) == [
        "dtype float32 is not supported; supported: float16, bfloat16"
    ]


def test_implementation_order_and_cudnn_alignment(monkeypatch):
    available = {name: fa.ImplementationProbe(name, "test") for name in fa.PREFILL_IMPLEMENTATIONS}
    monkeypatch.setattr(fa, "probe_implementations", lambda: available)
    usable, reasons = fa.prefill_candidates(SPECS["H100"], need_lse=False)
    assert usable == list(fa.PREFILL_IMPLEMENTATIONS)
    usable, reasons = fa.prefill_candidates(SPECS["H100"], need_lse=True, causal_unequal=True)
    assert usable == [fa.FLASH_ATTN_2, fa.TORCH_VARLEN_ATTN, fa.TORCH_FLASH_ATTENTION_FORWARD]
    assert reasons[fa.TORCH_CUDNN_ATTENTION] == ["torch._cudnn_attention_forward: its causal mask is aligned top-left"]
    assert reasons[fa.FLASH_ATTN_3] == ["flash_attn_3 test: flash_attn_varlen_func returns no LSE"]
    usable, _ = fa.prefill_candidates(SPECS["B200"], need_lse=True)
    assert usable == [fa.TORCH_VARLEN_ATTN, fa.TORCH_FLASH_ATTENTION_FORWARD, fa.TORCH_CUDNN_ATTENTION]


def test_rows_without_keys():
    cu_q = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 4, 7, 7], dtype=torch.int32)
    assert fa._rows_without_keys(cu_q, cu_k, 6).tolist() == [True, True, False, False, False, True]


# --------------------------------------------------------------------------- PyTorch's kernels on a GPU


def _cuda_is_nvidia() -> bool:
    return torch.cuda.is_available() and torch.version.cuda is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_kernels_on_gpu(case, dtype):
    if not _cuda_is_nvidia():
        pytest.skip("needs an NVIDIA GPU")
    fa.clear_probe_cache()
    impl = fa.FlashAttnPrefillImpl(3, 0.09, 512, 128, 64, 128)
    print("implementation:", case, impl.implementation(need_lse=True, causal_unequal=case == "causal-unequal"))
    _check_prefill(impl, case, device="cuda", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", [fa.TORCH_CUDNN_ATTENTION, fa.TORCH_VARLEN_ATTN, fa.TORCH_FLASH_ATTENTION_FORWARD])
def test_each_torch_path_on_gpu(implementation, monkeypatch):
    if not _cuda_is_nvidia():
        pytest.skip("needs an NVIDIA GPU")
    fa.clear_probe_cache()
    probes = fa.probe_implementations()
    assert probes[implementation].error is None, probes[implementation].error
    others = {name: dataclasses.replace(p, error=f"disabled for {implementation}") for name, p in probes.items()}
    monkeypatch.setattr(fa, "probe_implementations", lambda: {**others, implementation: probes[implementation]})
    impl = fa.FlashAttnPrefillImpl(3, 0.09, 512, 128, 64, 128)
    assert impl.implementation(need_lse=True) == implementation
    for case in CASES:
        if implementation == fa.TORCH_CUDNN_ATTENTION and case == "causal-unequal":
            with pytest.raises(RuntimeError, match="aligned top-left"):
                _check_prefill(impl, case, device="cuda")
            continue
        _check_prefill(impl, case, device="cuda")
