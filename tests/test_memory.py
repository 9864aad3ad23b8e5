"""One workspace per device: its sizing as a pure function of (platform, config), the bound the split
heuristic keeps to, sharing across layers, and the plans the functional ops reuse."""

from __future__ import annotations

import gc
import weakref

import pytest
from types import SimpleNamespace

import torch

import mla_multi as mm
from mla_multi import ops
from mla_multi.heuristics import max_num_kv_splits, max_partial_rows, num_kv_splits
from mla_multi.memory import memory_plan
from mla_multi.platforms import SPECS, override
from mla_multi.workspace import WorkspaceManager, current_workspace_manager, set_workspace_manager

MIB = 2**20
DEVICES = ("H100", "H200", "MI300X", "MI355X")


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv("MLA_MULTI_NUM_KV_SPLITS", raising=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [16, 128])
def test_memory_plan_deepseek_v3(device, heads):
    with override(device):
        plan = memory_plan(mm.MLADims.deepseek_v3(num_heads=heads), 256, 32768, decode_backend="TRITON",
                           prefill_backend="TRITON")
    purposes = [purpose for purpose, _, _ in plan.entries]
    assert any(p.startswith("decode") for p in purposes) and any(p.startswith("prefill") for p in purposes)
    # one buffer: the largest reservation, not the sum
    assert plan.workspace_bytes == max(b for _, b, _ in plan.entries)
    decode = plan.decode_bytes()
    # what the kernels can ask: partial rows x heads x 528 float32 (attn_logits_width), the bf16 output, the LSE
    rows = max_partial_rows(SPECS[device], heads, 256, 32768)
    expected = rows * heads * 528 * 4 + 256 * heads * 512 * 2 + 256 * heads * 4
    assert expected <= decode <= expected + 3 * 256
    if device in ("H100", "H200"):
        assert decode <= (160 if heads == 16 else 640) * MIB
    assert str(plan).count("MiB") == len(plan.entries) + 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,q_len", [(16, 1), (64, 1), (128, 1), (128, 2)])
def test_split_heuristic_keeps_to_the_reserved_rows(device, heads, q_len):
    platform = SPECS[device]
    max_num_seqs, max_model_len = 256, 32768
    rows = max_partial_rows(platform, heads, max_num_seqs, max_model_len, q_len=q_len)
    limit = max_num_kv_splits(max_model_len, platform)
    assert rows >= max_num_seqs * q_len and rows >= q_len * limit  # one request may still take every split
    largest = 0
    for batch in (1, 2, 3, 7, 16, 33, 64, 100, 128, 191, 256):
        for seq_len in (256, 1000, 4096, 8192, 20000, 32768):
            splits = num_kv_splits(platform, batch, heads, seq_len, limit, q_len=q_len, max_partial_rows=rows)
            assert 1 <= splits <= limit
            if splits > 1:
                assert batch * q_len * splits <= rows, (batch, seq_len, splits, rows)
                largest = max(largest, batch * q_len * splits)
    assert largest > 0  # the bound was exercised by batches that split


def test_env_override_stays_within_the_reserved_rows(monkeypatch):
    platform = SPECS["H100"]
    rows = max_partial_rows(platform, 128, 256, 32768)
    monkeypatch.setenv("MLA_MULTI_NUM_KV_SPLITS", "256")
    splits = num_kv_splits(platform, 200, 128, 32768, 256, max_partial_rows=rows)
    assert 200 * splits <= rows and splits >= 1


def _layer(heads=16, *, workspace=None, max_num_seqs=8, max_model_len=256, dtype=torch.float32):
    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    weight = torch.randn(heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, dtype=dtype)
    return mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=16, max_model_len=max_model_len,
                           max_num_seqs=max_num_seqs, workspace_tokens=64, workspace=workspace)


