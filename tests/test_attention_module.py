"""`MLAAttention` inside a model: a torch module whose weight is its parameter (the absorbed forms views of it),
`.to()` and `load_state_dict`, inference-only autograd, the cache helper and the caller's batch order.

CPU, REFERENCE (and TRITON under the interpreter for autograd), against naive float64 MLA."""

from __future__ import annotations

import sys

import pytest
import torch
from interpreter import print_results, run_interpreter_script

import mla_multi as mm
from mla_multi.testing import PagedScenario, relative_error

SMALL = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
DIMS = mm.MLADims(4, **SMALL)
BLOCK = 16
# prefills without context, then decodes with a prefill with context and one without
STEPS = [[(0, 23), (1, 5)], [(0, 1), (1, 1), (2, 17), (3, 9)]]


def make_weight(dims=DIMS, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
    return (torch.randn(rows, dims.kv_lora_rank, generator=generator, dtype=torch.float64)
            / dims.kv_lora_rank**0.5).to(dtype)


def make_layer(weight, dims=DIMS, **kwargs):
    kwargs.setdefault("workspace_tokens", 32)
    return mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=BLOCK, max_model_len=1024,
                           max_num_seqs=8, **kwargs)


def scenario_and_cache(dtype, dims=DIMS, seed=1):
    scenario = PagedScenario(dims, BLOCK, 64, torch.device("cpu"), dtype, seed=seed)
    cache = torch.full((64, BLOCK, dims.kv_cache_width), float("nan"), dtype=dtype)
    return scenario, cache


def storages(obj, seen=None, depth=0) -> dict[int, int]:
    """{storage address: bytes} of every tensor reachable from `obj`'s attributes (containers and plain objects
    followed a few levels deep; modules through their parameters, buffers and attributes)."""
    found: dict[int, int] = {}
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return found
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
        return found
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.startswith(("mla_multi",
                                                                                                   "torch.nn")):
        items = list(vars(obj).values())
    else:
        return found
    for item in items:
        found.update(storages(item, seen, depth + 1))
    return found


# --------------------------------------------------------------------------- the module and its weight


def test_the_layer_is_a_module_whose_only_tensor_storage_is_the_weight():
    """The weight is the module's one parameter (state_dict key kv_b_proj_weight); W_UK and W_UV are views of
    it: nothing the layer holds (its attributes, the backends' impls, the cached views) has storage of its own
    beyond the weight's (the shared per-device workspace and error flag aside)."""
    weight = make_weight()
    layer = make_layer(weight)
    assert isinstance(layer, torch.nn.Module)
    assert list(layer.state_dict()) == ["kv_b_proj_weight"]
    assert [name for name, _ in layer.named_parameters()] == ["kv_b_proj_weight"]
    assert layer.kv_b_proj_weight.data_ptr() == weight.data_ptr()  # the caller's tensor, not a copy
    assert not layer.kv_b_proj_weight.requires_grad
    per_head = weight.view(4, 64, 64)
    for view, expected in ((layer.W_UK, per_head[:, :32]), (layer.W_UK_T, per_head[:, :32]), (layer.W_UV, per_head[:, 32:])):
        assert torch.equal(view, expected)
        assert view.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    scenario, cache = scenario_and_cache(torch.float64)
    for requests in STEPS:  # after forwards too: nothing cached beside the weight
        metadata, q, kv_c, k_pe = scenario.step(requests)
        layer(q, kv_c, k_pe, cache, metadata)
    shared = {layer.workspace._buffer.untyped_storage().data_ptr(), mm.ops.error_flag(layer.device).untyped_storage().data_ptr()}
    held = {ptr: size for ptr, size in storages(layer).items() if ptr not in shared}
    assert held == {weight.untyped_storage().data_ptr(): weight.untyped_storage().nbytes()}, held


