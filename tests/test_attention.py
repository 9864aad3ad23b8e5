"""MLAAttention end to end against naive float64 MLA (no absorption, full attention)."""

import pytest
import torch

import mla_multi as mm
from mla_multi.testing import PagedScenario, relative_error

SMALL = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)


def make_layer(dims, dtype, block_size, *, workspace_tokens=None, kv_cache_dtype="auto", kv_cache_scale=None, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(
        dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, generator=generator, dtype=torch.float64
    ) / dims.kv_lora_rank**0.5
    weight = weight.to(dtype).to(device)
    scale = dims.qk_head_dim**-0.5
    layer = mm.MLAAttention(
        dims, scale, weight, block_size=block_size, max_model_len=4096, max_num_seqs=16,
        kv_cache_dtype=kv_cache_dtype, kv_cache_scale=kv_cache_scale, workspace_tokens=workspace_tokens,
    )
    return layer, weight, scale


def run_steps(layer, weight, scale, scenario, steps, cache):
    errors = []
    for requests in steps:
        metadata, q, kv_c, k_pe = scenario.step(requests)
        out = torch.full((q.shape[0], layer.dims.num_heads * layer.dims.v_head_dim), float("nan"), dtype=q.dtype, device=q.device)
        layer.forward(q, kv_c, k_pe, cache, metadata, output=out)
        errors.append(relative_error(out, scenario.reference(requests, q, scale, weight)))
    return errors


# Steps: prefills without context, then decodes + prefills with and without context.
MIXED_STEPS = [
    [(0, 23), (1, 5), (2, 40)],
    [(0, 1), (1, 1), (3, 9), (2, 17)],
    [(3, 1), (0, 1), (4, 33), (1, 12)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)],
]


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["float64", "float32"])
def test_mixed_batches_match_naive_mla(block_size, dtype, tol):
    dims = mm.MLADims(4, **SMALL)
    layer, weight, scale = make_layer(dims, dtype, block_size, workspace_tokens=max(64, block_size * 5))
    num_blocks = 4096 // block_size
    scenario = PagedScenario(dims, block_size, num_blocks, torch.device("cpu"), dtype, seed=block_size)
    cache = torch.full((num_blocks, block_size, dims.kv_cache_width), float("nan"), dtype=dtype)
    errors = run_steps(layer, weight, scale, scenario, MIXED_STEPS, cache)
    assert max(errors) < tol, errors


@pytest.mark.parametrize("num_heads", [1, 8, 16, 32, 128])
def test_head_counts(num_heads):
    dims = mm.MLADims(num_heads, **SMALL)
    layer, weight, scale = make_layer(dims, torch.float32, 16, workspace_tokens=64)
    scenario = PagedScenario(dims, 16, 64, torch.device("cpu"), torch.float32, seed=num_heads)
    cache = torch.full((64, 16, dims.kv_cache_width), float("nan"), dtype=torch.float32)
    errors = run_steps(layer, weight, scale, scenario, [[(0, 20), (1, 3)], [(0, 1), (1, 6)], [(1, 1), (0, 1)]], cache)
    assert max(errors) < 1e-5, errors


def test_deepseek_v3_dims_decode_and_prefill():
    dims = mm.MLADims.deepseek_v3(num_heads=8)
    layer, weight, scale = make_layer(dims, torch.float32, 64, workspace_tokens=128)
    scenario = PagedScenario(dims, 64, 32, torch.device("cpu"), torch.float32, seed=3)
    cache = torch.full((32, 64, 576), float("nan"), dtype=torch.float32)
    errors = run_steps(layer, weight, scale, scenario, [[(0, 150), (1, 20)], [(1, 1), (0, 1), (2, 70)]], cache)
    assert max(errors) < 1e-5, errors