def test_a_backend_that_reads_k_whole_gets_chunks_within_the_split_key_bound():
    """A prefill backend that reads K whole (its rotary part repeated per head) and merges outside its kernel
    gets context chunks whose K and V (N x (P + R + V) values a row), beside the new tokens' result and one
    chunk's (N x (2 V + 8) a new token), fit in `workspace_tokens` rows of split K and V (N x (P + V)); one
    that takes the key apart gets `workspace_tokens`; never less than one block per prefill with context."""
    dims = mm.MLADims.deepseek_v3(num_heads=16)
    weight = torch.randn(16 * 256, 512)
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=16, max_model_len=8192,
                            max_num_seqs=8, workspace_tokens=4096)
    query_lens, seq_lens = [1, 1, 100, 100, 100], [50, 60, 2100, 100, 800]
    table = torch.arange(5 * 200, dtype=torch.int32).reshape(5, 200)
    metadata = mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, 16)
    # the capabilities an impl declares (`MLAPrefillImpl`): reads K whole, takes the key apart, writes `out`
    whole = SimpleNamespace(takes_split_key=False, takes_out=False)
    split = SimpleNamespace(takes_split_key=True, takes_out=False)
    assert layer._chunk_tokens(metadata, split) == 4096
    rows = layer._chunk_tokens(metadata, whole)
    assert rows == (4096 * 256 - 300 * 264) // 320 // 16 * 16 == 3024
    assert rows * 320 + 300 * 264 <= 4096 * 256 < (rows + 16) * 320 + 300 * 264
    assert not layer.prefill_impl.takes_split_key  # the CPU's backend reads K whole
    chunked = layer._prefill_metadata(metadata).chunked_context
    assert max(chunked.seq_tot) <= rows and chunked.num_chunks == 2
    # a backend that writes the new tokens' result into the output has one result fewer beside the chunk
    writes_out = SimpleNamespace(takes_split_key=False, takes_out=True)
    assert layer._chunk_tokens(metadata, writes_out) == (4096 * 256 - 300 * 136) // 320 // 16 * 16 == 3136
    # no room beside the new tokens' results: half of workspace_tokens' K and V, at least a block per prefill
    crowded = mm.CommonAttentionMetadata.from_lengths([1, 2000, 2000], [9, 2100, 2100], table[:3], 16)
    assert layer._chunk_tokens(crowded, whole) == 4096 * 256 // 320 // 2 // 16 * 16 == 1632
    assert _layer(max_model_len=8192)._chunk_tokens(crowded, whole) == 2 * 16  # 64 tokens: 25 rows the half


def test_layers_share_one_workspace_per_device():
    shared = WorkspaceManager("cpu")
    set_workspace_manager(shared)
    try:
        assert current_workspace_manager("cpu") is shared
        first = _layer(max_num_seqs=32, max_model_len=4096)
        one_layer = shared.size_bytes
        assert one_layer > 0
        layers = [first] + [_layer(max_num_seqs=32, max_model_len=4096) for _ in range(3)]
        assert all(layer.workspace is shared for layer in layers)
        assert shared.size_bytes == one_layer  # four layers reserve what one does
        views = [layer.workspace.get_simultaneous(((8,), torch.float32))[0] for layer in layers]
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1
        layers[0].lock_workspace()
        assert all(layer.workspace.is_locked for layer in layers)  # locked once, for every layer
        shared.unlock()
        # a layer given its own workspace keeps it
        own = WorkspaceManager("cpu")
        assert _layer(workspace=own).workspace is own and own.size_bytes > 0
        with pytest.raises(ValueError, match="workspace="):
            _layer(workspace="cpu")
    finally:
        set_workspace_manager(None, "cpu")


def test_functional_decode_reuses_its_plan_and_still_checks_data():
    ops._PLANS.clear()
    generator = torch.Generator().manual_seed(3)
    heads, blocks, block_size = 4, 6, 16
    q_nope = torch.randn(2, heads, 512, generator=generator)
    q_pe = torch.randn(2, heads, 64, generator=generator)
    cache = torch.randn(blocks, block_size, 576, generator=generator)
    block_table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 17], dtype=torch.int32)
    first = mm.ops.mla_decode(q_nope, q_pe, cache, block_table, seq_lens, 0.1)
    assert len([key for key in ops._PLANS if key[0] == "mla_decode"]) == 1
    q_nope2 = torch.randn(2, heads, 512, generator=generator)
    second = mm.ops.mla_decode(q_nope2, q_pe, cache, block_table, seq_lens, 0.2)
    assert len([key for key in ops._PLANS if key[0] == "mla_decode"]) == 1  # same key: planned once
    # the plan does not freeze the data: new query, new scale, new result (float64 reference)
    keys = cache.double().view(-1, 576)
    for out, q, scale in ((first, q_nope, 0.1), (second, q_nope2, 0.2)):
        for b, length in enumerate(seq_lens.tolist()):
            rows = torch.cat([keys[blk * block_size:(blk + 1) * block_size] for blk in block_table[b].tolist()])[:length]
            query = torch.cat([q[b], q_pe[b]], dim=-1).double()
            weights = torch.softmax(scale * query @ rows.T, dim=-1)
            torch.testing.assert_close(out[b].double(), weights @ rows[:, :512], rtol=1e-5, atol=1e-5)
    # the data checks still run on a planned key (CPU tensors: always)
    bad = block_table.clone()
    bad[1, 0] = blocks + 3
    with pytest.raises(ValueError, match="block_table"):
        mm.ops.mla_decode(q_nope, q_pe, cache, bad, seq_lens, 0.1)
    # another shape is another plan
    mm.ops.mla_decode(q_nope[:1], q_pe[:1], cache, block_table[:1], seq_lens[:1], 0.1)
    assert len([key for key in ops._PLANS if key[0] == "mla_decode"]) == 2


