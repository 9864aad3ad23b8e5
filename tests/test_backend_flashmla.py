"""The FLASHMLA backend on the CPU: its calls against the published `sgl-flash-mla` source, and its adapter
logic (index sanitising, topk_length folded into the indices, the joined query, LSE and empty rows, bad
indices, schedules made once per shape, selection and reasons) against a PyTorch stand-in of FlashMLA
(tests/fake_flash_mla) on impersonated NVIDIA platforms. The real kernels run in tests/test_sparse_gpu.py."""

from __future__ import annotations

import ast
import math
import pathlib
import sys
import zipfile

import pytest
import torch

import mla_multi as mm
from mla_multi import errors, registry
from mla_multi.backends import flashmla
from mla_multi.backends.reference import sparse_attention_reference
from mla_multi.ds_mla_cache import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from mla_multi.platforms import override
from published import published_distribution, published_parameters

FAKE = pathlib.Path(__file__).parent / "fake_flash_mla"
PUBLISHED = "sgl-flash-mla==1.0.0"
INTERFACE = "flash_mla/flash_mla_interface.py"


@pytest.fixture(scope="session")
def flashmla_wheel(pytestconfig) -> pathlib.Path:
    """The published sgl-flash-mla wheel: MLA_MULTI_FLASHMLA_WHEEL, or downloaded once into the pytest cache."""
    return published_distribution(pytestconfig, PUBLISHED, "sgl_flash_mla", ".whl", "MLA_MULTI_FLASHMLA_WHEEL",
                                  ("--only-binary", ":all:"))


def _published_functions(wheel: pathlib.Path) -> dict[str, ast.FunctionDef]:
    with zipfile.ZipFile(wheel) as archive:
        tree = ast.parse(archive.read(INTERFACE).decode("utf-8"))
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("call", flashmla.FLASHMLA_CALLS, ids=lambda c: c.function)
def test_adapter_calls_match_published_flashmla(flashmla_wheel, call):
    functions = _published_functions(flashmla_wheel)
    assert call.function in functions, f"{PUBLISHED} has no {call.function}"
    names, required = published_parameters(functions[call.function])
    assert set(call.keywords) <= set(names), set(call.keywords) - set(names)
    assert required <= set(call.keywords), f"{call.function} requires {required - set(call.keywords)}"


def test_fake_flashmla_has_the_published_signatures(flashmla_wheel):
    import inspect

    source = (FAKE / "flash_mla" / "__init__.py").read_text()
    fake = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    for call in flashmla.FLASHMLA_CALLS:
        published, _ = published_parameters(_published_functions(flashmla_wheel)[call.function])
        assert published_parameters(fake[call.function])[0] == published, call.function
    assert inspect  # the module's own probe reads signatures with inspect


def test_the_legacy_op_called_directly_has_the_published_schema(flashmla_wheel):
    """The op the bound sparse decodes call (`legacy_sparse_decode_op`): its schema as the published wheel's
    legacy library registers it (the string in `_C_legacy`), its loader's `get_ops`, and the stand-in's op."""
    import re

    import importlib.util

    spec = importlib.util.spec_from_file_location("fake_flash_mla_loader", FAKE / "flash_mla" / "_loader.py")
    fake_loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake_loader)
    with zipfile.ZipFile(flashmla_wheel) as archive:
        library = next(n for n in archive.namelist() if re.fullmatch(r"flash_mla/_C_legacy\..*so", n))
        binary = archive.read(library)
        loader = ast.parse(archive.read("flash_mla/_loader.py").decode("utf-8"))
    found = re.search(rb"sparse_decode_fwd\([^\x00]*", binary)  # the registration string, to its end
    assert found, f"{library} registers no sparse_decode_fwd"
    schema = torch._C.parse_schema("flash_mla_legacy::" + found.group(0).decode())
    assert tuple(a.name for a in schema.arguments) == flashmla.LEGACY_SPARSE_DECODE_ARGUMENTS
    assert len(schema.returns) == 4
    assert str(schema) == str(torch._C.parse_schema(fake_loader.SPARSE_DECODE_SCHEMA))
    get_ops = next(n for n in loader.body if isinstance(n, ast.FunctionDef) and n.name == "get_ops")
    assert [a.arg for a in get_ops.args.args] == ["use_legacy"]


