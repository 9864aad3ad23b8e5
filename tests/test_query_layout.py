"""The query as transformers leaves it: a [T, N, P + R] view of a [1, N, T, P + R] tensor (each token's heads T rows
apart). The sm_90 prefill kernel reads its tensors through 2-D TMA descriptors ([rows, columns]), which cannot
read that layout: such a q is copied once (the layer: once for every prefill call of the step; the functional
op: once a call) rather than sending the prefill to the slower Triton kernel."""

from __future__ import annotations

import pytest
import torch

import mla_multi as mm
from mla_multi.kernels import prefill_wgmma, rows_of_heads
from mla_multi.platforms import SPECS
from mla_multi.testing import PagedScenario, relative_error


def transformers_layout(q: torch.Tensor) -> torch.Tensor:
    """q [T, N, D] laid out as transformers' DeepseekV3Attention leaves query_states ([1, N, T, D], contiguous),
    viewed back as [T, N, D]."""
    return q.transpose(0, 1).contiguous().unsqueeze(0)[0].transpose(0, 1)


def test_rows_of_heads_tells_the_transformers_layout():
    q = torch.randn(300, 16, 192)
    view = transformers_layout(q)
    assert torch.equal(view, q) and view.stride() == (192, 300 * 192, 1)
    assert rows_of_heads(q) and not rows_of_heads(view)
    assert rows_of_heads(q[:, :, :128])  # a column slice keeps each row's heads together


def _sm90_inputs(tokens=256, heads=16, device="cpu"):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, 192, generator=generator).to(device, torch.bfloat16)
    k = torch.randn(tokens, heads, 128, generator=generator).to(device, torch.bfloat16)
    v = torch.randn(tokens, heads, 128, generator=generator).to(device, torch.bfloat16)
    k_pe = torch.randn(tokens, 64, generator=generator).to(device, torch.bfloat16)
    return q, k, v, k_pe


def test_the_sm90_kernel_takes_a_copy_of_the_transformers_query():
    """The decision of `prefill.varlen_attention`'s default launch on an impersonated H100 (CPU tensors stand in;
    the device is the caller's check): the view is refused for its layout alone, and its contiguous copy is
    what the kernel gets; a query it takes as it is comes back itself, and other reasons are not copied away."""
    available, why = prefill_wgmma.gluon_available()
    if not available:
        pytest.skip(f"Gluon: {why}")
    h100 = SPECS["H100"]
    q, k, v, k_pe = _sm90_inputs()
    view = transformers_layout(q)
    reason = prefill_wgmma.takes_reason(view, k, v, k_pe, h100)
    assert reason.startswith("q: ") and "side by side" in reason, reason
    assert prefill_wgmma.takes_reason(view, k, v, k_pe, h100, query_layout=False) == ""
    chosen = prefill_wgmma.query_for_kernel(view, k, v, k_pe, h100)
    assert chosen is not None and chosen is not view and torch.equal(chosen, view)
    assert prefill_wgmma.layout_reason(chosen) == "" and prefill_wgmma.takes_reason(chosen, k, v, k_pe, h100) == ""
    assert prefill_wgmma.query_for_kernel(q, k, v, k_pe, h100) is q  # taken as it is: no copy
    # a key laid out the same way is not the query's layout: no copy of q helps, the kernel is not taken
    assert prefill_wgmma.query_for_kernel(q, transformers_layout(k), v, k_pe, h100) is None
    assert prefill_wgmma.query_for_kernel(view[:100], k, v, k_pe, h100) is None  # less than a tile
    assert prefill_wgmma.query_for_kernel(view.float(), k, v, k_pe, h100) is None  # float32: not its dtype
    assert not prefill_wgmma.takes(q, k, v, k_pe, h100)  # CPU tensors are never launched


SMALL = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)


