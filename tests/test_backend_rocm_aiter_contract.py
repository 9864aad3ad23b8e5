"""ROCM_AITER against aiter's source: the functions it calls, the keywords it passes, the kernel tables its
routes follow, and the stand-in aiter's signatures.

The facts come from tests/fake_aiter/contract.json (aiter v0.1.20.post1, the
commit recorded in it, read by tests/fake_aiter/make_contract.py), and also,
where given, from a wheel named by MLA_MULTI_AITER_WHEEL or a source tree
(a checkout of ROCm/aiter) named by MLA_MULTI_AITER_SOURCE: the same checks
then run against that aiter, and contract.json must agree with it. aiter is
never imported: its source is read with `ast`.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
from published import adapter_keywords

from mla_multi.backends import rocm_aiter

FAKE_AITER = pathlib.Path(__file__).parent / "fake_aiter"
CONTRACT_JSON = FAKE_AITER / "contract.json"
ADAPTER_SOURCE = pathlib.Path(rocm_aiter.__file__)
sys.path.insert(0, str(FAKE_AITER))
import make_contract  # noqa: E402

sys.path.remove(str(FAKE_AITER))


def _committed() -> dict:
    return json.loads(CONTRACT_JSON.read_text())


def _sources() -> list:
    sources = [pytest.param("contract.json", id="contract.json")]
    for variable in ("MLA_MULTI_AITER_WHEEL", "MLA_MULTI_AITER_SOURCE"):
        given = os.environ.get(variable)
        sources.append(pytest.param(given, id=variable, marks=pytest.mark.skipif(not given, reason=f"{variable} unset")))
    return sources


@pytest.fixture(params=_sources())
def contract(request) -> dict:
    if request.param == "contract.json":
        return _committed()
    path = pathlib.Path(request.param)
    assert path.exists(), f"{request.param!r} does not exist; accepted: an aiter wheel or a ROCm/aiter checkout"
    return make_contract.read_contract(path)


def _parameters(contract: dict, function: str) -> list[list]:
    entry = contract["functions"].get(function)
    assert entry is not None and entry["parameters"] is not None, (
        f"aiter's {function}() is not in the source read; the adapter calls it"
    )
    return entry["parameters"]


def test_contract_records_the_commit_the_adapter_follows():
    recorded = _committed()["aiter"]
    assert (recorded["tag"], recorded["commit"]) == (rocm_aiter.AITER_SOURCE_TAG, rocm_aiter.AITER_SOURCE_COMMIT)
    assert len(recorded["commit"]) == 40


def _call_id(call) -> str:
    if call is rocm_aiter.SPARSE_MLA_DECODE_FWD:
        return call.function + "(sparse)"
    if call in (rocm_aiter.SPARSE_PERSISTENT_MLA_DECODE_FWD, rocm_aiter.SPARSE_GET_MLA_METADATA_INFO_V1,
                rocm_aiter.SPARSE_GET_MLA_METADATA_V1):
        return call.function + "(sparse persistent)"
    return call.function


@pytest.mark.parametrize("call", rocm_aiter.AITER_CALLS, ids=_call_id)
def test_adapter_calls_match_aiter(contract, call):
    parameters = _parameters(contract, call.function)
    names = [name for name, _ in parameters]
    required = {name for name, default in parameters if default is None}
    passed = set(call.keywords) | set(call.optional_keywords)
    unknown = sorted(passed - set(names))
    assert not unknown, f"aiter's {call.function}() has no parameters {unknown}; it has {names}"
    missing = sorted(required - set(call.keywords))
    assert not missing, f"aiter's {call.function}() requires {missing}, which the adapter does not always pass"
    assert contract["functions"][call.function]["source"] == call.source


def test_adapter_source_passes_exactly_the_declared_keywords():
    decode = adapter_keywords(ADAPTER_SOURCE, "forward_mqa", "mla_decode_fwd")
    assert decode == set(rocm_aiter.MLA_DECODE_FWD.keywords) | set(rocm_aiter.MLA_DECODE_FWD.optional_keywords)
    metadata = adapter_keywords(ADAPTER_SOURCE, "plan", "get_mla_metadata_v1")
    assert metadata == set(rocm_aiter.GET_MLA_METADATA_V1.keywords)
    info = adapter_keywords(ADAPTER_SOURCE, "_metadata_buffers", "get_mla_metadata_info_v1")
    assert info == set(rocm_aiter.GET_MLA_METADATA_INFO_V1.keywords)
    prefill = adapter_keywords(ADAPTER_SOURCE, "forward_varlen", "flash_attn_varlen_func")
    assert prefill == set(rocm_aiter.FLASH_ATTN_VARLEN_FUNC.keywords) | set(
        rocm_aiter.FLASH_ATTN_VARLEN_FUNC.optional_keywords)
    sparse = adapter_keywords(ADAPTER_SOURCE, "_sparse_mla_decode_fwd", "mla_decode_fwd")
    assert sparse == set(rocm_aiter.SPARSE_MLA_DECODE_FWD.keywords) | set(
        rocm_aiter.SPARSE_MLA_DECODE_FWD.optional_keywords)
    for call in (rocm_aiter.SPARSE_PERSISTENT_MLA_DECODE_FWD, rocm_aiter.SPARSE_GET_MLA_METADATA_INFO_V1,
                 rocm_aiter.SPARSE_GET_MLA_METADATA_V1):
        passed = adapter_keywords(ADAPTER_SOURCE, "_sparse_persistent_mla_decode_fwd", call.function)
        assert passed == set(call.keywords) | set(call.optional_keywords), call.function


def test_aiters_persistent_sparse_metadata(contract):
    """The facts the persistent sparse path follows: is_sparse= sizes the buffers, topk= (-1: dense) plans them,
    max_split_per_batch= caps the splits; mla_decode_fwd takes an explicit num_kv_splits."""
    info = dict(map(tuple, _parameters(contract, "get_mla_metadata_info_v1")))
    assert info["is_sparse"] is None and info["num_kv_splits"] == "32"
    metadata = dict(map(tuple, _parameters(contract, "get_mla_metadata_v1")))
    assert (metadata["topk"], metadata["max_split_per_batch"], metadata["uni_seqlen_qo"]) == ("-1", "-1", "-1")
    decode = dict(map(tuple, _parameters(contract, "mla_decode_fwd")))
    assert decode["num_kv_splits"] == "None" and decode["return_lse"] == "False"


def test_aiter_has_the_persistent_path_and_the_lse(contract):
    """What this aiter offers decides the adapter's paths: persistent buffers, return_lse, causal, the sink."""
    decode = {name for name, _ in _parameters(contract, "mla_decode_fwd")}
    assert {"work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
            "reduce_partial_map", "return_lse", "causal", "page_size", "nhead_kv"} <= decode
    metadata = dict(map(tuple, _parameters(contract, "get_mla_metadata_v1")))
    assert (metadata["page_size"], metadata["kv_granularity"], metadata["fast_mode"]) == ("1", "16", "True")
    varlen = dict(map(tuple, _parameters(contract, "flash_attn_varlen_func")))
    assert "sink_ptr" in varlen and varlen["window_size"] == "(-1, -1, 0)"