def _ds_cache(generator, slots, block_size):
    rows = quantize_fp8_ds_mla(torch.randn(slots, 512, generator=generator), torch.randn(slots, 64, generator=generator))
    return rows.view(slots // block_size, block_size, 656), dequantize_fp8_ds_mla(rows, torch.float64)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_sparse_decode_through_flashmla_matches_float64(fake_flash_mla):
    generator = torch.Generator().manual_seed(0)
    cache, rows = _ds_cache(generator, 256, 16)
    tokens, heads, topk = 4, 64, 128
    q = torch.randn(tokens, heads, 576, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-1, 256, (tokens, topk), generator=generator, dtype=torch.int32)
    indices[1] = -1
    lengths = torch.tensor([128, 128, 5, 0], dtype=torch.int32)
    sink = torch.linspace(-1, 1, heads)
    sink[0] = math.inf
    with override("H100"):
        out, lse = mm.ops.mla_sparse_decode(q[..., :512], q[..., 512:], cache, indices, 0.05, topk_length=lengths,
                                            attn_sink=sink, backend="FLASHMLA", return_lse=True)
    ref, ref_lse, _ = sparse_attention_reference(q.double(), rows, indices, 0.05, topk_length=lengths,
                                                 attn_sink=sink.double())
    assert _rel(out, ref) < 1e-2
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))  # empty tokens: -inf, not FlashMLA's +inf
    assert bool((lse[1] == -math.inf).all()) and bool((out[3] == 0).all())
    calls = [c for c in fake_flash_mla.CALLS if c["function"] == "flash_mla_with_kvcache"]
    # topk_length folded into the indices (the sm_90 kernel takes none); the joined query read in place
    assert calls[0]["topk_length"] is None and calls[0]["q_ptr"] == q.data_ptr() and calls[0]["has_schedule"]


def test_sparse_decode_op_binds_a_layout_once_and_joins_the_query_only_where_adjacent(fake_flash_mla):
    """The op's plan binds its layout once (`FlashMLASparseDecodeImpl.bind`); later calls of the layout on new
    tensors: slices of one buffer pass FlashMLA that buffer, slices of the same strides from two buffers are
    joined by a copy (the address decides, on every call)."""
    generator = torch.Generator().manual_seed(5)
    cache, rows = _ds_cache(generator, 256, 16)
    tokens, heads, topk = 3, 64, 64
    bufs = [torch.randn(tokens, heads, 576, generator=generator).to(torch.bfloat16) for _ in range(3)]
    queries = [(bufs[0][..., :512], bufs[0][..., 512:]), (bufs[1][..., :512], bufs[1][..., 512:]),
               (bufs[1][..., :512], bufs[2][..., 512:])]
    launches = set()
    with override("H100"):
        for i, (q_nope, q_pe) in enumerate(queries):
            indices = torch.randint(-1, 256, (tokens, topk), generator=generator, dtype=torch.int32)
            fake_flash_mla.CALLS.clear()
            out = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices, 0.05, backend="FLASHMLA")
            ref = sparse_attention_reference(torch.cat([q_nope, q_pe], -1).double(), rows, indices, 0.05)[0]
            assert _rel(out, ref) < 1e-2, i
            call = next(c for c in fake_flash_mla.CALLS if c["function"] == "flash_mla_with_kvcache")
            assert (call["q_ptr"] == q_nope.data_ptr()) == (i < 2), i
            plan = next(p for k, p in reversed(mm.ops._PLANS.items()) if k[0] == "mla_sparse_decode"
                        and p.backend_cls.name == "FLASHMLA")
            launches.add(id(plan.launch))
    assert len(launches) == 1 and isinstance(plan.launch, flashmla._SparseDecodeLaunch)


