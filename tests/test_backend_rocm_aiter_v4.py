"""ROCM_AITER and the DeepSeek-V4 contract: aiter's V4 decode kernels (mla_v40_decode_fwd, mla_decode_fwd_v4_nm)
are declined, and every V4 configuration says why, from aiter's source (installed or not); the facts the
reasons state are checked against aiter's source in test_backend_rocm_aiter_contract.py."""

from __future__ import annotations

import pytest
import torch

from mla_multi import registry
from mla_multi.backends import rocm_aiter
from mla_multi.dims import MLADims
from mla_multi.platforms import SPECS
from mla_multi.registry import NoBackendError

V4 = MLADims(128, kv_lora_rank=448, qk_rope_head_dim=64)


def _decode_config(heads: int = 128, max_query_len: int = 1):
    dims = MLADims(heads, kv_lora_rank=448, qk_rope_head_dim=64)
    return registry.sparse_config(dims, torch.bfloat16, torch.uint8, 640, max_query_len=max_query_len,
                                  kv_format="fp8_ds_mla_v4", extra_kv_format="fp8_ds_mla_v4", with_sink=True)


def _v4_reasons(backend, platform: str, config) -> list[str]:
    reasons = backend.validate_configuration(SPECS[platform], config)
    return [r for r in reasons if "V4" in r or "v4" in r]


def test_rocm_aiter_declares_no_v4_format():
    assert rocm_aiter.AiterSparseDecodeBackend.supported_v4_formats == ()
    assert rocm_aiter.AiterSparsePrefillBackend.supported_v4_formats == ()
    assert rocm_aiter.AITER_V40_TOKEN_BYTES == 640
    assert rocm_aiter.AiterSparseDecodeBackend.info()["v4"].startswith(
        "declined: aiter v0.1.20.post1's mla_v40_decode_fwd, mla_decode_fwd_v4_nm (gfx950")


def test_v4_decode_on_mi355x_names_both_kernels_and_the_decision(monkeypatch):
    monkeypatch.delenv("AITER_ENABLE_EXPERIMENTAL", raising=False)
    reasons = _v4_reasons(rocm_aiter.AiterSparseDecodeBackend, "MI355X", _decode_config(128))
    assert reasons[0] == (
        "the V4 contract (d_qk = d_v = 512) over fp8_ds_mla_v4 is not implemented by ROCM_AITER; V4 formats "
        "supported: none (aiter v0.1.20.post1's V4 kernels mla_v40_decode_fwd, mla_decode_fwd_v4_nm are declined)")
    assert reasons[1].startswith(
        "mla_v40_decode_fwd declined (not converted): aiter runs it only with AITER_ENABLE_EXPERIMENTAL set (here "
        "unset) and heads x query tokens 64 or 128 (here 128 x 1); it reads one cache a call")
    assert "fp8_ds_mla_v4's 584 bytes convert exactly (the same e4m3 values and scales), at 584 bytes read and " \
           "640 written a token a step" in reasons[1]
    assert reasons[2] == (
        "mla_decode_fwd_v4_nm declined: its kernel fixes the softmax scale at 1/sqrt(512) (sm_scale ignored; the "
        "V4 contract takes the caller's), its split merge writes no final LSE (the V4 op returns one), it requires "
        "a sink and takes FP8 packed query and cache rows, page size 1, heads x query tokens 16 x 1/2/4, 32 x 1, "
        "64 x 1, 128 x 1 (here 128 x 1)")
    assert len(reasons) == 3
    monkeypatch.setenv("AITER_ENABLE_EXPERIMENTAL", "1")
    again = _v4_reasons(rocm_aiter.AiterSparseDecodeBackend, "MI355X", _decode_config(64, 2))
    assert "AITER_ENABLE_EXPERIMENTAL set (here '1') and heads x query tokens 64 or 128 (here 64 x 2)" in again[1]
    assert len(again) == 3  # the switch set, the decision stands


def test_v4_on_mi300x_and_v4_prefill_are_declined_with_their_reasons():
    reasons = _v4_reasons(rocm_aiter.AiterSparseDecodeBackend, "MI300X", _decode_config())
    assert reasons[1] == ("aiter v0.1.20.post1's V4 decode kernels (mla_v40_decode_fwd, mla_decode_fwd_v4_nm) run "
                          "on gfx950 only (mla_decode_fwd_v4_nm also on gfx1250); none for MI300X (gfx942)")
    rows = registry.sparse_config(V4, torch.bfloat16, torch.bfloat16, 2048, kv_format="rows", with_sink=True)
    for platform in ("MI300X", "MI355X"):
        prefill = _v4_reasons(rocm_aiter.AiterSparsePrefillBackend, platform, rows)
        assert prefill == [
            "the V4 contract (d_qk = d_v = 512) over rows is not implemented by ROCM_AITER; V4 formats supported: "
            "none (aiter v0.1.20.post1's V4 kernels mla_v40_decode_fwd, mla_decode_fwd_v4_nm are declined)",
            "aiter v0.1.20.post1 has no V4 sparse prefill: its V4 kernels are decodes over FP8 packed caches; none "
            "reads float rows"]


def test_v4_is_declined_with_the_stand_in_installed(monkeypatch):
    """With aiter importable the V4 reasons are the same, and forcing ROCM_AITER raises with them."""
    import pathlib
    import sys

    fake = pathlib.Path(__file__).parent / "fake_aiter"
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if n == "aiter" or n.startswith("aiter.")}
    monkeypatch.syspath_prepend(str(fake))
    rocm_aiter.clear_probe_cache()
    try:
        reasons = rocm_aiter.AiterSparseDecodeBackend.validate_configuration(SPECS["MI355X"], _decode_config())
        assert not any("not installed" in r for r in reasons)
        assert [r.split(" ")[0] for r in reasons[-2:]] == ["mla_v40_decode_fwd", "mla_decode_fwd_v4_nm"]
        with pytest.raises(NoBackendError, match="mla_v40_decode_fwd declined"):
            registry.default_registry.select("sparse_decode", _decode_config(), SPECS["MI355X"], "ROCM_AITER")
    finally:
        for name in [n for n in sys.modules if n == "aiter" or n.startswith("aiter.")]:
            del sys.modules[name]
        sys.modules.update(saved)
        rocm_aiter.clear_probe_cache()


def test_info_shows_the_v4_reasons(capsys):
    from mla_multi import cli

    assert cli.main(["info", "--as", "MI355X"]) == 0
    printed = capsys.readouterr().out
    v4 = printed[printed.index("sparse_decode_v4:"):printed.index("sparse_prefill_v4:")]
    assert "- mla_v40_decode_fwd declined (not converted)" in v4 and "- mla_decode_fwd_v4_nm declined" in v4
    assert cli.main(["info", "--as", "MI300X"]) == 0
    printed = capsys.readouterr().out
    v4 = printed[printed.index("sparse_decode_v4:"):printed.index("sparse_prefill_v4:")]
    assert "run on gfx950 only (mla_decode_fwd_v4_nm also on gfx1250); none for MI300X (gfx942)" in v4