def _decode_rows(contract: dict, arch: str) -> set[tuple]:
    rows = contract["mla_kernels"][arch]
    assert rows, f"the source read has no {arch} MLA kernel table"
    return {(r["q"], r["kv"], r["gqa"], r["ps"], r["qlen"], r["causal"], r["lse"]) for r in rows
            if not r["prefill"] and not r["cprr"]}


@pytest.mark.parametrize("arch", rocm_aiter.AITER_ARCHS)
def test_adapter_kernel_tables_are_aiters(contract, arch):
    ours = set(rocm_aiter.AITER_DECODE_KERNELS[arch])
    theirs = _decode_rows(contract, arch)
    assert ours == theirs, (f"{arch}: the adapter's table lacks {sorted(theirs - ours)} and has extra "
                            f"{sorted(ours - theirs)}")


def test_the_decode_kernels_that_write_the_lse(contract):
    """gfx942 has one decode kernel that writes the LSE (FP8, 64 heads, one query token, persistent)."""
    with_lse = [r for r in contract["mla_kernels"]["gfx942"] if r["lse"] and not r["prefill"]]
    assert [(r["q"], r["kv"], r["gqa"], r["ps"], r["qlen"]) for r in with_lse] == [("fp8", "fp8", 64, 1, 1)]
    assert any(r["lse"] and r["q"] == "bf16" for r in contract["mla_kernels"]["gfx950"])