def test_context_longer_than_workspace_uses_at_least_three_chunks(monkeypatch):
    dims = mm.MLADims(4, **SMALL)
    layer, weight, scale = make_layer(dims, torch.float64, 16, workspace_tokens=32)
    scenario = PagedScenario(dims, 16, 256, torch.device("cpu"), torch.float64, seed=7)
    cache = torch.full((256, 16, dims.kv_cache_width), float("nan"), dtype=torch.float64)
    run_steps(layer, weight, scale, scenario, [[(0, 100), (1, 70)]], cache)

    chunk_calls = []
    original = layer.prefill_impl.run_prefill_context_chunk

    def counting(metadata, chunk_idx, q, k, v):
        # The gathered chunk never exceeds the workspace.
        assert k.shape[0] <= layer.workspace_tokens
        chunk_calls.append(chunk_idx)
        return original(metadata, chunk_idx, q, k, v)

    monkeypatch.setattr(layer.prefill_impl, "run_prefill_context_chunk", counting)
    errors = run_steps(layer, weight, scale, scenario, [[(0, 9), (1, 30)]], cache)
    assert len(chunk_calls) >= 3, chunk_calls
    assert max(errors) < 1e-12, errors


def test_padding_rows_with_seq_len_zero():
    """Decode rows with no token and an empty sequence are skipped, the rest is exact."""
    dims = mm.MLADims(4, **SMALL)
    layer, weight, scale = make_layer(dims, torch.float64, 16, workspace_tokens=64)
    scenario = PagedScenario(dims, 16, 64, torch.device("cpu"), torch.float64, seed=11)
    cache = torch.full((64, 16, dims.kv_cache_width), float("nan"), dtype=torch.float64)
    run_steps(layer, weight, scale, scenario, [[(0, 10), (1, 12)]], cache)
    metadata, q, kv_c, k_pe = scenario.step([(0, 1), (5, 0), (1, 1)])
    assert metadata.seq_lens_cpu.tolist() == [11, 0, 13]
    out = layer.forward(q, kv_c, k_pe, cache, metadata)
    reference = scenario.reference([(0, 1), (5, 0), (1, 1)], q, scale, weight)
    assert relative_error(out, reference) < 1e-12


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])
def test_fp8_kv_cache(fp8_dtype):
    dims = mm.MLADims(8, **SMALL)
    layer, weight, scale = make_layer(
        dims, torch.float32, 16, workspace_tokens=48, kv_cache_dtype=fp8_dtype, kv_cache_scale=0.02
    )
    assert layer.k_scale is not None and layer.kv_cache_dtype == fp8_dtype
    scenario = PagedScenario(dims, 16, 128, torch.device("cpu"), torch.float32, seed=5)
    cache = torch.zeros((128, 16, dims.kv_cache_width), dtype=fp8_dtype)
    errors = run_steps(layer, weight, scale, scenario, MIXED_STEPS[:3], cache)
    assert max(errors) < 6e-2, errors
    # The cache really is quantised: a float cache would give a much smaller error.
    assert max(errors) > 1e-5


def test_fp8_needs_scale():
    dims = mm.MLADims(2, **SMALL)
    with pytest.raises(ValueError, match="kv_cache_scale"):
        make_layer(dims, torch.float32, 16, kv_cache_dtype=torch.float8_e4m3fn)


