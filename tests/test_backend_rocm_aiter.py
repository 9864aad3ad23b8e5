"""ROCM_AITER on the CPU: the adapter against aiter's published source, against a
PyTorch stand-in of aiter (tests/fake_aiter), and backend selection on
impersonated MI300X / MI355X.

The published source comes from the amd-aiter wheel on PyPI (about 40 MB):
`pip download --no-deps` into the pytest cache, or the file named by
MLA_MULTI_AITER_WHEEL. The source is read with `ast`; aiter is never imported.
"""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import sys
import zipfile

import pytest
import torch
from published import adapter_keywords, published_distribution, published_parameters

from mla_multi.backends import rocm_aiter
from mla_multi.backends.base import DecodeSelectorConfig, PrefillSelectorConfig
from mla_multi.backends.reference import mla_decode_reference, varlen_attention_reference
from mla_multi.dims import MLADims
from mla_multi.platforms import SPECS, override
from mla_multi.registry import NoBackendError, Registry
from mla_multi.testing import relative_error

AITER_PUBLISHED = os.environ.get("MLA_MULTI_AITER_SPEC", "amd-aiter==0.1.7.post2.dev18")
FAKE_AITER = pathlib.Path(__file__).parent / "fake_aiter"
ADAPTER_SOURCE = pathlib.Path(rocm_aiter.__file__)


# --------------------------------------------------------------------------- published source


@pytest.fixture(scope="session")
def aiter_wheel(pytestconfig) -> pathlib.Path:
    """The published amd-aiter wheel: MLA_MULTI_AITER_WHEEL, or downloaded once into the pytest cache."""
    return published_distribution(
        pytestconfig, AITER_PUBLISHED, "amd_aiter", ".whl", "MLA_MULTI_AITER_WHEEL", ("--only-binary", ":all:")
    )


def _published_function(wheel: pathlib.Path, source: str, function: str) -> ast.FunctionDef:
    with zipfile.ZipFile(wheel) as archive:
        tree = ast.parse(archive.read(source).decode("utf-8"), filename=source)
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function]
    assert found, f"{wheel.name}:{source} defines no top-level {function}()"
    return found[-1]


@pytest.mark.parametrize("call", rocm_aiter.AITER_CALLS, ids=lambda c: c.function)
def test_adapter_calls_match_published_aiter(aiter_wheel, call):
    node = _published_function(aiter_wheel, call.source, call.function)
    names, required = published_parameters(node)
    unknown = [k for k in call.keywords if k not in names]
    assert not unknown, f"{aiter_wheel.name}: {call.function}() has no parameters {unknown}; it has {sorted(names)}"
    missing = sorted(required - set(call.keywords))
    assert not missing, f"{aiter_wheel.name}: {call.function}() requires {missing}, which the adapter does not pass"


def test_adapter_source_passes_exactly_the_declared_keywords():
    decode = adapter_keywords(ADAPTER_SOURCE, "forward_mqa", "mla_decode_fwd")
    assert decode == set(rocm_aiter.MLA_DECODE_FWD.keywords) | set(rocm_aiter.MLA_DECODE_FWD.optional_keywords)
    prefill = adapter_keywords(ADAPTER_SOURCE, "forward_varlen", "flash_attn_varlen_func")
    assert prefill == set(rocm_aiter.FLASH_ATTN_VARLEN_FUNC.keywords)


def test_published_aiter_offers_fp8_scales_and_no_decode_lse(aiter_wheel):
    """What this release offers decides the capability checks: q_scale/kv_scale yes, return_lse no."""
    names, _ = published_parameters(_published_function(aiter_wheel, "aiter/mla.py", "mla_decode_fwd"))
    assert {"q_scale", "kv_scale"} <= set(names)
    assert "return_lse" not in names
    optional = set(rocm_aiter.MLA_DECODE_FWD.optional_keywords)
    assert optional - set(names) == {"return_lse"}


def test_fake_aiter_has_the_published_signatures(aiter_wheel, fake_aiter):
    import aiter
    import aiter.mla

    for call, function in ((rocm_aiter.MLA_DECODE_FWD, aiter.mla.mla_decode_fwd),
                           (rocm_aiter.FLASH_ATTN_VARLEN_FUNC, aiter.flash_attn_varlen_func)):
        published = _published_function(aiter_wheel, call.source, call.function)
        published_names = [a.arg for a in published.args.args + published.args.kwonlyargs]
        assert list(inspect.signature(function).parameters) == published_names


