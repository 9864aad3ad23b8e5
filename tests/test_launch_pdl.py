"""Programmatic dependent launch (`mla_multi.kernels.launch.pdl_constexprs`): where the decode kernels are
launched so, and that a kernel launched so waits on the kernel before it first (its compiled code)."""

from __future__ import annotations

import pytest
import torch

from mla_multi.kernels import launch
from mla_multi.platforms import specs


def _impersonate(monkeypatch, platform):
    import mla_multi.platforms as platforms

    monkeypatch.setattr(platforms, "current_platform", lambda: platform)


@pytest.mark.parametrize("name, expected", [("H100", True), ("H200", True), ("A100", False), ("MI300X", False),
                                            ("MI355X", False)])
def test_pdl_only_on_nvidia_sm90_and_later(monkeypatch, name, expected):
    monkeypatch.delenv("MLA_MULTI_PDL", raising=False)
    monkeypatch.setattr(launch, "_triton_has_gdc", lambda: True)
    _impersonate(monkeypatch, specs.get_spec(name))
    got = launch.pdl_constexprs(torch.device("cuda", 0))
    assert got == ({"PDL": True, "launch_pdl": True} if expected else {})


def test_pdl_off_by_the_variable_off_the_gpu_and_without_grid_dependency_control(monkeypatch):
    monkeypatch.setattr(launch, "_triton_has_gdc", lambda: True)
    _impersonate(monkeypatch, specs.get_spec("H200"))
    monkeypatch.setenv("MLA_MULTI_PDL", "0")
    assert launch.pdl_constexprs(torch.device("cuda", 0)) == {}
    monkeypatch.setenv("MLA_MULTI_PDL", "1")
    assert launch.pdl_constexprs(torch.device("cpu")) == {}
    assert launch.pdl_constexprs(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(launch, "_triton_has_gdc", lambda: False)
    assert launch.pdl_constexprs(torch.device("cuda", 0)) == {}


def test_a_kernel_launched_so_waits_first_and_lets_the_next_one_in():
    """The reduce kernel compiled for sm_90 with PDL: griddepcontrol.wait then launch_dependents before any
    load (the wait first); without PDL neither."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mla_multi.kernels.mla_decode import _mla_decode_reduce_kernel, _reduce_kernel_signature

    def ptx(pdl: bool) -> str:
        signature = dict(_reduce_kernel_signature(torch.bfloat16), PDL="constexpr", PARTIALS_BESIDE_LSE="constexpr")
        constexprs = {"Q_LEN": 1, "KV_LORA_RANK": 512, "BLOCK_DV": 128, "BLOCK_SPLITS": 16, "HAS_SINK": False,
                      "PDL": pdl, "PARTIALS_BESIDE_LSE": True}
        source = ASTSource(fn=_mla_decode_reduce_kernel, signature=signature, constexprs=constexprs)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]

    with_pdl = ptx(True)
    wait = with_pdl.index("griddepcontrol.wait")
    assert wait < with_pdl.index("griddepcontrol.launch_dependents") < with_pdl.index("ld.global")
    assert "griddepcontrol" not in ptx(False)