def test_the_callers_parameter_is_shared_and_a_parent_to_dtype_converts_it_once():
    """Given a model's own nn.Parameter (transformers' kv_b_proj.weight), the layer registers that very object:
    the parent's .to(dtype) converts it once for both, and the layer follows."""
    parent = torch.nn.Module()
    parent.kv_b_proj = torch.nn.Linear(DIMS.kv_lora_rank, 4 * 64, bias=False, dtype=torch.float64)
    with torch.no_grad():
        parent.kv_b_proj.weight.copy_(make_weight())
    parent.mla = make_layer(parent.kv_b_proj.weight)
    assert parent.mla.kv_b_proj_weight is parent.kv_b_proj.weight
    parent.to(torch.float32)
    assert parent.mla.kv_b_proj_weight is parent.kv_b_proj.weight
    assert parent.kv_b_proj.weight.dtype == torch.float32 and parent.mla.dtype == torch.float32
    assert parent.mla.W_UK.untyped_storage().data_ptr() == parent.kv_b_proj.weight.untyped_storage().data_ptr()
    assert len({p.untyped_storage().data_ptr() for p in parent.parameters()}) == 1


def run_and_compare(layer, weight64, dtype, steps=STEPS, seed=1):
    scenario, cache = scenario_and_cache(dtype, seed=seed)
    errors = []
    for requests in steps:
        metadata, q, kv_c, k_pe = scenario.step(requests)
        out = layer(q, kv_c, k_pe, cache, metadata)
        errors.append(relative_error(out, scenario.reference(requests, q, layer.scale, weight64)))
    return max(errors)


def test_a_float64_layer_moved_to_float32_runs_float32_inputs():
    weight = make_weight()
    layer = make_layer(weight)
    assert run_and_compare(layer, weight, torch.float64) < 1e-12
    moved = layer.to(torch.float32)
    assert moved is layer
    assert layer.dtype == torch.float32 and layer.kv_cache_dtype == torch.float32
    assert layer.state_dict()["kv_b_proj_weight"].dtype == torch.float32
    assert layer.W_UK.dtype == torch.float32
    error = run_and_compare(layer, weight, torch.float32)
    assert 1e-9 < error < 1e-5, error  # float32 now: rounding shows, and stays float32's
    with pytest.raises(ValueError, match="q has dtype float64; accepted: float32"):
        scenario, cache = scenario_and_cache(torch.float64)
        metadata, q, kv_c, k_pe = scenario.step(STEPS[0])
        layer(q, kv_c, k_pe, cache.float(), metadata)


@pytest.mark.parametrize("how", ["load_state_dict", "assign", "data", "process_weights_after_loading"])
def test_a_weight_loaded_after_construction_is_the_one_used(how):
    """A checkpoint loaded after the layer was built: in place (views: at once), assigned, or swapped under the
    parameter; the next forward uses it (against float64 MLA with the new weight, and differs from the old)."""
    old, new = make_weight(seed=0), make_weight(seed=5)
    layer = make_layer(old.clone())
    before = run_and_compare(layer, old, torch.float64)
    assert before < 1e-12
    if how == "load_state_dict":
        layer.load_state_dict({"kv_b_proj_weight": new})
    elif how == "assign":
        layer.load_state_dict({"kv_b_proj_weight": new.clone()}, assign=True)
    elif how == "data":
        layer.kv_b_proj_weight.data = new.clone()
    else:
        layer.load_state_dict({"kv_b_proj_weight": new})
        layer.process_weights_after_loading()
    assert run_and_compare(layer, new, torch.float64) < 1e-12
    assert run_and_compare(layer, old, torch.float64) > 1e-2  # the old weight's result is gone


def test_process_weights_after_loading_checks_the_weight():
    layer = make_layer(make_weight())
    layer.kv_b_proj_weight.data = torch.zeros(3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="kv_b_proj_weight has shape"):
        layer.process_weights_after_loading()


def test_the_constructor_keeps_its_signature_and_call_runs_forward():
    weight = make_weight()
    layer = mm.MLAAttention(DIMS, 0.1, weight, block_size=BLOCK, max_model_len=256, max_num_seqs=4,
                            kv_cache_dtype="auto", kv_cache_scale=None, workspace_tokens=32, prefill_backend=None,
                            decode_backend=None, dcp=None, workspace=None, sparse_topk=None, sparse_backend=None)
    scenario, cache = scenario_and_cache(torch.float64)
    metadata, q, kv_c, k_pe = scenario.step(STEPS[0])
    other = cache.clone()
    torch.testing.assert_close(layer(q, kv_c, k_pe, cache, metadata), layer.forward(q, kv_c, k_pe, other, metadata),
                               rtol=0, atol=0)
    assert "num_heads=4" in repr(layer) and "REFERENCE" in repr(layer)