@pytest.mark.parametrize("arch", rocm_aiter.AITER_ARCHS)
def test_aiters_fp8_prefill_kernels(contract, arch):
    """The FP8 MLA prefill ROCM_AITER runs on gfx950: fp8 q and cache, one query head a KV head, persistent,
    causal or not, no LSE column; the same two kernels in both tables (aiter's C++ refuses gfx942 at the call)."""
    rows = [r for r in contract["mla_kernels"][arch] if r["prefill"] and r["q"] == "fp8"]
    assert {(r["kv"], r["ps"], r["qlen"], r["lse"]) for r in rows} == {("fp8", 1, 0, 0)}
    assert {(r["gqa"], r["causal"], r["kernel"]) for r in rows} == set(rocm_aiter.AITER_FP8_PREFILL_TABLE[arch])
    for r in rows:
        assert f"qh{rocm_aiter.AITER_FP8_PREFILL_QK_HEAD_DIM}_vh{rocm_aiter.AITER_FP8_PREFILL_V_HEAD_DIM}" in r["kernel"]


def test_adapter_passes_the_fp8_prefill_keywords():
    for call in rocm_aiter.FP8_PREFILL_CALLS:
        where = "_fp8_prefill_metadata" if call is rocm_aiter.GET_PS_METADATA_INFO_V1 else "_fp8_prefill"
        assert adapter_keywords(ADAPTER_SOURCE, where, call.function) == set(call.keywords), call.function


def test_aiters_fp8_prefill_calls(contract):
    """mla_prefill_ps_fwd takes the reduce maps and per-tensor scales; its work comes from get_ps_metadata_v1
    (host-planned, sized by get_ps_metadata_info_v1) and its partials are merged by mla_reduce_v1 (whose
    final_lse is optional: the adapter passes none)."""
    wrapper = dict(map(tuple, _parameters(contract, "mla_prefill_ps_fwd")))
    assert {"reduce_indptr", "reduce_final_map", "reduce_partial_map", "q_scale", "k_scale", "v_scale"} <= set(wrapper)
    asm = dict(map(tuple, _parameters(contract, "mla_prefill_ps_asm_fwd")))
    assert (asm["q_scale"], asm["k_scale"], asm["v_scale"]) == ("None", "None", "None")
    assert [n for n, d in _parameters(contract, "get_ps_metadata_info_v1")] == [
        "batch_size", "num_head_k", "max_qlen", "qlen_granularity"]
    plan = dict(map(tuple, _parameters(contract, "get_ps_metadata_v1")))
    assert (plan["qlen_granularity"], plan["kvlen_granularity"], plan["block_size"], plan["is_causal"]) == (
        "256", "16", "16", "True")
    assert "is_sparse" not in plan and "topk" not in plan
    reduce = [n for n, d in _parameters(contract, "mla_reduce_v1")]
    assert reduce[:3] == ["partial_output", "partial_lse", "reduce_indptr"] and "final_lse" in reduce


def _body(contract: dict, function: str) -> dict:
    body = contract["functions"].get(function, {}).get("body")
    assert body is not None, f"aiter's {function}() is not in the source read; ROCM_AITER's V4 reasons rely on it"
    return body


def test_aiters_v40_decode_gates_are_the_adapters(contract):
    """mla_v40_decode_fwd: gfx950, the experimental switch, heads x query tokens, page sizes, HipKittens' kernel
    and the reduce; the packed layout's constants; the sink it takes (ROCM_AITER's reason states them)."""
    body = _body(contract, "mla_v40_decode_fwd")
    assert {"get_gfx", "is_experimental_enabled", "hk_mla_v40_decode_fwd", "mla_reduce_v1"} <= set(body["calls"])
    assert list(rocm_aiter.AITER_V40_HEADS_X_QUERY_TOKENS) in body["int_tuples"]
    assert list(rocm_aiter.AITER_V40_PAGE_SIZES) in body["int_tuples"]
    assert body["strings"] == list(rocm_aiter.AITER_V40_ARCHS)
    assert contract["mla_constants"] == rocm_aiter.AITER_V40_DIMS
    assert contract["experimental_switch"] == [rocm_aiter.AITER_V4_EXPERIMENTAL_SWITCH]
    parameters = dict(map(tuple, _parameters(contract, "mla_v40_decode_fwd")))
    assert (parameters["attn_sink"], parameters["return_lse"], parameters["sm_scale"]) == ("None", "False", "None")
    assert {"q_rope", "kv_buffer_rope", "work_indptr", "work_info_set"} <= set(parameters)
    assert "attn_sink" in dict(map(tuple, _parameters(contract, "hk_mla_v40_decode_fwd")))