def test_published_aiter_ships_mla_kernels_for_gfx942_and_gfx950(aiter_wheel):
    with zipfile.ZipFile(aiter_wheel) as archive:
        archs = {name.split("/")[2] for name in archive.namelist()
                 if name.startswith("aiter_meta/hsa/") and "/mla/" in name and name.endswith(".co")}
    assert set(rocm_aiter.AITER_ARCHS) <= archs


# --------------------------------------------------------------------------- the stand-in aiter


def _forget_aiter() -> dict:
    return {name: sys.modules.pop(name) for name in list(sys.modules) if name == "aiter" or name.startswith("aiter.")}


@pytest.fixture
def aiter_on_path(monkeypatch):
    """Put a directory holding an `aiter` package first on sys.path; restore everything after."""
    saved = _forget_aiter()

    def install(directory: pathlib.Path) -> None:
        _forget_aiter()
        monkeypatch.syspath_prepend(str(directory))
        rocm_aiter.clear_probe_cache()

    yield install
    _forget_aiter()
    sys.modules.update(saved)
    rocm_aiter.clear_probe_cache()


@pytest.fixture
def fake_aiter(aiter_on_path):
    aiter_on_path(FAKE_AITER)
    import aiter.mla
    import aiter.ops.mha

    aiter.mla.CALLS.clear()
    aiter.ops.mha.CALLS.clear()
    return aiter


@pytest.fixture
def broken_aiter(aiter_on_path, tmp_path):
    package = tmp_path / "aiter"
    package.mkdir()
    (package / "__init__.py").write_text('raise RuntimeError("ROCm version file not found")\n')
    aiter_on_path(tmp_path)


@pytest.fixture
def missing_aiter(aiter_on_path, monkeypatch):
    aiter_on_path(FAKE_AITER.parent / "no-such-directory")
    monkeypatch.setitem(sys.modules, "aiter", None)  # import aiter -> ModuleNotFoundError
    rocm_aiter.clear_probe_cache()