def test_sparse_decode_schedule_is_made_once_per_shape(fake_flash_mla):
    generator = torch.Generator().manual_seed(1)
    cache, _ = _ds_cache(generator, 128, 64)
    q = torch.randn(3, 128, 576, generator=generator).to(torch.bfloat16)
    impl = flashmla.FlashMLASparseDecodeImpl(128, 512, 64)
    for seed in range(3):
        indices = torch.randint(0, 128, (3, 64), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        impl.forward(q[..., :512], q[..., 512:], cache, indices, 0.05)
    schedules = [c for c in fake_flash_mla.CALLS if c["function"] == "get_mla_decoding_metadata"]
    assert len(schedules) == 1 and schedules[0]["topk"] == 64 and schedules[0]["is_fp8_kvcache"]


def test_sparse_decode_bad_indices_never_reach_flashmla(fake_flash_mla):
    generator = torch.Generator().manual_seed(2)
    cache, _ = _ds_cache(generator, 128, 64)
    q = torch.randn(3, 64, 576, generator=generator).to(torch.bfloat16)
    indices = torch.randint(0, 128, (3, 64), generator=generator, dtype=torch.int32)
    indices[0, 3] = 128  # past the cache: FlashMLA would read outside it
    indices[2, 9] = -7
    errors.error_flag("cpu").zero_()
    impl = flashmla.FlashMLASparseDecodeImpl(64, 512, 64)
    out, lse = impl.forward(q[..., :512], q[..., 512:], cache, indices, 0.05)
    assert bool(torch.isnan(out[0]).all() and torch.isnan(out[2]).all() and torch.isnan(lse[0]).all())
    assert bool(torch.isfinite(out[1]).all())
    assert int(errors.error_flag("cpu")) & errors.SPARSE_INDEX
    errors.error_flag("cpu").zero_()
    with override("H100"), pytest.raises(ValueError, match="indices hold"):  # with the data checks: an error
        mm.ops.mla_sparse_decode(q[..., :512], q[..., 512:], cache, indices, 0.05, backend="FLASHMLA")


def test_sparse_prefill_through_flashmla_treats_out_of_range_as_none(fake_flash_mla):
    generator = torch.Generator().manual_seed(3)
    kv = torch.randn(300, 576, generator=generator).to(torch.bfloat16)
    q = torch.randn(4, 128, 576, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-5, 340, (4, 256), generator=generator, dtype=torch.int32)
    lengths = torch.tensor([256, 0, 100, 7], dtype=torch.int32)
    with override("H100"):
        out, lse = mm.ops.mla_sparse_prefill(q[..., :512], q[..., 512:], kv, indices, 0.05, topk_length=lengths,
                                             backend="FLASHMLA", return_lse=True)
    ref, ref_lse, _ = sparse_attention_reference(q.double(), kv.double(), indices, 0.05, topk_length=lengths,
                                                 bad_is_error=False)
    assert _rel(out, ref) < 1e-2 and bool((lse[1] == -math.inf).all())
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-3, atol=1e-2)