def test_direct_launch_contract_of_the_installed_triton():
    pytest.importorskip("triton")
    from mla_multi.kernels.launch import alignment_key, direct_launch_reason

    assert direct_launch_reason() == ""
    aligned = torch.empty(64, dtype=torch.uint8)
    assert alignment_key(aligned, None) == (1 if aligned.data_ptr() % 16 else 0)
    assert alignment_key(aligned[1:]) == 1


def test_the_bound_changes_no_benchmarked_split_choice():
    """The reservation bound leaves every split choice of the recorded benchmarks as it was (H100 / H200,
    16-128 heads, B 1-128, S 4096-32768, 1-4 query tokens, bf16 and FP8, reserved for B or 256 requests):
    the decode kernels run exactly as before it."""
    changed = []
    for device in ("H100", "H200"):
        platform = SPECS[device]
        for heads in (16, 32, 64, 128):
            for batch in (1, 8, 32, 64, 128):
                for seq_len in (4096, 8192, 16384, 32768):
                    for q_len in (1, 2, 4):
                        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
                            limit = max_num_kv_splits(seq_len, platform)
                            free = num_kv_splits(platform, batch, heads, seq_len, limit, q_len=q_len, kv_cache_dtype=dtype)
                            for max_num_seqs, max_model_len in ((batch, seq_len), (256, 32768)):
                                rows = max_partial_rows(platform, heads, max_num_seqs, max_model_len, q_len=q_len,
                                                        kv_cache_dtype=dtype)
                                bound = num_kv_splits(platform, batch, heads, seq_len, limit, q_len=q_len,
                                                      kv_cache_dtype=dtype, max_partial_rows=rows)
                                if bound != free:
                                    changed.append((device, heads, batch, seq_len, q_len, dtype, free, bound))
    assert not changed, changed[:5]