def _expected_indices(block_table, seq_lens, block_size):
    rows = []
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows += [int(block_table[b, j // block_size]) * block_size + j % block_size for j in range(seq_len)]
    return rows


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_kv_indices_expand_block_tables(block_size):
    generator = torch.Generator().manual_seed(block_size)
    max_blocks = 5
    seq_lens = torch.tensor([0, 1, block_size * 3 + 1, block_size * max_blocks], dtype=torch.int32)
    block_table = torch.randperm(40, generator=generator)[: 4 * max_blocks].reshape(4, max_blocks).to(torch.int32)
    qo_indptr, kv_indptr, kv_indices, last = rocm_aiter.paged_kv_indices(block_table, seq_lens, block_size)
    assert qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert kv_indptr.tolist() == [0] + torch.cumsum(seq_lens, 0).tolist()
    assert last.tolist() == [1, 1, 1, 1]
    assert all(t.dtype == torch.int32 for t in (qo_indptr, kv_indptr, kv_indices, last))
    total = int(seq_lens.sum())
    assert kv_indices[:total].tolist() == _expected_indices(block_table, seq_lens, block_size)
    assert kv_indices.numel() == 4 * max_blocks * block_size
    assert not kv_indices[total:].any()


def test_paged_kv_indices_never_read_data_back():
    """Built on the meta device: any host read of the data (a sync on a GPU) would raise."""
    block_table = torch.empty(8, 12, dtype=torch.int32, device="meta")
    seq_lens = torch.empty(8, dtype=torch.int32, device="meta")
    qo_indptr, kv_indptr, kv_indices, last = rocm_aiter.paged_kv_indices(block_table, seq_lens, 16)
    assert kv_indices.shape == (8 * 12 * 16,) and kv_indptr.shape == (9,) and qo_indptr.shape == (9,)


def _decode_case(num_heads, block_size, seq_lens, kv_cache_dtype=torch.bfloat16, k_scale=None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lkv, rope = 512, 64
    batch = len(seq_lens)
    max_blocks = max(1, -(-max(seq_lens) // block_size))
    num_blocks = batch * max_blocks + 3
    q_nope = torch.randn(batch, num_heads, lkv, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(batch, num_heads, rope, generator=generator).to(torch.bfloat16)
    values = torch.randn(num_blocks, block_size, lkv + rope, generator=generator)
    if kv_cache_dtype == torch.bfloat16:
        kv_cache = values.to(torch.bfloat16)
    else:
        kv_cache = (values / k_scale).to(kv_cache_dtype)
    block_table = torch.randperm(num_blocks, generator=generator)[: batch * max_blocks].reshape(batch, max_blocks).to(torch.int32)
    return q_nope, q_pe, kv_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32)


def _decode_impl(num_heads, block_size, kv_cache_dtype=torch.bfloat16, scale=0.1):
    return rocm_aiter.AiterMLADecodeImpl(num_heads, scale, 512, 64, kv_cache_dtype, block_size)


@pytest.mark.parametrize("platform", ["MI300X", "MI355X"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [8, 16, 128])
def test_decode_matches_reference(fake_aiter, platform, block_size, num_heads):
    seq_lens = [block_size * 2 + 3, 0, 1, 70]
    q_nope, q_pe, kv_cache, block_table, seq_lens_t = _decode_case(num_heads, block_size, seq_lens, seed=num_heads + block_size)
    scale = 0.0721
    with override(platform):
        out, lse = _decode_impl(num_heads, block_size, scale=scale).forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens_t)
    ref, _ = mla_decode_reference(q_nope.double(), q_pe.double(), kv_cache.double(), block_table, seq_lens_t, scale)
    assert out.shape == q_nope.shape and out.dtype == torch.bfloat16
    assert relative_error(out, ref) < 1e-2
    assert not out[1].any(), "a request without tokens gives 0"
    # This aiter release returns no usable LSE: the adapter says so instead of passing garbage on.
    assert lse is None
    assert not rocm_aiter.AiterMLADecodeBackend.provides_decode_lse()
    # The scale is always passed (aiter's default 1/sqrt(576) is wrong for MLA); splits left to aiter.
    assert [c["sm_scale"] for c in fake_aiter.mla.CALLS] == [scale]
    assert fake_aiter.mla.CALLS[0]["num_kv_splits"] is None


def test_decode_passes_num_kv_splits_and_takes_q_len_axis(fake_aiter):
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(16, 16, [33, 5])
    out, lse = _decode_impl(16, 16).forward_mqa(
        q_nope.unsqueeze(1), q_pe.unsqueeze(1), kv_cache, block_table, seq_lens, num_kv_splits=4
    )
    ref, _ = mla_decode_reference(q_nope.double(), q_pe.double(), kv_cache.double(), block_table, seq_lens, 0.1)
    assert out.shape == (2, 1, 16, 512)
    assert relative_error(out.squeeze(1), ref) < 1e-2
    assert fake_aiter.mla.CALLS[0]["num_kv_splits"] == 4
    with pytest.raises(ValueError, match="query tokens"):
        _decode_impl(16, 16).forward_mqa(q_nope.unsqueeze(1).expand(2, 2, 16, 512), q_pe.unsqueeze(1).expand(2, 2, 16, 64),
                                         kv_cache, block_table, seq_lens)


@pytest.mark.parametrize("platform", ["MI300X", "MI355X"])
def test_fp8_decode_quantises_the_query_and_passes_scales(fake_aiter, platform):
    fp8 = SPECS[platform].fp8_dtype
    k_scale = torch.tensor([0.05])
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(16, 16, [40, 17, 64], fp8, k_scale)
    with override(platform):
        out, _ = _decode_impl(16, 16, fp8).forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale=k_scale)
    ref, _ = mla_decode_reference(q_nope.double(), q_pe.double(), kv_cache, block_table, seq_lens, 0.1, k_scale.double())
    assert relative_error(out, ref) < 6e-2
    assert fake_aiter.mla.CALLS[0]["q_dtype"] == fp8
    with pytest.raises(ValueError, match="k_scale"):
        _decode_impl(16, 16, fp8).forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens)


def test_decode_lse_is_used_where_aiter_returns_one(fake_aiter, monkeypatch):
    """A newer signature with `return_lse`: the adapter asks for it and returns it as [B, N]."""
    base = fake_aiter.mla.mla_decode_fwd

    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None,
                       q_scale=None, kv_scale=None, return_lse=False):
        base(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
             sm_scale=sm_scale, num_kv_splits=num_kv_splits, q_scale=q_scale, kv_scale=kv_scale)
        keys = kv_buffer.reshape(kv_buffer.shape[0], -1).double()
        lse = torch.full(o.shape[:2], float("nan"))
        for b in range(qo_indptr.numel() - 1):
            rows = keys[kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()]
            if rows.shape[0]:
                lse[b] = torch.logsumexp(q[b].double() @ rows.T * sm_scale, dim=-1).float()
        return o, (lse if return_lse else None)

    monkeypatch.setattr(fake_aiter.mla, "mla_decode_fwd", mla_decode_fwd)
    rocm_aiter.clear_probe_cache()
    assert rocm_aiter.AiterMLADecodeBackend.provides_decode_lse()
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(8, 16, [30, 0, 9])
    out, lse = _decode_impl(8, 16).forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens)
    ref, ref_lse = mla_decode_reference(q_nope.double(), q_pe.double(), kv_cache.double(), block_table, seq_lens, 0.1)
    assert lse.shape == (3, 8) and lse.dtype == torch.float32
    assert relative_error(out, ref) < 1e-2
    assert torch.equal(lse[1], torch.full((8,), float("-inf")))
    assert relative_error(lse[[0, 2]], ref_lse[[0, 2]]) < 1e-3


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_reference(fake_aiter, causal):
    generator = torch.Generator().manual_seed(int(causal))
    lens_q, lens_k = [5, 0, 9], ([5, 0, 9] if causal else [7, 4, 12])
    cu_q = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    cu_k = torch.cumsum(torch.tensor([0] + lens_k), 0).to(torch.int32)
    heads = 4
    q = torch.randn(14, heads, 192, generator=generator).to(torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), heads, 192, generator=generator).to(torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), heads, 128, generator=generator).to(torch.bfloat16)
    impl = rocm_aiter.AiterMLAPrefillImpl(heads, 0.08, 512, 128, 64, 128)
    out, lse = impl.forward_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, True)
    ref, ref_lse = varlen_attention_reference(q.double(), k.double(), v.double(), cu_q, cu_k, 0.08, causal)
    assert out.shape == (14, heads, 128) and lse.shape == (heads, 14) and lse.dtype == torch.float32
    assert relative_error(out, ref) < 1e-2
    assert relative_error(lse, ref_lse) < 1e-3
    only_out = impl.forward_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, False)
    assert torch.equal(only_out, out)
    assert [c["softmax_scale"] for c in fake_aiter.ops.mha.CALLS] == [0.08, 0.08]