def test_the_layer_copies_a_transformers_query_once_for_every_prefill_call(monkeypatch):
    """A step with a prefill whose context takes several chunks: the new tokens' call and each chunk's get one
    and the same query, laid out with each token's heads side by side; a query already so laid out is not
    copied. Against naive float64 MLA."""
    dims = mm.MLADims(4, **SMALL)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4 * 64, 64, generator=generator, dtype=torch.float64) / 8
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=16, max_model_len=1024, max_num_seqs=8,
                            workspace_tokens=32)
    scenario = PagedScenario(dims, 16, 64, torch.device("cpu"), torch.float64, seed=2)
    cache = torch.full((64, 16, dims.kv_cache_width), float("nan"), dtype=torch.float64)
    metadata, q, kv_c, k_pe = scenario.step([(0, 70), (1, 5)])
    layer(transformers_layout(q), kv_c, k_pe, cache, metadata)
    seen = []
    impl = layer.prefill_impl
    new_tokens, chunk = impl.run_prefill_new_tokens, impl.run_prefill_context_chunk

    def record_new(prefill_metadata, q, *args, **kwargs):
        seen.append(q)
        return new_tokens(prefill_metadata, q, *args, **kwargs)

    def record_chunk(prefill_metadata, chunk_idx, q, *args, **kwargs):
        seen.append(q)
        return chunk(prefill_metadata, chunk_idx, q, *args, **kwargs)

    monkeypatch.setattr(impl, "run_prefill_new_tokens", record_new)
    monkeypatch.setattr(impl, "run_prefill_context_chunk", record_chunk)
    requests = [(1, 1), (0, 9)]  # a decode, and 9 new tokens after 70 cached (3 chunks of 32)
    metadata, q, kv_c, k_pe = scenario.step(requests)
    view = transformers_layout(q)
    out = layer(view, kv_c, k_pe, cache.clone(), metadata)
    assert relative_error(out, scenario.reference(requests, q, layer.scale, weight)) < 1e-12
    assert len(seen) >= 4 and all(s is seen[0] for s in seen), len(seen)
    assert rows_of_heads(seen[0]) and not rows_of_heads(view[1:])
    seen.clear()
    layer(q, kv_c, k_pe, cache.clone(), metadata)
    assert seen[0].data_ptr() == q[1:].data_ptr()  # laid out as the kernels read it: taken as it is


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (H100 / H200)")
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_transformers_query_runs_the_sm90_prefill_kernel(monkeypatch, heads):
    """On sm_90, the layer with TRITON prefill and the functional op, each given q as transformers leaves it: every
    prefill launch (new tokens and context chunks) is the sm_90 kernel's, with a query it reads in place;
    results against float64 MLA within bf16's rounding."""
    launches = []
    real = prefill_wgmma.launch

    def counting(q, *args, **kwargs):
        launches.append(rows_of_heads(q))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(prefill_wgmma, "launch", counting)
    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(heads * 256, 512, generator=generator, dtype=torch.float64) / 512**0.5).to(
        torch.bfloat16).cuda()
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=64, max_model_len=8192, max_num_seqs=8,
                            workspace_tokens=1024, prefill_backend="TRITON")
    scenario = PagedScenario(dims, 64, 256, torch.device("cuda"), torch.bfloat16, seed=heads)
    cache = layer.allocate_kv_cache(256)
    worst = 0.0
    for requests in ([(0, 700), (1, 300)], [(0, 1), (2, 256), (1, 400)]):  # without context, then with it
        metadata, q, kv_c, k_pe = scenario.step(requests)
        view = transformers_layout(q)
        assert not rows_of_heads(view)
        before = len(launches)
        out = layer(view, kv_c, k_pe, cache, metadata)
        torch.cuda.synchronize()
        assert len(launches) > before, (requests, layer.backends())
        worst = max(worst, relative_error(out, scenario.reference(requests, q, layer.scale, weight)))
    assert all(launches), launches
    assert worst < 1e-2, worst
    # the functional op, forced TRITON: the kernel takes the copy
    q, k, v, k_pe = _sm90_inputs(512, heads, "cuda")
    cu = torch.tensor([0, 512], dtype=torch.int32, device="cuda")
    before = len(launches)
    out = mm.ops.mla_prefill(transformers_layout(q), torch.cat([k, k_pe.unsqueeze(1).expand(-1, heads, -1)], -1), v,
                             cu, cu, 512, 512, 0.07, backend="TRITON")
    assert len(launches) == before + 1 and launches[-1]
    reference = mm.ops.mla_prefill(q, torch.cat([k, k_pe.unsqueeze(1).expand(-1, heads, -1)], -1), v, cu, cu, 512,
                                   512, 0.07, backend="TRITON")
    torch.testing.assert_close(out, reference, rtol=0, atol=0)