@pytest.mark.gpu
@pytest.mark.parametrize("decode_backend", [None, "TRITON", "FLASHINFER", "FLASHMLA"])
@pytest.mark.parametrize("heads,bound_mib", [(16, 160), (128, 640)])
def test_sixty_one_layers_reserve_what_one_layer_reserves_on_the_gpu(heads, bound_mib, decode_backend):
    """DeepSeek-V3 with max_num_seqs 256 and max_model_len 32768 on the GPU (torch.cuda.memory_allocated): 61
    layers hold at most 1.05x what one layer holds beyond their own weights, and that is within the decode
    bound (160 MiB at 16 heads, 640 MiB at 128), for the registry's decode backend and each installed one."""
    import gc

    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    try:
        if decode_backend:
            mm.select_decode_backend(dims, torch.bfloat16, backend=decode_backend, block_size=64)
    except Exception as error:  # not installed here, or cannot run this: its reason
        pytest.skip(f"{decode_backend}: {str(error).splitlines()[0][:200]}")
    device = torch.device("cuda")
    mm.workspace.set_workspace_manager(None, device)
    gc.collect()
    torch.cuda.empty_cache()
    weight = torch.randn(heads * 256, 512, device=device, dtype=torch.bfloat16)
    per_layer_weights = 0  # W_UK and W_UV are views of the weight given (allocated before `base`)

    def layer():
        return mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=64, max_model_len=32768,
                               max_num_seqs=256, decode_backend=decode_backend)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    layers = [layer()]
    one = torch.cuda.memory_allocated() - base - per_layer_weights
    layers += [layer() for _ in range(60)]
    sixty_one = torch.cuda.memory_allocated() - base - 61 * per_layer_weights
    try:
        assert sixty_one <= 1.05 * one, (sixty_one / 2**20, one / 2**20)
        assert one <= bound_mib * 2**20, one / 2**20
    finally:
        del layers
        mm.workspace.set_workspace_manager(None, device)
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_sixty_one_layers_hold_their_kv_b_proj_weights_once_on_the_gpu(heads):
    """DeepSeek-V3, bf16, each of 61 layers with its own kv_b_proj weight (allocated first, as a model loads them):
    building the layers adds the shared workspace and nothing else (W_UK / W_UV are views of each weight; before
    they were copies, +2 x 32 MiB a layer at 128 heads). bench/layer_weights_memory.py prints the figures."""
    import gc

    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    device = torch.device("cuda")
    mm.workspace.set_workspace_manager(None, device)
    gc.collect()
    torch.cuda.empty_cache()
    weights = [torch.randn(heads * 256, 512, device=device, dtype=torch.bfloat16) for _ in range(61)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    layers = [mm.MLAAttention(dims, dims.qk_head_dim**-0.5, w, block_size=64, max_model_len=32768, max_num_seqs=256)
              for w in weights]
    try:
        torch.cuda.synchronize()
        added = torch.cuda.memory_allocated() - base
        workspace = layers[0].workspace.size_bytes
        # the error flag and an FP8 scale are a few bytes; the allocator rounds each to 512
        assert added <= workspace + 64 * 1024, (added / MIB, workspace / MIB)
        assert all(layer.W_UK.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
                   for layer, w in zip(layers, weights))
    finally:
        del layers
        mm.workspace.set_workspace_manager(None, device)
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_backend,decode_backend", [(None, None), ("FLASHINFER", None), (None, "FLASHMLA")])
def test_sixty_one_layers_run_a_mixed_step_within_one_chunks_up_projection(prefill_backend, decode_backend):
    """61 layers of DeepSeek-V3 at 16 heads (max_num_seqs 256, max_model_len 32768, the registry's backends,
    FLASHINFER's prefill, which reads K whole, or FLASHMLA's decode, which allocates its own results and
    split partials in each call) share one workspace, and a mixed step (64 decodes of 4096
    tokens, 16 prefills of 512 new tokens with 3584 cached, in context chunks of up to workspace_tokens rows)
    run through all of them peaks, beyond the workspace and the step's tensors, at most one chunk's
    up-projected K and V (workspace_tokens x N x (P + V) bf16 values) plus the prefill's LSE (N x new tokens
    float32, merged into chunk by chunk); the results of the first and the last layer agree (they share
    weights and cache)."""
    import gc

    heads, block_size, workspace_tokens = 16, 64, 32768
    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    try:
        if prefill_backend:
            mm.select_prefill_backend(dims, torch.bfloat16, backend=prefill_backend)
        if decode_backend:
            mm.select_decode_backend(dims, torch.bfloat16, backend=decode_backend, block_size=64)
    except Exception as error:  # not installed here, or cannot run this: its reason
        pytest.skip(f"{prefill_backend or decode_backend}: {str(error).splitlines()[0][:200]}")
    device = torch.device("cuda")
    set_workspace_manager(None, device)
    gc.collect()
    torch.cuda.empty_cache()
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(heads * 256, 512, device=device, generator=generator) / 512**0.5).to(torch.bfloat16)
    layers = [mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=block_size, max_model_len=32768,
                              max_num_seqs=256, workspace_tokens=workspace_tokens, prefill_backend=prefill_backend,
                              decode_backend=decode_backend) for _ in range(61)]
    try:
        workspace = layers[0].workspace
        assert all(layer.workspace is workspace for layer in layers)
        query_lens = [1] * 64 + [512] * 16
        seq_lens = [4096] * 80
        blocks = 4096 // block_size
        num_blocks = len(seq_lens) * blocks
        cache = torch.randn(num_blocks, block_size, 576, device=device, generator=generator).to(torch.bfloat16)
        table = torch.randperm(num_blocks, device=device, generator=generator).int().reshape(len(seq_lens), blocks)
        metadata = mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, block_size)
        tokens = sum(query_lens)
        q = torch.randn(tokens, heads, 192, device=device, generator=generator).to(torch.bfloat16)
        kv_c = torch.randn(tokens, 512, device=device, generator=generator).to(torch.bfloat16)
        k_pe = torch.randn(tokens, 64, device=device, generator=generator).to(torch.bfloat16)
        first = torch.full((tokens, heads * 128), float("nan"), device=device, dtype=torch.bfloat16)
        last = torch.full_like(first, float("nan"))
        layers[0].plan(metadata)
        layers[0].forward(q, kv_c, k_pe, cache, metadata, output=first)  # warm: kernels built, step planned
        torch.cuda.synchronize()
        reserved = workspace.size_bytes
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for index, layer in enumerate(layers):
            layer.forward(q, kv_c, k_pe, cache, metadata, output=last if index == 60 else first)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        assert workspace.size_bytes == reserved  # nothing grew during the step
        chunk_kv = workspace_tokens * heads * (dims.qk_nope_head_dim + dims.v_head_dim) * 2
        prefill_lse = heads * 16 * 512 * 4
        assert peak <= chunk_kv + prefill_lse, (peak / MIB, chunk_kv / MIB, prefill_lse / MIB)
        assert bool(torch.isfinite(last).all())
        torch.testing.assert_close(last, first, rtol=0, atol=0)
    finally:
        del layers
        set_workspace_manager(None, device)
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_functional_decode_takes_its_partials_from_the_shared_workspace():
    """An eager `mm.ops.mla_decode` that splits (1 request of 32768 tokens, 128 heads) slices its split-KV
    partials from the device's shared workspace, allocating only its output and LSE, and matches REFERENCE;
    where the shared workspace is locked smaller, the call keeps a buffer of its own and still matches."""
    from mla_multi.kernels.mla_decode import attn_logits_width

    device = torch.device("cuda")
    set_workspace_manager(None, device)
    generator = torch.Generator(device="cuda").manual_seed(5)
    heads, seq_len = 128, 32768
    cache = torch.randn(seq_len // 64, 64, 576, device=device, generator=generator).to(torch.bfloat16)
    table = torch.randperm(seq_len // 64, device=device, generator=generator).int().view(1, -1)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    q_nope = torch.randn(1, heads, 512, device=device, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(1, heads, 64, device=device, generator=generator).to(torch.bfloat16)
    args = (q_nope, q_pe, cache, table, lens, 0.07)
    try:
        plan = mm.ops.plan_mla_decode(*args, backend="TRITON")
        assert plan.num_kv_splits > 1
        partial_bytes = heads * plan.num_kv_splits * attn_logits_width(512) * 4
        mm.ops.mla_decode(*args, backend="TRITON")  # built and planned
        torch.cuda.synchronize()
        assert current_workspace_manager(device).size_bytes >= partial_bytes
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = mm.ops.mla_decode(*args, backend="TRITON")
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before <= out.numel() * 2 + heads * 4 + (1 << 20)
        ref = mm.ops.mla_decode(*args, backend="REFERENCE")
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
        small = WorkspaceManager(device)
        small.reserve(((1024,), torch.uint8))
        small.lock()
        set_workspace_manager(small, device)
        again = mm.ops.mla_decode(*args, backend="TRITON")
        assert small.size_bytes == 1024
        torch.testing.assert_close(again, out, rtol=0, atol=0)
    finally:
        set_workspace_manager(None, device)


@pytest.mark.gpu
def test_one_split_functional_calls_allocate_no_partials():
    """A functional call whose split heuristic picks one split writes its output directly: no split-KV
    partials are allocated (sparse prefill of 4096 tokens x 128 heads through TRITON: the partials would be
    1.06 GiB, twice the output), and the result still matches float64."""
    from mla_multi.backends.reference import sparse_attention_reference
    from mla_multi.kernels.mla_decode import split_partials

    stand_in = split_partials(4096, 128, 1, 512, "cuda")
    assert stand_in.shape == (4096, 128, 1, 528) and stand_in.untyped_storage().nbytes() == 528 * 4
    assert split_partials(8, 128, 3, 512, "cuda").is_contiguous()
    generator = torch.Generator().manual_seed(3)
    tokens, heads, topk, s_kv = 4096, 128, 256, 8192
    kv = torch.randn(s_kv, 576, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-1, s_kv, (tokens, topk), generator=generator, dtype=torch.int32)
    q_nope = torch.randn(tokens, heads, 512, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(tokens, heads, 64, generator=generator).to(torch.bfloat16)
    args = (q_nope.cuda(), q_pe.cuda(), kv.cuda(), indices.cuda(), 0.05)
    mm.ops.mla_sparse_prefill(*args, backend="TRITON")  # compile and plan outside the measurement
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = mm.ops.mla_sparse_prefill(*args, backend="TRITON")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    partials = tokens * heads * 528 * 4
    assert peak < 0.7 * partials, (peak, partials)
    rows = slice(0, 4096, 511)
    ref, _, _ = sparse_attention_reference(torch.cat([q_nope, q_pe], -1)[rows].double(), kv.double(), indices[rows],
                                           0.05)
    got = out[rows].double().cpu()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


def test_shared_split_partials_are_the_device_workspace_unless_one_split_or_locked_smaller():
    """`shared_split_partials` (the eager functional decode's partials): a view of the device's shared
    workspace, the same one for the same shape; one split: the stand-in of `split_partials`; a workspace
    locked smaller: a buffer of its own (CPU device)."""
    from mla_multi.kernels.mla_decode import attn_logits_width, shared_split_partials

    cpu = torch.device("cpu")
    set_workspace_manager(WorkspaceManager(cpu), cpu)
    try:
        partials, owner = shared_split_partials(2, 4, 3, 512, cpu)
        manager = current_workspace_manager(cpu)
        assert partials.shape == (2, 4, 3, attn_logits_width(512)) and partials.dtype == torch.float32
        assert partials.untyped_storage().data_ptr() == manager._buffer.untyped_storage().data_ptr()
        assert shared_split_partials(2, 4, 3, 512, cpu)[0] is partials and owner[0] is manager
        one, none = shared_split_partials(2, 4, 1, 512, cpu)
        assert none is None
        assert one.untyped_storage().nbytes() == attn_logits_width(512) * 4
        small = WorkspaceManager(cpu)
        small.lock()
        set_workspace_manager(small, cpu)
        own, none = shared_split_partials(2, 4, 3, 512, cpu)
        assert none is None
        assert own.shape == partials.shape and small.size_bytes == 0
    finally:
        set_workspace_manager(None, cpu)


def test_a_triton_decode_launch_keeps_its_shared_partials_while_the_workspace_keeps_its_buffer():
    """TRITON's bound decode (`TritonDecodeLaunch`) keeps the shared-workspace view of its split partials from
    its first eager call and asks again only where the workspace grew, another workspace became the device's,
    or a capture is under way (not kept) (CPU device: no kernel runs)."""
    from mla_multi.backends.triton import TritonDecodeImpl
    from mla_multi.kernels.mla_decode import attn_logits_width

    cpu = torch.device("cpu")
    set_workspace_manager(WorkspaceManager(cpu), cpu)
    try:
        q_nope = torch.zeros(2, 16, 512, dtype=torch.bfloat16)
        table = torch.zeros(2, 64, dtype=torch.int32)
        cache = torch.zeros(64, 16, 576, dtype=torch.bfloat16)
        with override("H200"):  # (a platform whose heuristics let the call split)
            impl = TritonDecodeImpl(16, 576**-0.5, 512, 64, torch.bfloat16, 16)
            launch = impl.bind(q_nope, torch.zeros(2, 16, 64, dtype=torch.bfloat16), cache, table,
                               torch.full((2,), 1024, dtype=torch.int32), num_kv_splits=4)
        shape = (2, 16, 4, attn_logits_width(512))
        first = launch._shared_partials(cpu, False)
        manager = current_workspace_manager(cpu)
        assert first.shape == shape
        assert first.untyped_storage().data_ptr() == manager._buffer.untyped_storage().data_ptr()

        def asked(*specs):
            raise AssertionError("the workspace was asked again")

        manager.get_simultaneous = asked  # a kept view asks nothing
        assert launch._shared_partials(cpu, False) is first
        del manager.get_simultaneous
        # a call under a capture (a buffer of the capture's own on a GPU: `shared_split_partials`) asks again
        # and keeps nothing
        kept = launch._shared
        assert launch._shared_partials(cpu, True).shape == shape and launch._shared is kept
        assert launch._shared_partials(cpu, False) is first
        # the workspace grew: the launch keeps nothing of the buffer it let go of, and takes a view of the new one
        old_buffer, old_ptr = weakref.ref(manager._buffer), first.untyped_storage().data_ptr()
        manager.reserve(((1 << 20,), torch.uint8))
        del first
        gc.collect()
        assert old_buffer() is None
        grown = launch._shared_partials(cpu, False)
        assert grown.untyped_storage().data_ptr() == manager._buffer.untyped_storage().data_ptr() != old_ptr
        assert launch._shared_partials(cpu, False) is grown
        # another workspace made the device's: a view of it (the launch keeps the one before alive no more)
        other = WorkspaceManager(cpu)
        set_workspace_manager(other, cpu)
        before = weakref.ref(manager)
        del manager, grown
        gc.collect()
        assert before() is None
        moved = launch._shared_partials(cpu, False)
        assert moved.untyped_storage().data_ptr() == other._buffer.untyped_storage().data_ptr()
        assert launch._shared_partials(cpu, False) is moved
    finally:
        set_workspace_manager(None, cpu)
