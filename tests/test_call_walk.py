"""The walk of a call through the package's floors, traced as it runs: a decode and a sparse decode through
the public ops, and a layer's decode step, go down the floors once (ops or the layer -> registry -> backend ->
kernels) and come back, never climbing from a lower floor into a higher one.

The calls run under the Triton interpreter (this file run as a script), every call into a module of the
package recorded by `sys.setprofile` with the nearest calling module of the package. Helpers every floor uses
(checks, errors, envs, platforms, workspace, dims, ...) have no floor.
"""

from __future__ import annotations

import sys

import pytest
import torch
from interpreter import print_results, run_interpreter_script

# the floors, top down; a module not named here is a helper of every floor
FLOORS = {"mla_multi.ops": 0, "mla_multi.attention": 0, "mla_multi.registry": 1}
FLOOR_PREFIXES = (("mla_multi.backends.", 2), ("mla_multi.kernels", 3))


def floor(module: str | None) -> int | None:
    if module is None:
        return None
    if module in FLOORS:
        return FLOORS[module]
    for prefix, level in FLOOR_PREFIXES:
        if module.startswith(prefix):
            return level
    return None


def trace(fn) -> list[tuple[str | None, str]]:
    """(calling module, called module) of every call that enters a module of the package from another one, the
    caller the nearest module of a floor up the stack (so that a helper between two floors hides no climb)."""
    edges = []

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("mla_multi"):
            return
        back = frame.f_back
        while back is not None and floor(back.f_globals.get("__name__", "")) is None:
            back = back.f_back
        caller = None if back is None else back.f_globals["__name__"]
        if caller != module:
            edges.append((caller, module))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return edges


def climbs(edges) -> list[tuple[str, str]]:
    """The calls from a module of a lower floor into one of a higher floor."""
    return [(caller, callee) for caller, callee in edges
            if floor(caller) is not None and floor(callee) is not None and floor(callee) < floor(caller)]


def floors_in_order(edges) -> list[str]:
    """The floored modules in the order the call first enters them."""
    seen = []
    for _, callee in edges:
        if floor(callee) is not None and callee not in seen:
            seen.append(callee)
    return seen


def _calls() -> dict:
    import mla_multi as mm

    gen = torch.Generator().manual_seed(0)
    heads, block = 16, 16
    cache = torch.randn(8, block, 576, generator=gen).half()
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    lens = torch.tensor([40, 64], dtype=torch.int32)
    q_nope = torch.randn(2, heads, 512, generator=gen).half()
    q_pe = torch.randn(2, heads, 64, generator=gen).half()
    indices = torch.tensor([[0, 5, 17, -1], [3, 40, 41, 100]], dtype=torch.int32)

    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    weight = (torch.randn(heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, generator=gen)
              / dims.kv_lora_rank**0.5).half()
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=block, max_model_len=64,
                            max_num_seqs=2, decode_backend="TRITON")
    layer_cache = torch.randn(8, block, dims.kv_cache_width, generator=gen).half()
    md = mm.CommonAttentionMetadata.from_lengths([1, 1], [40, 64], table, block)
    q = torch.randn(2, heads, dims.qk_head_dim, generator=gen).half()
    kv_c = torch.randn(2, dims.kv_lora_rank, generator=gen).half()
    k_pe = torch.randn(2, dims.qk_rope_head_dim, generator=gen).half()
    layer.plan(md)

    return {
        "decode": lambda: mm.ops.mla_decode(q_nope, q_pe, cache, table, lens, 0.1, backend="TRITON"),
        "sparse decode": lambda: mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices, 0.1, backend="TRITON"),
        "layer decode step": lambda: layer(q, kv_c, k_pe, layer_cache, md),
    }


def _interpreter_main() -> None:
    results = {}
    for name, call in _calls().items():
        first = trace(call)  # the first call selects and binds
        later = trace(call)
        results[name] = {"first": first, "later": later}
    print_results(results)


@pytest.fixture(scope="module")
def walks():
    return run_interpreter_script(__file__)


@pytest.mark.interpreter
@pytest.mark.parametrize("call", ["decode", "sparse decode", "layer decode step"])
@pytest.mark.parametrize("which", ["first", "later"])
def test_a_call_goes_down_the_floors_once(walks, call, which):
    edges = [tuple(edge) for edge in walks[call][which]]
    order = floors_in_order(edges)
    assert order[0] in ("mla_multi.ops", "mla_multi.attention"), order
    assert any(floor(module) == 3 for module in order), order  # it reached the kernels
    assert not climbs(edges), (climbs(edges), order)


def test_the_check_sees_a_climb():
    """The check itself: a backend calling back into the ops, even through a helper, is a climb; a helper has
    no floor."""
    edges = [(None, "mla_multi.ops"), ("mla_multi.ops", "mla_multi.registry"),
             ("mla_multi.registry", "mla_multi.backends.triton"), ("mla_multi.backends.triton", "mla_multi.checks"),
             ("mla_multi.backends.triton", "mla_multi.kernels.mla_decode"),
             ("mla_multi.kernels.mla_decode", "mla_multi.errors")]
    assert climbs(edges) == []
    assert floors_in_order(edges) == ["mla_multi.ops", "mla_multi.registry", "mla_multi.backends.triton",
                                      "mla_multi.kernels.mla_decode"]
    climb = ("mla_multi.kernels.mla_decode", "mla_multi.backends.triton")
    assert climbs(edges + [climb]) == [climb]

    def backend_call():  # a frame of a backend's floor (its module name) calling into the ops through a helper
        exec("import mla_multi.checks as c; c.data_checks_enabled('cpu'); import mla_multi.ops as o; o.ops_walk()",
             {"__name__": "mla_multi.backends.fake"})

    import mla_multi.ops

    mla_multi.ops.ops_walk = eval("lambda: None", vars(mla_multi.ops))  # a function of the ops module's globals
    try:
        edges = trace(backend_call)
    finally:
        del mla_multi.ops.ops_walk
    assert ("mla_multi.backends.fake", "mla_multi.ops") in climbs(edges), edges


if __name__ == "__main__":
    _interpreter_main()