def test_bad_inputs_name_the_argument():
    dims = mm.MLADims(2, **SMALL)
    layer, weight, scale = make_layer(dims, torch.float32, 16, workspace_tokens=64)
    scenario = PagedScenario(dims, 16, 16, torch.device("cpu"), torch.float32)
    metadata, q, kv_c, k_pe = scenario.step([(0, 3)])
    cache = torch.zeros((16, 16, dims.kv_cache_width))
    with pytest.raises(ValueError, match="q has shape"):
        layer.forward(q[:, :1], kv_c, k_pe, cache, metadata)
    with pytest.raises(ValueError, match="kv_c_normed has dtype"):
        layer.forward(q, kv_c.double(), k_pe, cache, metadata)
    with pytest.raises(ValueError, match="kv_cache has shape"):
        layer.forward(q, kv_c, k_pe, torch.zeros((16, 8, dims.kv_cache_width)), metadata)
    with pytest.raises(ValueError, match="k_pe has last-dimension stride 2"):
        layer.forward(q, kv_c, torch.cat([k_pe, k_pe], -1)[:, ::2], cache, metadata)
    with pytest.raises(ValueError, match="output has shape"):
        layer.forward(q, kv_c, k_pe, cache, metadata, output=torch.zeros(q.shape[0], 7))
    with pytest.raises(ValueError, match="q is on meta"):
        layer.forward(q.to("meta"), kv_c, k_pe, cache, metadata)
    with pytest.raises(ValueError, match="kv_b_proj_weight has shape"):
        mm.MLAAttention(dims, scale, weight[1:], block_size=16, max_model_len=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="block_size=0"):
        mm.MLAAttention(dims, scale, weight, block_size=0, max_model_len=64, max_num_seqs=2)


def test_absorbed_weights_split_kv_b_proj():
    dims = mm.MLADims(3, **SMALL)
    layer, weight, _ = make_layer(dims, torch.float64, 16)
    per_head = weight.view(3, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank)
    assert torch.equal(layer.W_UK_T, per_head[:, : dims.qk_nope_head_dim])
    assert torch.equal(layer.W_UV, per_head[:, dims.qk_nope_head_dim :])


def make_gpu_layer(dims, dtype, block_size, backend, **kwargs):
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                          generator=generator, dtype=torch.float64) / dims.kv_lora_rank**0.5).to(dtype).cuda()
    scale = dims.qk_head_dim**-0.5
    layer = mm.MLAAttention(dims, scale, weight, block_size=block_size, max_model_len=16384, max_num_seqs=16,
                            prefill_backend=backend, decode_backend=backend, **kwargs)
    return layer, weight, scale


GPU_STEPS = [
    [(0, 700), (1, 64), (2, 1500)],
    [(0, 1), (1, 1), (3, 300), (2, 257)],
    [(3, 1), (0, 1), (1, 1), (4, 33), (2, 900)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)],
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "REFERENCE"], ids=["auto", "reference"])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_gpu_bf16_deepseek_v3_layer(backend, num_heads, block_size):
    dims = mm.MLADims.deepseek_v3(num_heads=num_heads)
    layer, weight, scale = make_gpu_layer(dims, torch.bfloat16, block_size, backend, workspace_tokens=512)
    num_blocks = 8192 // block_size
    scenario = PagedScenario(dims, block_size, num_blocks, torch.device("cuda"), torch.bfloat16, seed=num_heads)
    cache = torch.full((num_blocks, block_size, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    errors = run_steps(layer, weight, scale, scenario, GPU_STEPS, cache)
    assert max(errors) < 1e-2, (layer.backends(), errors)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "REFERENCE"], ids=["auto", "reference"])
def test_gpu_fp8_kv_cache_layer(backend):
    dims = mm.MLADims.deepseek_v3(num_heads=16)
    layer, weight, scale = make_gpu_layer(dims, torch.bfloat16, 64, backend, workspace_tokens=512,
                                          kv_cache_dtype="fp8", kv_cache_scale=0.05)
    scenario = PagedScenario(dims, 64, 128, torch.device("cuda"), torch.bfloat16, seed=2)
    cache = torch.zeros((128, 64, 576), dtype=layer.kv_cache_dtype, device="cuda")
    errors = run_steps(layer, weight, scale, scenario, GPU_STEPS, cache)
    assert max(errors) < 6e-2, (layer.backends(), errors)


# --------------------------------------------------------------------------- planning once per step