def test_prefill_empty_rows_give_zero_and_minus_inf(fake_aiter):
    q = torch.randn(3, 2, 192).to(torch.bfloat16)
    kv = torch.zeros(0, 2, 192, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 3], dtype=torch.int32)
    cu_k = torch.tensor([0, 0], dtype=torch.int32)
    impl = rocm_aiter.AiterMLAPrefillImpl(2, 0.1, 512, 128, 64, 128)
    out, lse = impl.forward_varlen(q, kv, kv[..., :128], cu_q, cu_k, 3, 0, False, True)
    assert not out.any()
    assert torch.equal(lse, torch.full((2, 3), float("-inf")))


# --------------------------------------------------------------------------- selection


def _registry() -> Registry:
    return Registry(
        backends={
            "prefill": {"ROCM_AITER": rocm_aiter.AiterMLAPrefillBackend,
                        "REFERENCE": "mla_multi.backends.reference:ReferencePrefillBackend"},
            "decode": {"ROCM_AITER": rocm_aiter.AiterMLADecodeBackend,
                       "REFERENCE": "mla_multi.backends.reference:ReferenceDecodeBackend"},
        },
        priorities={
            "prefill": {("rocm", None): ("ROCM_AITER", "REFERENCE"), ("cuda", None): ("REFERENCE",), ("cpu", None): ("REFERENCE",)},
            "decode": {("rocm", None): ("ROCM_AITER", "REFERENCE"), ("cuda", None): ("REFERENCE",), ("cpu", None): ("REFERENCE",)},
        },
    )