def test_dense_decode_through_flashmla_matches_reference_with_and_without_a_plan(fake_flash_mla):
    generator = torch.Generator().manual_seed(4)
    heads = 16
    cache = torch.randn(12, 64, 576, generator=generator).to(torch.bfloat16)
    table = torch.randperm(12, generator=generator)[:9].view(3, 3).to(torch.int32)
    seq_lens = torch.tensor([0, 130, 64], dtype=torch.int32)
    q = torch.randn(3, heads, 576, generator=generator).to(torch.bfloat16)
    impl = flashmla.FlashMLADecodeImpl(heads, 0.05, 512, 64, torch.bfloat16, 64)
    ref, ref_lse = mm.ops.mla_decode(q[..., :512].double(), q[..., 512:].double(), cache.double(), table, seq_lens,
                                     0.05, backend="REFERENCE", return_lse=True)
    plan = impl.plan(seq_lens, table)
    assert plan.empty_rows is not None
    for extra in ({}, {"plan": plan}):
        out, lse = impl.forward_mqa(q[..., :512], q[..., 512:], cache, table, seq_lens, **extra)
        assert _rel(out, ref) < 1e-2
        assert bool((out[0] == 0).all()) and bool((lse[0] == -math.inf).all())
        torch.testing.assert_close(lse[1:].double(), ref_lse[1:].double(), rtol=1e-3, atol=1e-2)


def test_selection_and_reasons_on_nvidia(fake_flash_mla):
    dims128, dims16 = mm.MLADims.deepseek_v3(num_heads=128), mm.MLADims.deepseek_v3(num_heads=16)
    with override("H100"):
        assert registry.select_sparse_backend("sparse_decode", dims128, torch.bfloat16, torch.uint8, 2048).name == "FLASHMLA"
        assert registry.select_sparse_backend("sparse_prefill", dims128, torch.bfloat16, torch.bfloat16, 2048).name == "FLASHMLA"
        # where FlashMLA cannot serve, TRITON does, and the reason says why
        assert registry.select_sparse_backend("sparse_decode", dims16, torch.bfloat16, torch.uint8, 2048).name == "TRITON"
        assert registry.select_sparse_backend("sparse_decode", dims128, torch.bfloat16, torch.bfloat16, 2048).name == "TRITON"
        config = registry.sparse_config(dims128, torch.bfloat16, torch.bfloat16, 192)
        reasons = registry.default_registry.reasons("sparse_prefill", "FLASHMLA", mm.current_platform(), config)
        assert any("multiple of 128" in r for r in reasons)
        config = registry.sparse_config(dims16, torch.bfloat16, torch.uint8, 100)
        reasons = registry.default_registry.reasons("sparse_decode", "FLASHMLA", mm.current_platform(), config)
        assert any("num_heads 16" in r for r in reasons) and any("multiple of 64" in r for r in reasons)
        fp8 = registry.decode_config(dims128, torch.bfloat16, torch.float8_e4m3fn, 64)
        assert any("FP8 query" in r for r in registry.default_registry.reasons("decode", "FLASHMLA",
                                                                               mm.current_platform(), fp8))
        small_pages = registry.decode_config(dims128, torch.bfloat16, torch.bfloat16, 16)
        assert any("block_size 16" in r for r in registry.default_registry.reasons("decode", "FLASHMLA",
                                                                                   mm.current_platform(), small_pages))
    with override("A100"):
        config = registry.sparse_config(dims128, torch.bfloat16, torch.uint8, 2048)
        reasons = registry.default_registry.reasons("sparse_decode", "FLASHMLA", mm.current_platform(), config)
        assert any("sm_80" in r for r in reasons)
    with override("MI300X"):
        config = registry.sparse_config(dims128, torch.bfloat16, torch.uint8, 2048)
        assert registry.default_registry.reasons("sparse_decode", "FLASHMLA", mm.current_platform(), config)