def test_a_compiled_model_calls_the_layer_as_its_submodule():
    """torch.compile(fullgraph=True) of a model that holds the layer as a submodule and calls it (nn.Module's
    __call__): one opaque op that finds the layer by its layer_id; equal to the eager call, cache included."""
    import torch._dynamo

    from mla_multi import library

    weight = make_weight(dtype=torch.float32)
    layer = make_layer(weight)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = layer

        def forward(self, q, kv_c, k_pe, kv_cache):
            return self.attn(q, kv_c, k_pe, kv_cache, None) * 2

    model = Model()
    assert list(model.state_dict()) == ["attn.kv_b_proj_weight"]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    scenario, cache = scenario_and_cache(torch.float32)
    try:
        with torch.inference_mode():
            for requests in STEPS:
                metadata, q, kv_c, k_pe = scenario.step(requests)
                eager_cache = cache.clone()
                layer.plan(metadata)
                out = compiled(q, kv_c, k_pe, cache)
                expected = 2 * layer(q, kv_c, k_pe, eager_cache, metadata)
                torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(cache, eager_cache, rtol=0, atol=0, equal_nan=True)
                assert relative_error(out / 2, scenario.reference(requests, q, layer.scale, weight)) < 1e-5
    finally:
        torch._dynamo.reset()
        library.set_current_metadata(torch.device("cpu"), None)


# --------------------------------------------------------------------------- autograd


def grad_inputs(q, kv_c, k_pe):
    return q.clone().requires_grad_(), kv_c.clone().requires_grad_(), k_pe.clone().requires_grad_()


@pytest.mark.parametrize("steps", [[STEPS[0]], STEPS, [STEPS[0], [(0, 1), (1, 1)]]], ids=["prefill", "mixed", "decode"])
def test_grad_mode_runs_without_autograd_and_a_backward_says_why_not(steps):
    """transformers' default (grad mode, inputs from parameters that require grad): the forward runs (it used to
    fail inside the up-projections with PyTorch's `bmm(): functions with out=...` error after the cache had joined
    the graph), the cache never requires grad, the output is right, and a backward raises naming inference_mode."""
    weight = make_weight()
    layer = make_layer(weight)
    scenario, cache = scenario_and_cache(torch.float64)
    assert torch.is_grad_enabled()
    for requests in steps:
        metadata, *inputs = scenario.step(requests)
        q, kv_c, k_pe = grad_inputs(*inputs)
        out = layer(q, kv_c, k_pe, cache, metadata)
        assert not cache.requires_grad and cache.grad_fn is None
        assert relative_error(out, scenario.reference(requests, q.detach(), layer.scale, weight)) < 1e-12
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=r"inference-only.*torch\.inference_mode\(\)"):
        out.sum().backward()
    out.mul_(2)  # in-place ops on the output still work (a model may scale it in place)
    # inputs that do not require grad: a plain tensor, nothing to raise
    metadata, q, kv_c, k_pe = scenario.step([(0, 1)])
    assert not layer(q, kv_c, k_pe, cache, metadata).requires_grad
    # a weight that requires grad (a model's trainable kv_b_proj.weight): the backward raises too
    layer.kv_b_proj_weight.requires_grad_(True)
    metadata, q, kv_c, k_pe = scenario.step([(1, 1)])
    out = layer(q, kv_c, k_pe, cache, metadata)
    assert not cache.requires_grad and cache.grad_fn is None
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()