def _decode_step_case(seed: int = 3):
    """A layer, its cache holding three prompts, and the next step's three decodes (metadata, q, kv_c, k_pe, the
    float64 reference output)."""
    dims = mm.MLADims(4, **SMALL)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(4 * 64, 64, generator=generator, dtype=torch.float64) / 8
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=16, max_model_len=256, max_num_seqs=8)
    scenario = PagedScenario(dims, 16, 64, torch.device("cpu"), torch.float64, seed=seed + 1)
    cache = torch.full((64, 16, dims.kv_cache_width), float("nan"), dtype=torch.float64)
    metadata, q, kv_c, k_pe = scenario.step([(0, 40), (1, 17), (2, 3)])
    layer(q, kv_c, k_pe, cache, metadata)
    requests = [(0, 1), (1, 1), (2, 1)]
    metadata, q, kv_c, k_pe = scenario.step(requests)
    return layer, cache, metadata, q, kv_c, k_pe, scenario.reference(requests, q, layer.scale, weight)


@pytest.mark.parametrize("layout", ["contiguous", "transformers", "offset"])
@pytest.mark.parametrize("out_layout", ["fresh", "wider rows", "offset rows"])
def test_the_layers_decode_reads_any_query_layout_and_writes_any_output_rows(layout, out_layout):
    """Decodes of three requests: the layer takes the query's nope and rotary parts, and writes the up-projected
    rows, as strided views of the tensors given (no copy), whatever their row strides and offsets. Against naive
    float64 MLA; what lies around the output's rows in its buffer stays as it was."""
    layer, cache, metadata, q, kv_c, k_pe, expected = _decode_step_case()
    if layout == "transformers":
        q_in = transformers_layout(q)
    elif layout == "offset":  # a view that starts inside its storage
        q_in = torch.cat([torch.randn(2, *q.shape[1:], dtype=q.dtype), q])[2:]
    else:
        q_in = q
    assert torch.equal(q_in, q)
    rows = layer.dims.num_heads * layer.dims.v_head_dim
    buffer = output = None
    if out_layout == "wider rows":  # rows of a wider buffer, columns 4 .. 4 + rows
        buffer = torch.full((3, rows + 8), -7.0, dtype=torch.float64)
        output = buffer[:, 4:4 + rows]
    elif out_layout == "offset rows":  # rows 1 .. 3 of a buffer of 5
        buffer = torch.full((5, rows), -7.0, dtype=torch.float64)
        output = buffer[1:4]
    out = layer(q_in, kv_c, k_pe, cache, metadata, output=output)
    assert relative_error(out, expected) < 1e-12
    if output is not None:
        assert out.data_ptr() == output.data_ptr()
        around = torch.ones_like(buffer, dtype=torch.bool)
        if out_layout == "wider rows":
            around[:, 4:4 + rows] = False
        else:
            around[1:4] = False
        assert bool((buffer[around] == -7.0).all())


def test_the_layer_names_a_query_or_output_whose_columns_are_strided():
    layer, cache, metadata, q, kv_c, k_pe, _ = _decode_step_case()
    wide = torch.zeros(*q.shape[:-1], 2 * q.shape[-1], dtype=q.dtype)
    wide[..., ::2] = q
    with pytest.raises(ValueError, match="q has last-dimension stride 2; accepted: a contiguous last dimension"):
        layer(wide[..., ::2], kv_c, k_pe, cache, metadata)
    rows = layer.dims.num_heads * layer.dims.v_head_dim
    output = torch.zeros(3, 2 * rows, dtype=q.dtype)[:, ::2]
    with pytest.raises(ValueError, match="output has last-dimension stride 2; accepted: a contiguous last dimension"):
        layer(q, kv_c, k_pe, cache, metadata, output=output)
