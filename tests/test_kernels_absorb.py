"""The absorbed products of a decode step (`mla_multi.kernels.absorb`) against float64 and the cache op.

* CPU: the Triton interpreter (this file run as a script, under `interpreter.memcheck`: no lane reads or
  writes outside its tensors) with float16 weights, small dims, a bf16 and an FP8 cache, slots that skip
  (-1) and that lie past the cache (the error flag);
* GPU (marked ``gpu``): DeepSeek-V3 dims in bfloat16, both caches, 1 to 16 tokens, against float64 and
  against the cache op's own rows.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import memcheck, print_results, run_interpreter_script

# (id, heads, nope, kv_lora_rank, rope, v_dim, tokens, cache dtype name)
CASES = [
    ("one-token-bf16-cache", 3, 16, 128, 16, 32, 1, "float16"),
    ("three-tokens-fp8-cache", 3, 16, 128, 16, 32, 3, "float8_e4m3fn"),
    ("sixteen-tokens-e4m3fnuz-cache", 2, 32, 256, 16, 64, 16, "float8_e4m3fnuz"),
    ("sixty-four-heads", 64, 16, 128, 16, 128, 5, "float16"),
]


def run_case(heads, nope, lkv, rope, v_dim, tokens, cache_dtype, device="cpu", dtype=torch.float16, block_size=4):
    from mla_multi.kernels.absorb import DecodeProducts
    from mla_multi.kernels.cache_ops import concat_and_cache_mla

    gen = torch.Generator().manual_seed(heads * 100 + tokens)
    weight = (torch.randn(heads * (nope + v_dim), lkv, generator=gen, dtype=torch.float64) / lkv**0.5)
    weight = weight.to(device, dtype)
    per_head = weight.view(heads, nope + v_dim, lkv)
    w_uk, w_uv = per_head[:, :nope, :], per_head[:, nope:, :].transpose(1, 2)
    # q as a layer gets it: [T, N, P + R] rows of heads, the nope part read in place
    q = torch.randn(tokens, heads, nope + rope, generator=gen).to(device, dtype)
    kv_c = torch.randn(tokens, lkv, generator=gen).to(device, dtype)
    k_pe = torch.randn(tokens, rope, generator=gen).to(device, dtype)
    num_blocks = tokens + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    if tokens >= 3:
        slots[1] = -1  # padding: nothing written
        slots[2] = num_blocks * block_size + 5  # past the cache: nothing written, the flag set
    slots = slots.to(device)
    scale = torch.tensor([0.02], device=device) if cache_dtype.is_floating_point and cache_dtype.itemsize == 1 else None
    poison = torch.randn(num_blocks, block_size, lkv + rope, generator=gen).to(device)
    fp8 = scale is not None
    cache = (poison / 0.02).clamp(-200, 200).to(cache_dtype) if fp8 else poison.to(cache_dtype)
    expected_cache = cache.clone()
    op_flag = torch.zeros(1, dtype=torch.int32, device=device)  # the cache kernel's own writer, without data checks
    concat_and_cache_mla(kv_c, k_pe, expected_cache, slots, scale, error_flag=op_flag)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    products = DecodeProducts(w_uk, w_uv)
    ql = products.prologue(q, kv_c, k_pe, cache, slots, scale, flag, {})
    ref_ql = torch.einsum("tnp,npl->tnl", q[..., :nope].double(), w_uk.double())
    latent = torch.randn(tokens, heads, lkv, generator=gen).to(device, dtype)
    out = torch.full((tokens + 2, heads * v_dim), float("nan"), dtype=dtype, device=device)
    products.up_project(latent, out)
    ref_up = torch.einsum("tnl,nlv->tnv", latent.double(), w_uv.double()).reshape(tokens, heads * v_dim)
    bits = lambda t: t.view(torch.uint8) if fp8 else t  # noqa: E731 - FP8 compared by bytes
    return {
        "ql_shape": list(ql.shape),
        "ql_err": float((ql.double() - ref_ql).norm() / ref_ql.norm()),
        "up_err": float((out[:tokens].double() - ref_up).norm() / ref_up.norm()),
        "rows_past_untouched": bool(torch.isnan(out[tokens:]).all()),
        "cache_as_the_op": bool(torch.equal(bits(cache), bits(expected_cache))),
        "flag": int(flag.item()),
        "op_flag": int(op_flag.item()),
        "expect_flag": tokens >= 3,
    }


def _interpreter_main() -> None:
    results = {}
    with memcheck() as violations:
        for case_id, *args, dtype_name in CASES:
            results[case_id] = run_case(*args, getattr(torch, dtype_name))
    results["violations"] = violations
    print_results(results)


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_script(__file__)


def _check(result, tol=3e-3):
    assert result["ql_err"] <= tol and result["up_err"] <= tol, result
    assert result["rows_past_untouched"] and result["cache_as_the_op"], result
    from mla_multi import errors

    assert result["flag"] == result["op_flag"] == (errors.SLOT if result["expect_flag"] else 0), result


@pytest.mark.parametrize("case_id", [case[0] for case in CASES])
def test_products_interpreter(interpreter_results, case_id):
    _check(interpreter_results[case_id])


def test_products_stay_inside_their_tensors(interpreter_results):
    assert interpreter_results["violations"] == []


def test_products_reason():
    from mla_multi.kernels.absorb import products_reason

    assert products_reason(torch.bfloat16, 128, 512, 128) == ""
    assert "float32 weights" in products_reason(torch.float32, 128, 512, 128)
    assert "v_head_dim=96" in products_reason(torch.float16, 128, 512, 96)
    assert "kv_lora_rank=64; these kernels take multiples of 128" in products_reason(torch.float16, 128, 64, 128)


def test_the_layer_bound_matches_the_kernels():
    from mla_multi.attention import MAX_PRODUCT_TOKENS
    from mla_multi.kernels.absorb import MAX_TOKENS

    assert MAX_PRODUCT_TOKENS == MAX_TOKENS


def test_absorbed_queries_are_views_of_one_buffer_a_store():
    from mla_multi.kernels import absorb
    from mla_multi.workspace import WorkspaceManager

    device = torch.device("cpu")
    store = WorkspaceManager(device).side
    ql, tokens_first = absorb.absorbed_queries(3, 5, 128, torch.float16, device, store)
    assert ql.shape == (3, 5, 128) and ql.is_contiguous() and tokens_first.shape == (5, 3, 128)
    assert tokens_first.stride() == (128, 5 * 128, 1) and tokens_first.data_ptr() == ql.data_ptr()
    again = absorb.absorbed_queries(3, 5, 128, torch.float16, device, store)
    assert again[0] is ql and again[1] is tokens_first  # given again: no view made a call
    wider, _ = absorb.absorbed_queries(3, absorb.MAX_TOKENS, 128, torch.float16, device, store)
    assert wider.data_ptr() == ql.data_ptr() and wider.numel() == 3 * absorb.MAX_TOKENS * 128
    other, _ = absorb.absorbed_queries(3, 5, 128, torch.bfloat16, device, store)
    assert other.dtype == torch.bfloat16 and other.data_ptr() != ql.data_ptr()
    # layers of another workspace (run on another stream, say) get a buffer of their own
    apart, _ = absorb.absorbed_queries(3, 5, 128, torch.float16, device, WorkspaceManager(device).side)
    assert apart.data_ptr() != ql.data_ptr()


def test_the_layers_of_one_workspace_share_the_absorbed_queries():
    """Two layers built on one device share its workspace's side buffers; one given a workspace of its own does
    not (what the prologue keeps follows the workspace's sharing)."""
    import mla_multi as mm
    from mla_multi.workspace import WorkspaceManager

    dims = mm.MLADims.deepseek_v3(num_heads=2)
    weight = torch.randn(2 * 256, 512, dtype=torch.float16)
    make = lambda **kw: mm.MLAAttention(dims, 0.1, weight, block_size=16, max_model_len=64,  # noqa: E731
                                        max_num_seqs=2, **kw)
    first, second, apart = make(), make(), make(workspace=WorkspaceManager("cpu"))
    assert first.workspace.side is second.workspace.side and apart.workspace.side is not first.workspace.side


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_absorbed_queries_made_in_a_capture_are_the_captures_own():
    from mla_multi.kernels import absorb

    device = torch.device("cuda", torch.cuda.current_device())
    store = {}
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        ql, _ = absorb.absorbed_queries(7, 2, 128, torch.float16, device, store)
    assert not store  # the graph's memory, kept by nothing
    eager, _ = absorb.absorbed_queries(7, 2, 128, torch.float16, device, store)
    assert len(store) == 1 and eager.data_ptr() != ql.data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 2, 7, 16])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("heads", [16, 128])
def test_products_gpu(heads, cache, tokens):
    from mla_multi.platforms import current_platform

    fp8 = current_platform().fp8_dtype or torch.float8_e4m3fn
    result = run_case(heads, 128, 512, 64, 128, tokens, torch.bfloat16 if cache == "bf16" else fp8, device="cuda",
                      dtype=torch.bfloat16, block_size=64)
    _check(result, tol=1e-2)


if __name__ == "__main__":
    _interpreter_main()
