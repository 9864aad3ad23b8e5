"""The host path of eager calls, guarded by structure rather than by time (GPU): kernel launches per decode
call, no synchronisation in a planned forward, no device allocation and no workspace growth after planning,
plans that follow new data, and the direct launch of bound kernels agreeing with Triton's own launch."""

from __future__ import annotations

import pytest
import torch

import mla_multi as mm
from mla_multi import ops

pytestmark = pytest.mark.gpu

BLOCK = 64


@pytest.fixture(autouse=True)
def _checks_off(monkeypatch):
    """The host path as engines run it: the data checks (which synchronise on GPU tensors) off."""
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "0")


def _decode_inputs(batch, heads, seq_len, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    blocks = -(-seq_len // BLOCK)
    num_blocks = batch * blocks + 3
    cache = torch.randn(num_blocks, BLOCK, 576, device="cuda", dtype=torch.bfloat16, generator=generator)
    table = torch.randperm(num_blocks, device="cuda", generator=generator)[: batch * blocks].to(torch.int32)
    table = table.reshape(batch, blocks)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    q_nope = torch.randn(batch, heads, 512, device="cuda", dtype=torch.bfloat16, generator=generator)
    q_pe = torch.randn(batch, heads, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
    return q_nope, q_pe, cache, table, seq_lens


def _reference(q_nope, q_pe, cache, table, seq_lens, scale):
    rows = cache.double().view(-1, 576)
    out = torch.empty(q_nope.shape, dtype=torch.float64, device="cuda")
    for b, length in enumerate(seq_lens.tolist()):
        slots = (table[b].long().unsqueeze(1) * BLOCK + torch.arange(BLOCK, device="cuda")).flatten()[:length]
        keys = rows[slots]
        query = torch.cat([q_nope[b], q_pe[b]], -1).double()
        out[b] = torch.softmax(scale * query @ keys.T, -1) @ keys[:, :512]
    return out


def _kernel_launches(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "memset" not in e.name.lower() and "memcpy" not in e.name.lower()]


@pytest.mark.parametrize("heads,batch,seq_len", [(16, 1, 8192), (128, 8, 4096), (128, 64, 1024)])
def test_planned_decode_calls_follow_new_data_and_launch_two_kernels_at_most(heads, batch, seq_len):
    ops._PLANS.clear()
    scale = 192**-0.5
    first = _decode_inputs(batch, heads, seq_len, seed=1)
    out = mm.ops.mla_decode(*first, scale, backend="TRITON")
    second = _decode_inputs(batch, heads, seq_len, seed=2)
    out2 = mm.ops.mla_decode(*second, scale, backend="TRITON")
    assert len([key for key in ops._PLANS if key[0] == "mla_decode"]) == 1
    plan = next(plan for key, plan in ops._PLANS.items() if key[0] == "mla_decode")
    assert list(plan.launch._kernels) == [(False, False)]  # one eager kernel plan
    kernel_plan = plan.launch._kernels[(False, False)]
    from mla_multi.kernels.launch import direct_launch_reason
    from mla_multi.kernels.mla_decode import EAGER_TMA_MIN_ROWS

    if not direct_launch_reason():
        assert kernel_plan.split._run is not None  # launched directly after the first call
    if batch < EAGER_TMA_MIN_ROWS:
        assert not kernel_plan.tma  # a small eager launch encodes no TMA descriptors
    for result, inputs in ((out, first), (out2, second)):
        expected = _reference(*inputs, scale)
        error = ((result.double() - expected).norm() / expected.norm()).item()
        assert error < 1e-2, error
    launches = _kernel_launches(lambda: mm.ops.mla_decode(*second, scale, backend="TRITON"))
    assert 1 <= len(launches) <= 2, launches  # the split kernel, and the merge when it splits


def test_small_eager_decode_skips_tma_and_a_captured_one_takes_it():
    """At B = 1 an eager decode binds the cp.async loader (no descriptor encoding a call); capturing the same
    planned decode binds its own kernel plan with the TMA loader where the configuration asks for it, and
    both give the same result."""
    from mla_multi.kernels.mla_decode import decode_config, wgmma_decode_reason
    from mla_multi.platforms import current_platform
    from mla_multi.testing import capture_graph

    inputs = _decode_inputs(1, 128, 8192, seed=4)
    scale = 192**-0.5
    plan = mm.ops.plan_mla_decode(*inputs, scale, backend="TRITON")
    eager = plan.run(*inputs)[0].clone()
    kernel_plans = plan._plan.launch._kernels
    assert list(kernel_plans) == [(False, False)] and not kernel_plans[(False, False)].tma
    out = torch.full_like(eager, float("nan"))
    graph = capture_graph(lambda: plan.run(*inputs, out=out))
    graph.replay()
    torch.cuda.synchronize()
    assert sorted(kernel_plans) == [(False, False), (True, False)]
    platform = current_platform()
    if not wgmma_decode_reason(platform, torch.bfloat16):
        assert kernel_plans[(True, False)].tma == decode_config(platform, 128, 1, torch.bfloat16).tma
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    expected = _reference(*inputs, scale)
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-2


def test_planned_layer_forward_neither_synchronises_nor_allocates_device_memory():
    dims = mm.MLADims.deepseek_v3(num_heads=16)
    weight = (torch.randn(16 * 256, 512, device="cuda") / 512**0.5).to(torch.bfloat16)
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=BLOCK, max_model_len=4096,
                            max_num_seqs=16, workspace_tokens=1024)
    batch, seq_len = 8, 2048
    q_nope, q_pe, cache, table, _ = _decode_inputs(batch, 16, seq_len)
    query_lens = [1] * 6 + [100, 37]
    seq_lens = [seq_len] * 6 + [700, 1500]
    md = mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, BLOCK)
    tokens = sum(query_lens)
    q = torch.randn(tokens, 16, 192, device="cuda", dtype=torch.bfloat16)
    kv_c = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    k_pe = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(tokens, 16 * 128, device="cuda", dtype=torch.bfloat16)
    layer.plan(md)
    layer.forward(q, kv_c, k_pe, cache, md, output=out)  # warm: kernels compiled, step plans made
    torch.cuda.synchronize()
    buffer = layer.workspace._buffer
    segments = torch.cuda.memory_stats()["segment.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            layer.forward(q, kv_c, k_pe, cache, md, output=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["segment.all.allocated"] == segments  # no cudaMalloc after planning
    assert layer.workspace._buffer is buffer
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_planned_layer_decode_step_launches_four_kernels_and_copies_nothing(batch):
    """A planned decode step of one layer: up to 16 tokens, the cache write with the absorption product in
    one launch (`kernels.absorb`), the split kernel, its merge and the up-projection written straight into the
    step's output; beyond, the cache write and the absorption product apart (five). No copy kernel."""
    heads = 128
    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    weight = (torch.randn(heads * 256, 512, device="cuda") / 512**0.5).to(torch.bfloat16)
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=BLOCK, max_model_len=8192,
                            max_num_seqs=32, decode_backend="TRITON")
    _, _, cache, table, _ = _decode_inputs(batch, heads, 8192)
    md = mm.CommonAttentionMetadata.from_lengths([1] * batch, [8192] * batch, table, BLOCK)
    q = torch.randn(batch, heads, 192, device="cuda", dtype=torch.bfloat16)
    kv_c = torch.randn(batch, 512, device="cuda", dtype=torch.bfloat16)
    k_pe = torch.randn(batch, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.full((batch, heads * 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    layer.plan(md)
    layer.forward(q, kv_c, k_pe, cache, md, output=out)
    expected = out.clone()
    out.fill_(float("nan"))
    launches = _kernel_launches(lambda: layer.forward(q, kv_c, k_pe, cache, md, output=out))
    if batch <= 16:
        assert len(launches) == 4, launches
        assert any("decode_prologue" in name for name in launches), launches
        assert any("up_project" in name for name in launches), launches
    else:
        assert len(launches) <= 5 and not [name for name in launches if "prologue" in name], launches
    assert not [name for name in launches if "copy" in name.lower() or "elementwise" in name.lower()], launches
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # every row written by the up-projection


@pytest.mark.parametrize("kind", ["decode", "mixed", "sparse"])
def test_planning_a_step_does_not_wait_for_queued_gpu_work(kind):
    """The next step is planned while the GPU still runs the last one: building the metadata and `plan` make
    only queued copies (pinned host memory), so they return while a long kernel queued before them still
    runs (a copy from pageable memory would first wait for it)."""
    heads = 16
    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    weight = (torch.randn(heads * 256, 512, device="cuda") / 512**0.5).to(torch.bfloat16)
    extra = {"sparse_topk": 64} if kind == "sparse" else {}
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=BLOCK, max_model_len=4096,
                            max_num_seqs=16, workspace_tokens=1024, decode_backend=None if extra else "TRITON",
                            prefill_backend=None if extra else "TRITON", **extra)
    query_lens = [1] * 6 + ([100, 37] if kind != "decode" else [1, 1])
    seq_lens = [2048] * 6 + [700, 1500]
    table = torch.arange(8 * 64, device="cuda", dtype=torch.int32).view(8, 64)
    layer.plan(mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, BLOCK))  # warm
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead
    done.record()
    md = mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, BLOCK)
    layer.plan(md)
    assert not done.query(), "planning waited for the GPU work queued before it"
    torch.cuda.synchronize()
    assert md.seq_lens.tolist() == seq_lens and md.query_start_loc.tolist()[-1] == sum(query_lens)


def test_captured_decode_step_replays_new_lengths_with_the_locked_shared_workspace():
    dims = mm.MLADims.deepseek_v3(num_heads=16)
    weight = (torch.randn(16 * 256, 512, device="cuda") / 512**0.5).to(torch.bfloat16)
    layers = [mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=BLOCK, max_model_len=4096,
                              max_num_seqs=8) for _ in range(3)]
    assert len({id(layer.workspace) for layer in layers}) == 1
    batch = 4
    _, _, cache, table, _ = _decode_inputs(batch, 16, 4096)
    md = mm.CommonAttentionMetadata.from_lengths([1] * batch, [4096] * batch, table, BLOCK)
    q = torch.randn(batch, 16, 192, device="cuda", dtype=torch.bfloat16)
    kv_c = torch.randn(batch, 512, device="cuda", dtype=torch.bfloat16)
    k_pe = torch.randn(batch, 64, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(batch, 16 * 128, device="cuda", dtype=torch.bfloat16) for _ in layers]

    def step():
        for layer, out in zip(layers, outs):
            layer.forward(q, kv_c, k_pe, cache, md, output=out)

    for layer in layers:
        layer.plan(md, cuda_graph=True)
    step()
    layers[0].lock_workspace()  # once, for every layer
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        # an engine's next step: new lengths (and the new tokens' slots) copied into the captured tensors
        new_lens = torch.tensor([100, 4096, 1, 2500], dtype=torch.int32, device="cuda")
        eager_md = mm.CommonAttentionMetadata.from_lengths([1] * batch, new_lens.tolist(), table, BLOCK)
        md.seq_lens.copy_(new_lens)
        md.slot_mapping.copy_(eager_md.slot_mapping)
        graph.replay()
        torch.cuda.synchronize()
        for layer, out in zip(layers, outs):
            expected = layer.forward(q, kv_c, k_pe, cache.clone(), eager_md)
            error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
            assert error < 2e-2, error
    finally:
        layers[0].workspace.unlock()