@pytest.fixture
def planning_backends():
    """Decode and prefill backends with a planning stage (the REFERENCE math), registered for one test."""
    from mla_multi import registry
    from mla_multi.backends.reference import (
        ReferenceDecodeBackend,
        ReferenceDecodeImpl,
        ReferencePrefillBackend,
        ReferencePrefillImpl,
    )

    plans = {"decode": [], "prefill": []}

    class PlannedDecodeImpl(ReferenceDecodeImpl):
        def plan_key(self):
            return ("PLANNED", self.num_heads, self.scale)

        def plan(self, seq_lens_cpu, block_table, query_len=1, *, k_scale=None, cuda_graph=False):
            plan = {"seq_lens": seq_lens_cpu.tolist(), "rows": block_table.shape[0], "cuda_graph": cuda_graph}
            plans["decode"].append(plan)
            return type("Plan", (), plan)

        def forward_mqa(self, q_nope, q_pe, kv_cache, block_table, seq_lens, *, plan=None, **kwargs):
            assert plan is not None and plan.seq_lens == seq_lens.tolist() and plan.rows == q_nope.shape[0]
            return super().forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens, **kwargs)

    class PlannedDecode(ReferenceDecodeBackend):
        name = "PLANNED"
        requires_plan = True

        @staticmethod
        def get_decode_impl_cls():
            return PlannedDecodeImpl

    class PlannedPrefillImpl(ReferencePrefillImpl):
        def plan_key(self):
            return ("PLANNED", self.num_heads)

        def plan(self, prefill_metadata, dtype):
            plans["prefill"].append(prefill_metadata)
            return "planned"

    class PlannedPrefill(ReferencePrefillBackend):
        name = "PLANNED"
        requires_plan = True

        @staticmethod
        def get_prefill_impl_cls():
            return PlannedPrefillImpl

    registry.default_registry.register("decode", "PLANNED", PlannedDecode)
    registry.default_registry.register("prefill", "PLANNED", PlannedPrefill)
    yield plans
    for phase in ("decode", "prefill"):
        registry.default_registry.backends[phase].pop("PLANNED")
    registry.default_registry.clear_cache()


def test_layers_share_one_plan_per_step(planning_backends):
    dims = mm.MLADims(4, **SMALL)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                         generator=generator, dtype=torch.float64) / dims.kv_lora_rank**0.5
    scale = dims.qk_head_dim**-0.5
    layers = [mm.MLAAttention(dims, scale, weight, block_size=16, max_model_len=1024, max_num_seqs=8,
                              workspace_tokens=32, prefill_backend="PLANNED", decode_backend="PLANNED")
              for _ in range(3)]
    scenario = PagedScenario(dims, 16, 256, torch.device("cpu"), torch.float64, seed=3)
    cache = torch.full((256, 16, dims.kv_cache_width), float("nan"), dtype=torch.float64)
    for index, requests in enumerate(MIXED_STEPS):
        metadata, q, kv_c, k_pe = scenario.step(requests)
        decodes_before, prefills_before = len(planning_backends["decode"]), len(planning_backends["prefill"])
        if index % 2 == 0:
            layers[1].plan(metadata)  # explicit: any layer plans for all
        outs = [layer.forward(q, kv_c, k_pe, cache, metadata) for layer in layers]
        num_decodes = sum(1 for _, n in requests if n == 1)
        assert len(planning_backends["decode"]) - decodes_before == (1 if num_decodes else 0), requests
        assert len(planning_backends["prefill"]) - prefills_before == (1 if num_decodes < len(requests) else 0)
        if num_decodes:
            assert planning_backends["decode"][-1]["seq_lens"] == metadata.seq_lens_cpu[:num_decodes].tolist()
        reference = scenario.reference(requests, q, scale, weight)
        for out in outs:
            assert relative_error(out, reference) < 1e-12


def test_plan_rejects_other_metadata(planning_backends):
    layer, _, _ = make_layer(mm.MLADims(2, **SMALL), torch.float32, 16)
    with pytest.raises(ValueError, match="metadata=dict; accepted: a CommonAttentionMetadata"):
        layer.plan({})