def test_few_sparse_tokens_go_to_triton_on_sm90(fake_flash_mla, monkeypatch):
    """A sparse decode over fp8_ds_mla planned with its token count goes to TRITON on sm_90 where it is one
    token, or tokens of at most 64 heads filling at most half the compute units (the index lists read as they
    are: measured faster than FlashMLA, bench/RESULTS.md); with topk_length, more tokens, an unknown count,
    without the in-place loader or off sm_90 FLASHMLA keeps it; a forced backend stays forced. A sparse layer
    names the backend of its few-token steps."""
    from mla_multi.kernels import mla_decode

    bf16 = torch.bfloat16
    d128, d64 = mm.MLADims.deepseek_v3(num_heads=128), mm.MLADims.deepseek_v3(num_heads=64)

    def pick(dims, tokens, **keywords):
        return registry.select_sparse_backend("sparse_decode", dims, bf16, torch.uint8, 2048, num_tokens=tokens,
                                              **keywords).name

    monkeypatch.setattr(mla_decode, "ds_mla_decode_reason", lambda platform, kv_cache=None: "")
    registry.default_registry.clear_cache()
    for spec in ("H100", "H200"):
        with override(spec):
            half = mm.current_platform().num_compute_units // 2
            assert (pick(d128, 1), pick(d128, 2), pick(d128, None)) == ("TRITON", "FLASHMLA", "FLASHMLA")
            assert (pick(d64, 1), pick(d64, half), pick(d64, half + 1)) == ("TRITON", "TRITON", "FLASHMLA")
            assert pick(d128, 1, with_lengths=True) == "FLASHMLA" and pick(d128, 1, backend="FLASHMLA") == "FLASHMLA"
            config = registry.sparse_config(d128, bf16, torch.uint8, 2048, num_tokens=1)
            rule = registry.default_registry.rule_for("sparse_decode", mm.current_platform(), config)
            assert rule is not None and "RESULTS.md" in rule.measured
            layer = mm.MLAAttention(d128, 0.1, torch.randn(128 * 256, 512, dtype=bf16), block_size=64,
                                    max_model_len=4096, max_num_seqs=4, kv_cache_dtype="fp8_ds_mla", sparse_topk=2048)
            assert layer.backends() == {"sparse_decode": "FLASHMLA", "sparse_decode_few_tokens": "TRITON"}
    with override("B200"):
        assert pick(d128, 1) == "FLASHMLA"
    monkeypatch.setattr(mla_decode, "ds_mla_decode_reason", lambda platform, kv_cache=None: "no in-place loader")
    registry.default_registry.clear_cache()
    with override("H200"):
        assert pick(d128, 1) == "FLASHMLA"


def test_without_flashmla_the_reason_names_the_distribution(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    flashmla.clear_caches()
    try:
        reasons = flashmla.FlashMLASparseDecodeBackend.availability_reasons()
        assert reasons and "sgl-flash-mla" in reasons[0] and "mla-multi[flashmla]" in reasons[0]
    finally:
        flashmla.clear_caches()


def test_joined_query_is_a_view_of_adjacent_slices_and_a_copy_otherwise():
    q = torch.randn(3, 4, 576)
    joined = flashmla.joined_query(q[..., :512], q[..., 512:])
    assert joined.data_ptr() == q.data_ptr() and torch.equal(joined, q)
    apart = flashmla.joined_query(q[..., :512].contiguous(), q[..., 512:].contiguous())
    assert apart.data_ptr() != q.data_ptr() and torch.equal(apart, q)


def test_the_paged_view_is_made_once_a_cache_and_lets_its_memory_go():
    """`_PagedView`: the same cache tensor at the same address gets the view made for it, another tensor (or the
    same one moved to new memory) a new one; the view goes when the cache tensor goes, so it holds no memory."""
    import gc

    paged = flashmla._PagedView()
    kv = torch.arange(2 * 4 * 6, dtype=torch.float32).view(2, 4, 6)
    first = paged(kv)
    assert first.shape == (2, 4, 1, 6) and first.data_ptr() == kv.data_ptr()
    assert paged(kv) is first
    other = kv.clone()
    second = paged(other)
    assert second is not first and second.data_ptr() == other.data_ptr()
    other.set_(torch.zeros(2, 4, 6))  # the same tensor, new memory
    third = paged(other)
    assert third is not second and third.data_ptr() == other.data_ptr()
    del second, third
    assert paged._view is not None
    del other
    gc.collect()
    assert paged._view is None and paged._source is None  # (with kv.unsqueeze(2) kept, `other` would live on)