PREFILL_BACKENDS = [None, "TRITON", "FLASHINFER", "CUDA_FLASH_ATTN"]
DECODE_BACKENDS = [None, "TRITON", "FLASHINFER"]


@pytest.mark.parametrize("backends", [(None, None)] + [(p, None) for p in PREFILL_BACKENDS[1:]]
                         + [(None, d) for d in DECODE_BACKENDS[1:]], ids=lambda b: f"{b[0] or 'default'}-{b[1] or 'default'}")
@pytest.mark.parametrize("mode", ["default", "fullgraph"])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_compiled_model_step_on_the_gpu_matches_eager(kind, mode, backends):
    """Linear -> MLAAttention.forward -> Linear compiled by Inductor on the GPU (bf16), with the registry's
    backends and with each installed one forced: no crash, the same output and cache as eager, within
    float64 tolerance of naive MLA."""
    from mla_multi.testing import PagedScenario, relative_error

    prefill_backend, decode_backend = backends
    if (kind == "decode" and prefill_backend) or (kind == "prefill" and decode_backend):
        pytest.skip("that phase does not run in this step")
    torch._dynamo.reset()
    dims = mm.MLADims.deepseek_v3(num_heads=16)
    try:
        if prefill_backend:
            mm.select_prefill_backend(dims, torch.bfloat16, backend=prefill_backend)
        if decode_backend:
            mm.select_decode_backend(dims, torch.bfloat16, backend=decode_backend, block_size=16)
    except Exception as error:  # a backend that is not installed or cannot run this: its reasons
        pytest.skip(f"{prefill_backend or decode_backend}: {str(error).splitlines()[0][:200]}")
    device = torch.device("cuda")
    weight = (torch.randn(16 * 256, 512, device=device, generator=torch.Generator(device="cuda").manual_seed(0))
              / 512**0.5).to(torch.bfloat16)
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=16, max_model_len=2048, max_num_seqs=8,
                            workspace_tokens=64, prefill_backend=prefill_backend, decode_backend=decode_backend)
    lin_o = torch.nn.Linear(16 * 128, 64, device=device, dtype=torch.bfloat16)

    def model(q, kv_c, k_pe, cache, metadata):
        return lin_o(layer.forward(q, kv_c, k_pe, cache, metadata))

    scene = PagedScenario(dims, 16, 128, device, torch.bfloat16, seed=3)
    cache = torch.zeros(128, 16, 576, device=device, dtype=torch.bfloat16)
    metadata, q, kv_c, k_pe = scene.step([(0, 90), (1, 40), (2, 70)], max_blocks=16)
    with torch.inference_mode():
        layer.forward(q, kv_c, k_pe, cache, metadata)
    requests = {"decode": [(0, 1), (1, 1), (2, 1)], "prefill": [(0, 20), (2, 33)],
                "mixed": [(0, 1), (1, 1), (2, 17), (3, 30)]}[kind]
    metadata, q, kv_c, k_pe = scene.step(requests, max_blocks=16)
    compiled = torch.compile(model, fullgraph=mode == "fullgraph")
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    with torch.inference_mode():
        layer.plan(metadata)
        expected = model(q, kv_c, k_pe, eager_cache, metadata)
        got = compiled(q, kv_c, k_pe, compiled_cache, metadata)
    torch.cuda.synchronize()
    assert relative_error(got.float(), expected.float()) < 2e-2
    assert torch.equal(compiled_cache, eager_cache)
    reference = torch.nn.functional.linear(scene.reference(requests, q, layer.scale, layer.kv_b_proj_weight).to(
        device), lin_o.weight.double(), lin_o.bias.double())
    assert relative_error(got.double(), reference) < 2e-2