# --------------------------------------------------------------------------- the prefill of steps with context


def test_steps_with_context_take_the_split_key_prefill_where_the_chosen_one_repeats_the_rotary_key(monkeypatch):
    """A default prefill backend that reads K with its rotary part per head keeps steps without context;
    steps whose prefills have cached context go to the first backend of the platform's list that takes the
    rotary key apart and merges the chunks in its kernel (TRITON on GPUs; here a registered stand-in, a
    REFERENCE impl that declares both, listed after REFERENCE: the layer names no backend); a forced
    backend, by argument or environment, keeps every step."""
    from mla_multi.backends.reference import ReferencePrefillBackend, ReferencePrefillImpl
    from mla_multi.registry import default_registry

    class SplitKeyImpl(ReferencePrefillImpl):
        takes_split_key = True
        merges_chunks = True

        short = False

        def serves_short_prefills(self, dtype):
            return self.short

    class SplitKey(ReferencePrefillBackend):
        name = "SPLITKEY"

        @staticmethod
        def get_prefill_impl_cls():
            return SplitKeyImpl

    monkeypatch.setitem(default_registry.backends["prefill"], "SPLITKEY", SplitKey)
    monkeypatch.setitem(default_registry.priorities["prefill"], ("cpu", None), ("REFERENCE", "SPLITKEY"))
    default_registry.clear_cache()
    try:
        _check_split_key_steps(monkeypatch, SplitKeyImpl)
    finally:
        monkeypatch.undo()
        default_registry.clear_cache()


def _check_split_key_steps(monkeypatch, SplitKeyImpl) -> None:
    from mla_multi import attention

    dims = mm.MLADims(4, **SMALL)
    layer, _, _ = make_layer(dims, torch.float32, 16, workspace_tokens=64)
    assert layer.backends() == {"prefill": "REFERENCE", "decode": "REFERENCE", "prefill_context": "SPLITKEY"}
    assert not layer.short_prefills_on_context_backend
    SplitKeyImpl.short = True  # its kernel the faster for short prefills (as TRITON's on sm_90)
    assert layer._short_prefills()
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    fresh = mm.CommonAttentionMetadata.from_lengths([1, 9, 5], [30, 9, 5], table, 16)  # no prefill has context
    cached = mm.CommonAttentionMetadata.from_lengths([1, 9, 5], [30, 9, 40], table, 16)  # the last one has 35
    assert type(layer._step_prefill(fresh)[1]) is not SplitKeyImpl
    assert type(layer._step_prefill(cached)[1]) is SplitKeyImpl
    # where the context backend's kernel is the faster for short prefills (TRITON on sm_90), steps whose
    # prefills are all short go there too
    layer.short_prefills_on_context_backend = True
    monkeypatch.setattr(attention, "SHORT_PREFILL_TOKENS", 8)
    short = mm.CommonAttentionMetadata.from_lengths([1, 8, 5], [30, 8, 5], table, 16)
    assert type(layer._step_prefill(short)[1]) is SplitKeyImpl
    assert type(layer._step_prefill(fresh)[1]) is not SplitKeyImpl  # a prefill of 9 tokens
    assert layer.backends()["prefill_short"] == "SPLITKEY"
    layer.short_prefills_on_context_backend = False
    for forced in ({"prefill_backend": "REFERENCE"}, {}):
        if not forced:
            monkeypatch.setenv("MLA_MULTI_PREFILL_BACKEND", "REFERENCE")
        weight = torch.randn(4 * 64, 64)
        other = mm.MLAAttention(dims, 0.1, weight, block_size=16, max_model_len=4096, max_num_seqs=16,
                                workspace_tokens=64, **forced)
        assert "prefill_context" not in other.backends()
        assert type(other._step_prefill(cached)[1]) is not SplitKeyImpl