def _interpreter_main() -> None:
    """Under TRITON_INTERPRET=1: a TRITON layer in grad mode, and q as transformers leaves it."""
    results = {}
    generator = torch.Generator().manual_seed(0)
    dims = mm.MLADims.deepseek_v3(num_heads=2)
    weight = (torch.randn(2 * 256, 512, generator=generator) / 512**0.5).half()
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=16, max_model_len=256, max_num_seqs=4,
                            workspace_tokens=32, prefill_backend="TRITON", decode_backend="TRITON")
    scenario = PagedScenario(dims, 16, 32, torch.device("cpu"), torch.float16, seed=0)
    cache = torch.full((32, 16, 576), float("nan"), dtype=torch.float16)
    worst = 0.0
    for requests in ([(0, 20), (1, 9)], [(0, 1), (1, 1), (2, 40)]):
        metadata, q, kv_c, k_pe = scenario.step(requests)
        q, kv_c, k_pe = grad_inputs(q, kv_c, k_pe)
        out = layer(q, kv_c, k_pe, cache, metadata)
        worst = max(worst, relative_error(out, scenario.reference(requests, q.detach(), layer.scale, weight)))
        results.setdefault("cache_requires_grad", []).append(bool(cache.requires_grad or cache.grad_fn is not None))
    try:
        out.sum().backward()
        results["backward"] = "no error"
    except RuntimeError as error:
        results["backward"] = str(error)
    results["backends"] = layer.backends()
    results["err"] = worst
    print_results(results)


@pytest.mark.interpreter
def test_grad_mode_on_the_triton_backend_under_the_interpreter():
    result = run_interpreter_script(__file__, "--interpreter")
    assert result["backends"] == {"prefill": "TRITON", "decode": "TRITON"}, result
    assert result["err"] <= 3e-3, result
    assert result["cache_requires_grad"] == [False, False], result
    assert "inference-only" in result["backward"] and "torch.inference_mode()" in result["backward"], result


# --------------------------------------------------------------------------- the cache helper


@pytest.mark.parametrize("fmt,dtype,expected_dtype,width", [
    ("auto", torch.bfloat16, torch.bfloat16, 576),
    ("auto", torch.float32, torch.float32, 576),
    ("fp8", torch.bfloat16, None, 576),  # the platform's FP8
    ("fp8_e4m3", torch.bfloat16, None, 576),
    (torch.float8_e4m3fnuz, torch.bfloat16, torch.float8_e4m3fnuz, 576),
    ("fp8_ds_mla", torch.bfloat16, torch.uint8, 656),
])
def test_allocate_kv_cache_formats(fmt, dtype, expected_dtype, width):
    dims = mm.MLADims.deepseek_v3(num_heads=16)
    cache = mm.allocate_kv_cache(dims, 10, 64, fmt, dtype=dtype, device="cpu")
    platform_fp8 = mm.current_platform().fp8_dtype or torch.float8_e4m3fn
    assert cache.shape == (10, 64, width)
    assert cache.dtype == (platform_fp8 if expected_dtype is None else expected_dtype)
    assert cache.device.type == "cpu" and not cache.any()


def test_allocate_kv_cache_other_dims_and_bad_arguments():
    cache = mm.allocate_kv_cache(DIMS, 3, 16, dtype=torch.float64, device="cpu")
    assert cache.shape == (3, 16, 80) and cache.dtype == torch.float64
    with pytest.raises(ValueError, match="fp8_ds_mla.*64 / 16"):
        mm.allocate_kv_cache(DIMS, 3, 16, "fp8_ds_mla")
    with pytest.raises(ValueError, match="num_blocks=0"):
        mm.allocate_kv_cache(DIMS, 0, 16)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp9'"):
        mm.allocate_kv_cache(DIMS, 3, 16, "fp9")


@pytest.mark.parametrize("fmt,expected", [("auto", torch.float32), ("fp8", None)])
def test_the_layers_cache_is_the_one_its_forward_accepts(fmt, expected):
    weight = make_weight(dtype=torch.float32)
    layer = make_layer(weight, kv_cache_dtype=fmt, kv_cache_scale=0.05 if fmt == "fp8" else None)
    cache = layer.allocate_kv_cache(64)
    assert cache.shape == (64, BLOCK, DIMS.kv_cache_width)
    assert cache.dtype == (layer.kv_cache_dtype if expected is None else expected)
    scenario, _ = scenario_and_cache(torch.float32)
    metadata, q, kv_c, k_pe = scenario.step(STEPS[0])
    out = layer(q, kv_c, k_pe, cache, metadata)
    assert relative_error(out, scenario.reference(STEPS[0], q, layer.scale, weight)) < (6e-2 if fmt == "fp8" else 1e-5)