def _gpu_opcheck_cases():
    generator = torch.Generator(device="cuda").manual_seed(5)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=generator).to(dtype)

    q_nope, q_pe, cache, table, seq_lens = _decode_inputs(3, 16, 300, seed=5)
    seq_lens[1] = 0
    cases = [("mla_decode", (q_nope, q_pe, cache, table, seq_lens, 0.07), dict(return_lse=lse)) for lse in (True, False)]
    cu_q = torch.tensor([0, 4, 4, 9], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 5, 7, 13], dtype=torch.int32, device="cuda")
    for return_lse, causal in ((True, True), (False, False)):
        cases.append(("mla_prefill", (randn(9, 16, 192), randn(13, 16, 192), randn(13, 16, 128), cu_q, cu_k, 5, 6, 0.07),
                      dict(return_lse=return_lse, causal=causal)))
    cases.append(("merge_attn_states", (randn(5, 16, 128), randn(16, 5, dtype=torch.float32), randn(5, 16, 128),
                                        randn(16, 5, dtype=torch.float32)), {}))
    slots = torch.tensor([0, 65, -1, 170, 300], device="cuda")
    cases.append(("concat_and_cache_mla", (randn(5, 512), randn(5, 64), cache.clone(), slots), {}))
    starts = torch.tensor([0, 0, 2], dtype=torch.int32, device="cuda")
    lens = torch.tensor([70, 0, 130], dtype=torch.int32, device="cuda")
    cases.append(("gather_cache", (cache, table, starts, lens), dict(num_tokens=200)))
    cases.append(("gather_cache", (cache, table, starts, lens), {}))
    # the sparse ops: an fp8_ds_mla cache (the sparse kernel), a bf16 cache with a sink (the dense decode
    # kernels over compacted indices), and sparse prefill over bf16 rows
    from mla_multi.ds_mla_cache import quantize_fp8_ds_mla

    ds_cache = quantize_fp8_ds_mla(randn(256, 512, dtype=torch.float32), randn(256, 64, dtype=torch.float32))
    indices = torch.randint(-1, 256, (4, 128), device="cuda", generator=generator, dtype=torch.int32)
    lengths = torch.tensor([128, 0, 60, 7], dtype=torch.int32, device="cuda")
    sq_nope, sq_pe = randn(4, 16, 512), randn(4, 16, 64)
    cases.append(("mla_sparse_decode", (sq_nope, sq_pe, ds_cache.view(4, 64, 656), indices, 0.07),
                  dict(topk_length=lengths, return_lse=True)))
    cases.append(("mla_sparse_decode", (sq_nope, sq_pe, randn(16, 16, 576), indices, 0.07),
                  dict(attn_sink=randn(16, dtype=torch.float32), return_lse=False)))
    cases.append(("mla_sparse_prefill", (sq_nope, sq_pe, randn(200, 576), indices, 0.07),
                  dict(topk_length=lengths, return_lse=True)))
    return cases


@pytest.mark.parametrize("index", range(11))
def test_opcheck_on_the_gpu(index):
    """torch.library.opcheck of every registered op with GPU tensors (the TRITON kernels run), every utility
    but test_aot_dispatch_static for gather_cache without num_tokens (a data-dependent size)."""
    name, args, kwargs = _gpu_opcheck_cases()[index]
    utils = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
             "test_aot_dispatch_dynamic"]
    if name == "gather_cache" and "num_tokens" not in kwargs:
        utils.remove("test_aot_dispatch_static")
    torch.library.opcheck(getattr(torch.ops.mla_multi, name).default, args, kwargs, test_utils=utils)