def _decode_config(platform: str, num_heads: int, kv_cache_dtype, dtype=torch.bfloat16, block_size=64):
    resolved = SPECS[platform].fp8_dtype if kv_cache_dtype == "fp8" else kv_cache_dtype
    return DecodeSelectorConfig(MLADims.deepseek_v3(num_heads), dtype, resolved, block_size)


FAKE_LABEL = "aiter 0.1.7.post2.dev18+fake"


@pytest.mark.parametrize("platform", ["MI300X", "MI355X"])
@pytest.mark.parametrize("kv_cache_dtype", [torch.bfloat16, "fp8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_heads", [8, 16, 32, 64, 128])
def test_decode_selection_with_aiter(fake_aiter, platform, kv_cache_dtype, num_heads):
    registry = _registry()
    config = _decode_config(platform, num_heads, kv_cache_dtype)
    chosen = registry.select("decode", config, SPECS[platform])
    reasons = registry.reasons("decode", "ROCM_AITER", SPECS[platform], config)
    if num_heads in (8, 16, 128):
        assert chosen.name == "ROCM_AITER" and reasons == []
    else:
        assert chosen.name == "REFERENCE"
        assert reasons == [
            f"num_heads {num_heads} is not supported by {FAKE_LABEL} on {platform} ({SPECS[platform].arch})'s "
            "mla_decode_fwd; supported: 1-15 (padded to 16), 16, 128"
        ]


@pytest.mark.parametrize("platform", ["MI300X", "MI355X"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefill_selection_with_aiter(fake_aiter, platform, dtype):
    registry = _registry()
    chosen = registry.select("prefill", PrefillSelectorConfig(MLADims.deepseek_v3(16), dtype), SPECS[platform])
    assert chosen.name == "ROCM_AITER"
    fp32 = registry.reasons("prefill", "ROCM_AITER", SPECS[platform], PrefillSelectorConfig(MLADims.deepseek_v3(16), torch.float32))
    assert fp32 == [f"dtype float32 is not supported by {FAKE_LABEL} on {platform} ({SPECS[platform].arch}); "
                    "supported: float16, bfloat16"]


def test_decode_reasons_name_version_and_platform(fake_aiter):
    registry = _registry()
    mi300 = SPECS["MI300X"]
    wrong_fp8 = DecodeSelectorConfig(MLADims.deepseek_v3(16), torch.bfloat16, torch.float8_e4m3fn, 64)
    assert registry.reasons("decode", "ROCM_AITER", mi300, wrong_fp8) == [
        f"kv_cache_dtype float8_e4m3fn is not supported by {FAKE_LABEL} on MI300X (gfx942); its fp8 type is float8_e4m3fnuz"
    ]
    fp16 = DecodeSelectorConfig(MLADims.deepseek_v3(16), torch.float16, torch.float16, 64)
    assert registry.reasons("decode", "ROCM_AITER", mi300, fp16) == [
        f"dtype float16 is not supported by {FAKE_LABEL} on MI300X (gfx942); supported: bfloat16",
        f"kv_cache_dtype float16 is not supported by {FAKE_LABEL} on MI300X (gfx942); supported: bfloat16, float8_e4m3fnuz",
    ]
    speculative = DecodeSelectorConfig(MLADims.deepseek_v3(16), torch.bfloat16, torch.bfloat16, 64, max_query_len=2)
    assert registry.reasons("decode", "ROCM_AITER", mi300, speculative) == [
        f"max_query_len 2 is not supported by ROCM_AITER ({FAKE_LABEL} on MI300X (gfx942)); accepted: 1"
    ]
    for other in ("MI250X", "RX7900XTX"):
        reasons = registry.reasons("decode", "ROCM_AITER", SPECS[other], _decode_config(other, 16, torch.bfloat16))
        assert reasons[0] == (f"{FAKE_LABEL} has no MLA decode kernels for {other} ({SPECS[other].arch}); "
                              "supported: gfx942, gfx950")
    h100 = registry.reasons("decode", "ROCM_AITER", SPECS["H100"], _decode_config("H100", 16, torch.bfloat16))
    assert h100 == ["platform H100 (cuda sm_90) is not supported; aiter runs on ROCm only"]
    with pytest.raises(NoBackendError, match="num_heads 32 is not supported"):
        registry.select("decode", _decode_config("MI300X", 32, torch.bfloat16), mi300, backend="ROCM_AITER")


def test_fp8_needs_an_aiter_with_scales(fake_aiter, monkeypatch):
    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       sm_scale=None, logit_cap=0.0, num_kv_splits=None):
        raise AssertionError("not called in this test")

    monkeypatch.setattr(fake_aiter.mla, "mla_decode_fwd", mla_decode_fwd)
    rocm_aiter.clear_probe_cache()
    registry = _registry()
    config = _decode_config("MI355X", 128, "fp8")
    assert registry.select("decode", config, SPECS["MI355X"]).name == "REFERENCE"
    assert registry.reasons("decode", "ROCM_AITER", SPECS["MI355X"], config) == [
        f"kv_cache_dtype float8_e4m3fn is not supported by {FAKE_LABEL} on MI355X (gfx950): "
        "its mla_decode_fwd takes no q_scale / kv_scale (no fp8 kernels)"
    ]
    assert registry.select("decode", _decode_config("MI355X", 128, torch.bfloat16), SPECS["MI355X"]).name == "ROCM_AITER"


def test_kernel_inventory_limits_the_architectures(fake_aiter, monkeypatch):
    monkeypatch.setattr(rocm_aiter, "_kernel_archs", lambda module: ("gfx942",))
    rocm_aiter.clear_probe_cache()
    registry = _registry()
    config = _decode_config("MI355X", 16, torch.bfloat16)
    assert registry.reasons("decode", "ROCM_AITER", SPECS["MI355X"], config) == [
        f"{FAKE_LABEL} has no MLA decode kernels for MI355X (gfx950); shipped with kernels: gfx942"
    ]
    assert registry.select("decode", _decode_config("MI300X", 16, torch.bfloat16), SPECS["MI300X"]).name == "ROCM_AITER"


@pytest.mark.parametrize("num_heads", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("platform", ["MI300X", "MI355X"])
def test_selection_without_aiter_falls_back(missing_aiter, platform, num_heads):
    registry = _registry()
    for kv_cache_dtype in (torch.bfloat16, "fp8"):
        config = _decode_config(platform, num_heads, kv_cache_dtype)
        assert registry.select("decode", config, SPECS[platform]).name == "REFERENCE"
        assert registry.reasons("decode", "ROCM_AITER", SPECS[platform], config) == [
            "aiter is not installed (pip package amd-aiter)"
        ]
    prefill = PrefillSelectorConfig(MLADims.deepseek_v3(num_heads), torch.bfloat16)
    assert registry.select("prefill", prefill, SPECS[platform]).name == "REFERENCE"


def test_an_aiter_that_raises_on_import_is_a_reason(broken_aiter):
    registry = _registry()
    config = _decode_config("MI300X", 16, torch.bfloat16)
    reasons = registry.reasons("decode", "ROCM_AITER", SPECS["MI300X"], config)
    assert len(reasons) == 1
    assert reasons[0].startswith("import aiter ") and reasons[0].endswith("failed: RuntimeError: ROCm version file not found")
    assert registry.select("decode", config, SPECS["MI300X"]).name == "REFERENCE"
    assert not rocm_aiter.AiterMLAPrefillBackend.is_available()
    with pytest.raises(NoBackendError, match="ROCm version file not found"):
        registry.select("prefill", PrefillSelectorConfig(MLADims.deepseek_v3(16), torch.bfloat16), SPECS["MI300X"],
                        backend="ROCM_AITER")


def test_probe_is_cached(fake_aiter, monkeypatch):
    first = rocm_aiter.probe_aiter()
    calls = []
    monkeypatch.setattr(rocm_aiter.importlib, "import_module", lambda name: calls.append(name))
    assert rocm_aiter.probe_aiter() is first and calls == []
    assert rocm_aiter.AiterMLADecodeBackend.info()["aiter_version"] == "0.1.7.post2.dev18+fake"