def test_the_sparse_layers_cache_is_fp8_ds_mla():
    dims = mm.MLADims.deepseek_v3(num_heads=2)
    layer = mm.MLAAttention(dims, 0.1, make_weight(dims, torch.bfloat16), block_size=64, max_model_len=256,
                            max_num_seqs=2, kv_cache_dtype="fp8_ds_mla", sparse_topk=8)
    cache = layer.allocate_kv_cache(4)
    assert cache.shape == (4, 64, 656) and cache.dtype == torch.uint8


# --------------------------------------------------------------------------- the caller's batch order


def test_a_batch_in_any_order_returns_the_outputs_in_the_callers_order():
    """Prefills before decodes, as a caller keeps them: metadata built with reorder=True; the layer takes the
    caller's tokens and returns its rows in that order, equal (bit for bit) to the decodes-first batch."""
    weight = make_weight()
    layer = make_layer(weight)
    scenario, cache = scenario_and_cache(torch.float64)
    metadata, q, kv_c, k_pe = scenario.step([(0, 23), (1, 5), (2, 6)])  # histories
    layer(q, kv_c, k_pe, cache, metadata)
    ordered = [(0, 1), (2, 1), (1, 9), (3, 12)]  # decodes first, as the scenario builds it
    metadata, q, kv_c, k_pe = scenario.step(ordered)
    expected = layer(q, kv_c, k_pe, cache.clone(), metadata)
    assert relative_error(expected, scenario.reference(ordered, q, layer.scale, weight)) < 1e-12
    # the caller's order: request 1 (prefill), 0 (decode), 3 (prefill), 2 (decode)
    caller = [2, 0, 3, 1]  # caller's request j is the ordered batch's request caller[j]
    query_lens = [1, 1, 9, 12]
    starts = [0, 1, 2, 11, 23]
    tokens = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in caller])
    table = metadata.block_table[caller]
    seq_lens = metadata.seq_lens_cpu[caller]
    reordered = mm.CommonAttentionMetadata.from_lengths([query_lens[r] for r in caller], seq_lens, table, BLOCK,
                                                        reorder=True)
    order = reordered.batch_order
    assert isinstance(order, mm.BatchOrder) and not order.identity
    assert order.requests == (1, 3, 0, 2)  # the step runs the caller's decodes (1, 3) first
    assert torch.equal(order.to_caller(order.to_step(q[tokens])), q[tokens])
    out = layer(q[tokens], kv_c[tokens], k_pe[tokens], cache.clone(), reordered)
    torch.testing.assert_close(out, expected[tokens], rtol=0, atol=0)
    given = torch.full_like(out, float("nan"))
    assert layer(q[tokens], kv_c[tokens], k_pe[tokens], cache.clone(), reordered, output=given) is given
    torch.testing.assert_close(given, expected[tokens], rtol=0, atol=0)
    # the cache holds each token at its own request's slots, whatever the order
    cache_a, cache_b = cache.clone(), cache.clone()
    layer(q, kv_c, k_pe, cache_a, metadata)
    layer(q[tokens], kv_c[tokens], k_pe[tokens], cache_b, reordered)
    torch.testing.assert_close(cache_a, cache_b, rtol=0, atol=0, equal_nan=True)


def test_reorder_of_an_ordered_batch_moves_nothing_and_errors_name_the_callers_request():
    table = torch.arange(8, dtype=torch.int32).view(4, 2)
    metadata = mm.CommonAttentionMetadata.from_lengths([1, 1, 5, 3], [9, 4, 5, 3], table, 16, reorder=True)
    order = metadata.batch_order
    assert order.identity and order.requests == (0, 1, 2, 3)
    x = torch.randn(10, 3)
    assert order.to_step(x) is x and order.to_caller(x) is x
    with pytest.raises(ValueError, match="request 2: query_len 5 > seq_len 4"):
        mm.CommonAttentionMetadata.from_lengths([4, 1, 5, 1], [9, 4, 4, 3], table, 16, reorder=True)
    with pytest.raises(ValueError, match="decodes .* must come before prefills"):
        mm.CommonAttentionMetadata.from_lengths([4, 1], [9, 4], table[:2], 16)


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _interpreter_main()