def test_aiters_v4_nm_decode_is_the_adapters(contract):
    """mla_decode_fwd_v4_nm: the sink required (keyword-only), separate RoPE buffers, one kernel on gfx950 (Gqa 64,
    one query token, no LSE) in hsa/gfx950/mla_v4/mla_v4_asm.csv."""
    body = _body(contract, "mla_decode_fwd_v4_nm")
    assert body["required_keywords"] == ["sink"] and "mla_decode_v4_asm" in body["calls"]
    names = [n for n, _ in _parameters(contract, "mla_decode_fwd_v4_nm")]
    assert {"qrope", "kvrope", "sm_scale", "num_kv_splits"} <= set(names)
    rows = contract["mla_v4_kernels"]["gfx950"]
    assert {(r["q"], r["kv"], r["gqa"], r["ps"], r["qlen"], r["prefill"], r["causal"], r["lse"], r["kernel"])
            for r in rows} == set(rocm_aiter.AITER_V4_NM_TABLE["gfx950"])


def test_fake_aiter_has_aiters_signatures():
    """The stand-in's functions take aiter's parameters, in aiter's order, with aiter's defaults."""
    committed = _committed()
    for function, entry in committed["functions"].items():
        path = FAKE_AITER / entry["source"]
        fake = make_contract.function_parameters(path.read_text(), function)
        assert fake is not None, f"tests/fake_aiter/{entry['source']} has no {function}()"
        assert fake == entry["parameters"], f"{function}: the stand-in takes {fake}; aiter takes {entry['parameters']}"


def test_fake_kernel_tables_are_the_contracts():
    sys.path.insert(0, str(FAKE_AITER))
    try:
        from aiter import _model  # the stand-in's model, read without installing the stand-in
        assert _model.contract() == _committed()
    finally:
        sys.path.remove(str(FAKE_AITER))
        for name in [n for n in sys.modules if n == "aiter" or n.startswith("aiter.")]:
            del sys.modules[name]


def test_given_source_agrees_with_contract_json():
    """With MLA_MULTI_AITER_SOURCE or MLA_MULTI_AITER_WHEEL: contract.json holds what that aiter says."""
    given = os.environ.get("MLA_MULTI_AITER_SOURCE") or os.environ.get("MLA_MULTI_AITER_WHEEL")
    if not given:
        pytest.skip("MLA_MULTI_AITER_SOURCE / MLA_MULTI_AITER_WHEEL unset")
    read = make_contract.read_contract(pathlib.Path(given))
    committed = _committed()
    for function, entry in committed["functions"].items():
        assert read["functions"][function]["parameters"] == entry["parameters"], function
    for arch in rocm_aiter.AITER_ARCHS:
        assert _decode_rows(read, arch) == _decode_rows(committed, arch), arch
    for key in ("mla_v4_kernels", "mla_constants", "experimental_switch"):
        assert read[key] == committed[key], key
    for function in make_contract.BODY_FACTS:
        assert read["functions"][function]["body"] == committed["functions"][function]["body"], function


def test_make_contract_reads_a_source_tree(tmp_path):
    """The reader itself: a tree with one function and one kernel table gives their facts."""
    (tmp_path / "aiter").mkdir()
    (tmp_path / "aiter" / "mla.py").write_text("def mla_decode_fwd(q, o, *, page_size=1, lse=None):\n    pass\n")
    (tmp_path / "hsa" / "gfx942" / "mla").mkdir(parents=True)
    (tmp_path / "hsa" / "gfx942" / "mla" / "mla_asm.csv").write_text(
        "qType,kvType,Gqa,ps,qSeqLen,prefill,causal,lse,knl_name,co_name\nfp8,fp8,64,1,1,0,1,1,_Z,k.co\n")
    read = make_contract.read_contract(tmp_path)
    assert read["functions"]["mla_decode_fwd"]["parameters"] == [["q", None], ["o", None], ["page_size", "1"],
                                                                 ["lse", "None"]]
    assert read["functions"]["mla_reduce_v1"]["parameters"] is None
    assert read["mla_kernels"]["gfx942"] == [dict(q="fp8", kv="fp8", gqa=64, ps=1, qlen=1, prefill=0, causal=1,
                                                  lse=1, cprr=0, kernel="k")]
    assert read["mla_kernels"]["gfx950"] is None
