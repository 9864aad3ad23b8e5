"""Decode context parallelism (mla_multi/distributed.py) across processes.

CPU: gloo, 2 and 3 processes; GPU (marked `gpu`): NCCL, 2 processes on 2
GPUs, the TRITON backend and CUDA-graph capture. Each world is spawned once
per module (`torch.multiprocessing`, a FileStore rendezvous): its processes
run every scenario in order and write a report per rank; each test reads the
report of its scenario. A scenario that fails on any rank stops the ones after
it (the ranks' collectives would no longer line up).

Every decode is checked against the single-device op and against float64
math written here, on caches poisoned with NaN outside the written slots.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import time
import traceback
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import mla_multi as mm
from mla_multi import ops
from mla_multi.backends.reference import ReferenceDecodeBackend, ReferenceDecodeImpl
from mla_multi.distributed import DecodeContextParallel
from mla_multi.testing import PagedScenario, relative_error

SMALL = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
# Lengths 0 (empty), 1 and 2 (some ranks hold no token) and longer ones.
SEQ_LENS = [0, 1, 2, 5, 13, 40, 3]


@dataclasses.dataclass
class Context:
    rank: int
    world: int
    device: torch.device


# --------------------------------------------------------------------------- helpers


def build_caches(dcp, rows, kv_lora_rank, block_size, device, cache_dtype, seed):
    """One sequence set in a single-device cache and in this rank's shard.

    rows: per request [S_i, Lkv + R] (Lkv = kv_lora_rank). Both caches are NaN outside the written
    slots and use shuffled block tables. Returns (global_cache, global_table,
    local_cache, local_table).
    """
    generator = torch.Generator().manual_seed(seed)
    width = -(-max([r.shape[0] for r in rows] + [1]) // block_size)
    num_blocks = len(rows) * width + 3
    global_table = torch.randperm(num_blocks, generator=generator)[: len(rows) * width].view(len(rows), width)
    local_generator = torch.Generator().manual_seed(seed + 1 + dcp.rank)
    local_table = torch.randperm(num_blocks, generator=local_generator)[: len(rows) * width].view(len(rows), width)
    shape = (num_blocks, block_size, rows[0].shape[1])
    global_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=device)
    local_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=device)
    for i, request_rows in enumerate(rows):
        positions = torch.arange(request_rows.shape[0])
        kv_c, k_pe = request_rows[:, :kv_lora_rank].to(device), request_rows[:, kv_lora_rank:].to(device)
        slots = global_table[i][positions // block_size] * block_size + positions % block_size
        ops.concat_and_cache_mla(kv_c, k_pe, global_cache, slots.to(device))
        local = dcp.local_positions(positions)
        safe = local.clamp(min=0)
        local_slots = torch.where(local >= 0, local_table[i][safe // block_size] * block_size + safe % block_size, -1)
        ops.concat_and_cache_mla(kv_c, k_pe, local_cache, local_slots.to(device))
    to_device = lambda table: table.to(torch.int32).to(device)  # noqa: E731
    return global_cache, to_device(global_table), local_cache, to_device(local_table)


def naive_decode(query, rows, scale, q_len, kv_lora_rank):
    """float64 decode straight from the math: query [B, Q, N, Lkv + R], rows per request [S, Lkv + R].

    Token j sees positions < S - Q + 1 + j. Returns out [B, Q, N, Lkv] and lse [B, Q, N].
    """
    batch, _, num_heads, _ = query.shape
    out = torch.zeros(batch, q_len, num_heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((batch, q_len, num_heads), float("-inf"), dtype=torch.float64)
    for b, keys in enumerate(rows):
        keys = keys.double()
        seq_len = keys.shape[0]
        scores = torch.einsum("qnd,sd->qns", query[b].double().cpu(), keys) * scale
        limits = seq_len - q_len + 1 + torch.arange(q_len)
        visible = torch.arange(seq_len).unsqueeze(0) < limits.unsqueeze(1)  # [Q, S]
        scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        seen = visible.any(dim=1)
        probs = torch.softmax(scores[seen], dim=-1)
        out[b, seen] = torch.einsum("qns,sd->qnd", probs, keys[:, :kv_lora_rank])
        lse[b, seen] = row_lse[seen]
    return out, lse


def random_rows(seq_lens, width, generator):
    return [torch.randn(s, width, generator=generator, dtype=torch.float64) for s in seq_lens]


def check_decode(ctx, dcp, *, dtype, q_len, kv_lora_rank, rope_dim, num_local_heads, block_size, seq_lens, backend,
                 tolerance, lse_tolerance, seed=0):
    """DCP decode of this rank's heads against the single-device op and float64 math."""
    generator = torch.Generator().manual_seed(seed)
    num_heads = num_local_heads * ctx.world
    batch = len(seq_lens)
    rows = random_rows(seq_lens, kv_lora_rank + rope_dim, generator)
    rows = [r.to(dtype) for r in rows]
    q_shape = (batch, q_len, num_heads) if q_len > 1 else (batch, num_heads)
    q_nope = torch.randn(*q_shape, kv_lora_rank, generator=generator, dtype=torch.float64).to(dtype).to(ctx.device)
    q_pe = torch.randn(*q_shape, rope_dim, generator=generator, dtype=torch.float64).to(dtype).to(ctx.device)
    scale = (kv_lora_rank + rope_dim) ** -0.5
    global_cache, global_table, local_cache, local_table = build_caches(
        dcp, rows, kv_lora_rank, block_size, ctx.device, dtype, seed + 7
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=ctx.device)
    heads = slice(ctx.rank * num_local_heads, (ctx.rank + 1) * num_local_heads)
    local_q_nope, local_q_pe = q_nope[..., heads, :].contiguous(), q_pe[..., heads, :].contiguous()
    out, lse = dcp.mla_decode(
        local_q_nope, local_q_pe, local_cache, local_table, lens, scale, backend=backend, return_lse=True
    )
    single_out, single_lse = ops.mla_decode(
        q_nope, q_pe, global_cache, global_table, lens, scale, backend=backend, return_lse=True
    )
    query = torch.cat([q_nope, q_pe], dim=-1)
    if q_len == 1:
        query = query.unsqueeze(1)
    ref_out, ref_lse = naive_decode(query, [r.double() for r in rows], scale, q_len, kv_lora_rank)
    if q_len == 1:
        ref_out, ref_lse = ref_out.squeeze(1), ref_lse.squeeze(1)
    expected_shape = (*q_shape[:-1], num_local_heads)
    assert out.shape == (*expected_shape, kv_lora_rank) and out.dtype == dtype, (out.shape, out.dtype)
    assert lse.shape == expected_shape, lse.shape
    assert torch.isfinite(out).all(), "NaN or inf in the DCP output"
    error_single = relative_error(out, single_out[..., heads, :])
    error_naive = relative_error(out, ref_out[..., heads, :])
    assert error_single < tolerance and error_naive < tolerance, (error_single, error_naive)
    expected_lse = ref_lse[..., heads]
    empty = expected_lse == float("-inf")
    lse_cpu = lse.double().cpu()
    assert torch.equal(lse_cpu == float("-inf"), empty), (lse_cpu, expected_lse)
    if (~empty).any():
        assert (lse_cpu[~empty] - expected_lse[~empty]).abs().max().item() < lse_tolerance
        assert (single_lse[..., heads].double().cpu()[~empty] - lse_cpu[~empty]).abs().max().item() < lse_tolerance
    # A request with no token anywhere: 0 and -inf.
    for b, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            assert not out[b].any() and (lse_cpu[b] == float("-inf")).all()


def all_gather_cpu(tensor):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.stack(parts)


# --------------------------------------------------------------------------- CPU scenarios (gloo)


def scenario_local_positions(ctx):
    for interleave in (1, 4, 5):
        dcp = DecodeContextParallel(interleave=interleave)
        assert (dcp.rank, dcp.world_size, dcp.interleave) == (ctx.rank, ctx.world, interleave)
        for dtype in (torch.int32, torch.int64):
            positions = torch.arange(-3, 150, dtype=dtype)
            local = dcp.local_positions(positions)
            assert local.dtype == dtype and local.shape == positions.shape
            every = all_gather_cpu(local.long())  # [world, P]
            owners = (every >= 0).sum(dim=0)
            assert torch.equal(owners, (positions >= 0).long()), "each position must have exactly one owner"
            valid = positions >= 0
            p = positions[valid].long()
            expected_owner = (p // interleave) % ctx.world
            assert torch.equal(every[:, valid].argmax(dim=0), expected_owner)
            owned = every[ctx.rank, valid]
            owned = owned[owned >= 0]
            # Dense and in global order: the local cache fills 0, 1, 2, ...
            assert torch.equal(owned, torch.arange(owned.numel()))
            expected_local = (p // (interleave * ctx.world)) * interleave + p % interleave
            owner_values = every[:, valid].gather(0, expected_owner.unsqueeze(0)).squeeze(0)
            assert torch.equal(owner_values, expected_local)
        lengths = torch.arange(0, 150)
        per_rank = torch.stack([dcp.local_seq_lens(lengths, rank=r).long() for r in range(ctx.world)])
        assert torch.equal(per_rank.sum(dim=0), lengths)
        owned_counts = torch.stack([((torch.arange(150) // interleave) % ctx.world == r).cumsum(0) for r in range(ctx.world)])
        assert torch.equal(per_rank[:, 1:], owned_counts[:, :-1])
        assert dcp.local_seq_lens(lengths.int()).dtype == torch.int32
        assert torch.equal(dcp.local_seq_lens(lengths), per_rank[ctx.rank].int())
        assert [dcp.local_num_tokens(n) for n in range(150)] == per_rank[ctx.rank].tolist()
        assert dcp.local_seq_lens(torch.tensor([-4])).tolist() == [0]


def scenario_decode_matches_single_device(ctx):
    dcp_by_interleave = {interleave: DecodeContextParallel(interleave=interleave) for interleave in (1, 4)}
    cases = [(torch.float64, 1, 1e-12, 1e-10), (torch.float32, 1, 1e-5, 1e-4), (torch.float64, 3, 1e-12, 1e-10)]
    for interleave, dcp in dcp_by_interleave.items():
        for seed, (dtype, q_len, tolerance, lse_tolerance) in enumerate(cases):
            check_decode(
                ctx, dcp, dtype=dtype, q_len=q_len, kv_lora_rank=SMALL["kv_lora_rank"],
                rope_dim=SMALL["qk_rope_head_dim"], num_local_heads=2, block_size=4, seq_lens=SEQ_LENS,
                backend=None, tolerance=tolerance, lse_tolerance=lse_tolerance, seed=seed + 10 * interleave,
            )


def scenario_empty_requests(ctx):
    dcp = DecodeContextParallel()
    width = SMALL["kv_lora_rank"] + SMALL["qk_rope_head_dim"]
    cache = torch.full((4, 4, width), float("nan"))
    table = torch.zeros(3, 2, dtype=torch.int32)
    q_nope = torch.randn(3, 2, SMALL["kv_lora_rank"])
    q_pe = torch.randn(3, 2, SMALL["qk_rope_head_dim"])
    out, lse = dcp.mla_decode(q_nope, q_pe, cache, table, torch.zeros(3, dtype=torch.int32), 0.1, return_lse=True)
    assert not out.any() and not torch.isnan(out).any()
    assert (lse == float("-inf")).all()
    check_decode(
        ctx, dcp, dtype=torch.float32, q_len=2, kv_lora_rank=SMALL["kv_lora_rank"], rope_dim=SMALL["qk_rope_head_dim"],
        num_local_heads=2, block_size=4, seq_lens=[0, 0], backend=None, tolerance=1e-6, lse_tolerance=1e-6,
    )
    # No request at all.
    empty = dcp.mla_decode(q_nope[:0], q_pe[:0], cache, table[:0], torch.zeros(0, dtype=torch.int32), 0.1)
    assert empty.shape == (0, 2, SMALL["kv_lora_rank"])


def scenario_combine_ignores_ranks_without_tokens(ctx):
    """A rank whose LSE is -inf (or +inf) contributes nothing, even a NaN partial output."""
    dcp = DecodeContextParallel()
    generator = torch.Generator().manual_seed(5)
    rows, num_local, dim = 4, 3, 8
    num_heads = num_local * ctx.world
    every_out = torch.randn(ctx.world, rows, num_heads, dim, generator=generator)
    every_lse = torch.randn(ctx.world, rows, num_heads, generator=generator) * 3
    last = ctx.world - 1
    every_lse[last, 0] = float("-inf")  # row 0: the last rank has no token
    every_out[last, 0] = float("nan")
    every_lse[:, 1] = float("-inf")  # row 1: nobody has a token
    every_out[:, 1] = float("nan")
    every_lse[0, 2] = float("inf")  # +inf counts as -inf
    every_out[0, 2] = float("nan")
    out, lse = dcp.combine(every_out[ctx.rank].clone(), every_lse[ctx.rank].clone())
    reference_lse = torch.where(every_lse == float("inf"), float("-inf"), every_lse).double()
    total = torch.logsumexp(reference_lse, dim=0)
    weights = torch.exp(reference_lse - torch.where(torch.isfinite(total), total, 0.0))
    weights = torch.where(torch.isfinite(total), weights, 0.0)
    expected = (weights.unsqueeze(-1) * torch.nan_to_num(every_out.double(), nan=0.0)).sum(dim=0)
    heads = slice(ctx.rank * num_local, (ctx.rank + 1) * num_local)
    assert torch.isfinite(out).all()
    assert relative_error(out, expected[:, heads]) < 1e-6
    assert not out[1].any() and (lse[1] == float("-inf")).all()
    assert torch.allclose(lse[torch.isfinite(lse)].double(), total[:, heads][torch.isfinite(total[:, heads])], atol=1e-5)


def scenario_context_chunk_gather(ctx):
    for interleave in (1, 3):
        dcp = DecodeContextParallel(interleave=interleave)
        generator = torch.Generator().manual_seed(interleave)
        seq_lens = [9, 20, 4, 0, 13]
        rows = [r.float() for r in random_rows(seq_lens, 40, generator)]
        _, _, local_cache, local_table = build_caches(dcp, rows, 32, 4, ctx.device, torch.float32, 3)
        starts = torch.tensor([0, 7, 4, 0, 12], dtype=torch.int32)
        lens = torch.tensor([9, 11, 0, 0, 1], dtype=torch.int32)
        gathered = dcp.gather_context_chunk(local_cache, local_table, starts, lens)
        expected = torch.cat([r[s : s + n] for r, s, n in zip(rows, starts.tolist(), lens.tolist())])
        assert torch.equal(gathered, expected)


LAYER_STEPS = [
    [(0, 13), (1, 2), (2, 9)],  # prefills without context
    [(0, 1), (1, 1), (3, 6), (2, 11)],  # decodes, prefills with context in several chunks
    [(3, 1), (0, 1), (5, 0), (1, 1), (2, 1), (4, 7)],  # a padding row, a fresh prefill
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)],  # pure decode
    [(4, 1), (0, 17)],  # long context, chunked
]


def check_layer(ctx, dcp, *, dims_local, dtype, block_size, workspace_tokens, tolerance, backends, steps=LAYER_STEPS,
                seed=0, adjust_layer=None):
    """MLAAttention with DCP against the single-device layer and naive float64 MLA, step by step."""
    num_local = dims_local.num_heads
    dims = dataclasses.replace(dims_local, num_heads=num_local * ctx.world)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                         generator=generator, dtype=torch.float64) / dims.kv_lora_rank**0.5
    weight = weight.to(dtype).to(ctx.device)
    heads = list(range(ctx.rank * num_local, (ctx.rank + 1) * num_local))
    local_weight = weight.view(dims.num_heads, -1, dims.kv_lora_rank)[heads].reshape(-1, dims.kv_lora_rank)
    scale = dims.qk_head_dim**-0.5
    common = dict(block_size=block_size, max_model_len=512, max_num_seqs=8, workspace_tokens=workspace_tokens,
                  prefill_backend=backends, decode_backend=backends)
    single = mm.MLAAttention(dims, scale, weight, **common)
    layer = mm.MLAAttention(dims_local, scale, local_weight.contiguous(), dcp=dcp, **common)
    assert layer.decode_impl.num_heads == dims.num_heads
    if adjust_layer is not None:
        adjust_layer(layer)
    totals: dict[int, int] = {}
    for requests in steps:
        for request, count in requests:
            totals[request] = totals.get(request, 0) + count
    blocks_per_request = -(-max(totals.values()) // block_size)
    num_blocks = 8 * blocks_per_request
    scenario = PagedScenario(dims, block_size, num_blocks, ctx.device, dtype, seed=seed + 1)
    width = dims.kv_cache_width
    global_cache = torch.full((num_blocks, block_size, width), float("nan"), dtype=dtype, device=ctx.device)
    local_cache = torch.full((num_blocks, block_size, width), float("nan"), dtype=dtype, device=ctx.device)
    # This rank's blocks: a fixed shuffled row per request, as wide as a whole sequence
    # (CommonAttentionMetadata checks the global lengths against the table width).
    local_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 2 + ctx.rank))
    local_blocks = local_blocks.view(8, blocks_per_request).to(torch.int32)
    for requests in steps:
        metadata, q, kv_c, k_pe = scenario.step(requests)
        expected = single.forward(q, kv_c, k_pe, global_cache, metadata)
        local_table = local_blocks[[request for request, _ in requests]].to(ctx.device)
        local_metadata = mm.CommonAttentionMetadata.from_lengths(
            metadata.query_lens_cpu, metadata.seq_lens_cpu, local_table, block_size
        )
        tokens = q.shape[0]
        out = torch.full((tokens, num_local * dims.v_head_dim), float("nan"), dtype=dtype, device=ctx.device)
        layer.forward(q[:, heads].contiguous(), kv_c, k_pe, local_cache, local_metadata, output=out)
        own = lambda full: full.view(tokens, dims.num_heads, -1)[:, heads].reshape(tokens, -1)  # noqa: E731
        reference = scenario.reference(requests, q, scale, weight)
        error_single = relative_error(out, own(expected))
        error_naive = relative_error(out, own(reference))
        assert error_single < tolerance and error_naive < tolerance, (requests, error_single, error_naive)
    # Only this rank's tokens were written: the slots of the others stay NaN.
    written = ~torch.isnan(local_cache).any(dim=-1)
    total_tokens = sum(scenario.seq_len(request) for request in scenario.latent)
    assert int(written.sum()) == sum(dcp.local_num_tokens(scenario.seq_len(r)) for r in scenario.latent)
    assert int(written.sum()) < total_tokens or ctx.world == 1


def scenario_layer_matches_single_device_layer(ctx):
    for interleave, dtype, tolerance in ((1, torch.float64, 1e-10), (4, torch.float64, 1e-10), (1, torch.float32, 1e-5)):
        check_layer(
            ctx, DecodeContextParallel(interleave=interleave), dims_local=mm.MLADims(2, **SMALL), dtype=dtype,
            block_size=4, workspace_tokens=16, tolerance=tolerance, backends=None, seed=interleave,
        )


class PlanningDecodeImpl(ReferenceDecodeImpl):
    """The REFERENCE decode behind a planning stage that records the lengths it planned for."""

    plans = 0

    def plan_key(self):
        return ("planning-reference", self.num_heads)

    def plan(self, seq_lens_cpu, block_table, query_len, *, k_scale=None, cuda_graph=False):
        PlanningDecodeImpl.plans += 1
        return types.SimpleNamespace(seq_lens=seq_lens_cpu.clone(), cuda_graph=cuda_graph)

    def forward_mqa(self, q_nope, q_pe, kv_cache, block_table, seq_lens, *, plan=None, **kwargs):
        assert plan is not None, "the layer passed no plan"
        assert plan.seq_lens.tolist() == seq_lens.tolist(), "planned for other lengths than decoded"
        return super().forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens, **kwargs)


class PlanningDecodeBackend(ReferenceDecodeBackend):
    requires_plan = True

    @staticmethod
    def get_decode_impl_cls():
        return PlanningDecodeImpl


def scenario_layer_plans_for_local_lengths(ctx):
    """A decode backend with a planning stage (as FLASHINFER) is planned with this rank's lengths."""

    def plan_through_fake(layer):
        impl = layer.decode_impl
        layer.decode_backend = PlanningDecodeBackend
        layer.decode_impl = PlanningDecodeImpl(
            impl.num_heads, impl.scale, impl.kv_lora_rank, impl.qk_rope_head_dim, impl.kv_cache_dtype,
            impl.block_size, impl.device,
        )

    check_layer(
        ctx, DecodeContextParallel(interleave=2), dims_local=mm.MLADims(2, **SMALL), dtype=torch.float64,
        block_size=4, workspace_tokens=16, tolerance=1e-10, backends=None, adjust_layer=plan_through_fake,
    )
    assert PlanningDecodeImpl.plans >= 3


def scenario_step_keeps_local_decode_inputs(ctx):
    """A step's decode rows get this rank's block table and lengths once (`step_plans`, every layer after
    the first reuses them); other inputs, or no step, compute them anew; multi-token rows as without a step."""
    dcp = DecodeContextParallel(interleave=2)
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    lens = torch.tensor([5, 0, 13], dtype=torch.int32)
    step = {}
    first = dcp._local_inputs(table, lens, 1, step)
    again = dcp._local_inputs(table, lens, 1, step)
    assert first[0] is again[0] and first[1] is again[1]
    assert first[0] is table and torch.equal(first[1], dcp.local_seq_lens(lens))
    other = lens.clone()
    assert dcp._local_inputs(table, other, 1, step)[1] is not first[1]
    multi = dcp._local_inputs(table, lens, 2, step)
    plain = dcp._local_inputs(table, lens, 2, None)
    assert multi[0].shape == (6, 4) and torch.equal(multi[0], plain[0]) and torch.equal(multi[1], plain[1])
    assert dcp._local_inputs(table, lens, 2, step)[1] is multi[1]


def scenario_bad_inputs(ctx):
    with pytest.raises(ValueError, match="interleave=0; accepted: a positive int"):
        DecodeContextParallel(interleave=0)
    with pytest.raises(ValueError, match="interleave=True"):
        DecodeContextParallel(interleave=True)
    with pytest.raises(ValueError, match="group='world'; accepted"):
        DecodeContextParallel(group="world")
    dcp = DecodeContextParallel()
    with pytest.raises(ValueError, match="is on cuda.*backend gloo"):
        dcp.check_device("q_nope", torch.device("cuda"))
    with pytest.raises(ValueError, match="positions has dtype float32"):
        dcp.local_positions(torch.zeros(3))
    with pytest.raises(ValueError, match=r"rank=7; accepted: None or an int in \[0, "):
        dcp.local_seq_lens(torch.zeros(2, dtype=torch.int32), rank=7)
    width = SMALL["kv_lora_rank"] + SMALL["qk_rope_head_dim"]
    cache = torch.zeros(4, 4, width)
    table = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    q_nope, q_pe = torch.randn(2, 2, SMALL["kv_lora_rank"]), torch.randn(2, 2, SMALL["qk_rope_head_dim"])
    with pytest.raises(ValueError, match="q_pe has shape"):
        dcp.mla_decode(q_nope, q_pe[:, :1], cache, table, lens, 0.1)
    with pytest.raises(ValueError, match="scale=0"):
        dcp.mla_decode(q_nope, q_pe, cache, table, lens, 0)
    if ctx.world > 1:  # nothing can differ in a world of one
        # Heads that differ across ranks: every rank raises, checked before the query all-gather.
        uneven = torch.randn(2, 2 + ctx.rank % 2, SMALL["kv_lora_rank"])
        uneven_pe = torch.randn(2, 2 + ctx.rank % 2, SMALL["qk_rope_head_dim"])
        with pytest.raises(ValueError, match=r"num_heads \(heads per rank.*differs across the .* ranks"):
            dcp.mla_decode(uneven, uneven_pe, cache, table, lens, 0.1)
        # Without the data checks the configuration is still compared on its first use.
        saved = os.environ.get("MLA_MULTI_CHECK_INPUTS")
        os.environ["MLA_MULTI_CHECK_INPUTS"] = "0"
        try:
            with pytest.raises(ValueError, match="num_heads"):
                DecodeContextParallel().mla_decode(uneven, uneven_pe, cache, table, lens, 0.1)
        finally:
            os.environ["MLA_MULTI_CHECK_INPUTS"] = saved if saved is not None else "1"
        # With them, seq_lens are compared on every call.
        with pytest.raises(ValueError, match="seq_lens differs across"):
            dcp.mla_decode(q_nope, q_pe, cache, table, lens + ctx.rank, 0.1)
    dims = mm.MLADims(2, **SMALL)
    weight = torch.randn(2 * 32, SMALL["kv_lora_rank"])
    with pytest.raises(ValueError, match="dcp='yes'; accepted"):
        mm.MLAAttention(dims, 0.1, weight, block_size=4, max_model_len=64, max_num_seqs=2, dcp="yes")
    # Still in step after the errors.
    out = dcp.mla_decode(q_nope, q_pe, cache, table, lens, 0.1)
    assert out.shape == q_nope.shape


CPU_SCENARIOS = {
    "local_positions": scenario_local_positions,
    "decode_matches_single_device": scenario_decode_matches_single_device,
    "empty_requests": scenario_empty_requests,
    "combine_ignores_ranks_without_tokens": scenario_combine_ignores_ranks_without_tokens,
    "context_chunk_gather": scenario_context_chunk_gather,
    "layer_matches_single_device_layer": scenario_layer_matches_single_device_layer,
    "step_keeps_local_decode_inputs": scenario_step_keeps_local_decode_inputs,
    "layer_plans_for_local_lengths": scenario_layer_plans_for_local_lengths,
    "bad_inputs": scenario_bad_inputs,
}


# --------------------------------------------------------------------------- GPU scenarios (NCCL, TRITON)

GPU_SEQ_LENS = [0, 1, 37, 300, 1000, 2, 129]


def scenario_gpu_local_positions(ctx):
    """Ownership on the device: the same answers as on the host, no host round trip needed."""
    for interleave in (1, 4, 16):
        dcp = DecodeContextParallel(interleave=interleave)
        positions = torch.arange(-3, 5000)
        assert torch.equal(dcp.local_positions(positions.to(ctx.device)).cpu(), dcp.local_positions(positions))
        lengths = torch.arange(0, 5000, 7)
        on_device = dcp.local_seq_lens(lengths.to(ctx.device).int())
        assert on_device.device == ctx.device and torch.equal(on_device.cpu(), dcp.local_seq_lens(lengths))


def scenario_gpu_decode(ctx):
    for interleave in (1, 4, 16):
        dcp = DecodeContextParallel(interleave=interleave)
        for q_len in (1, 2):
            check_decode(
                ctx, dcp, dtype=torch.bfloat16, q_len=q_len, kv_lora_rank=512, rope_dim=64, num_local_heads=8,
                block_size=16, seq_lens=GPU_SEQ_LENS, backend="TRITON", tolerance=1e-2, lse_tolerance=2e-2,
                seed=interleave + q_len,
            )
    # DeepSeek's 128 heads in all: the decode over the all-gathered heads takes
    # the sm_90 warpgroup kernel where it can run
    check_decode(
        ctx, DecodeContextParallel(interleave=4), dtype=torch.bfloat16, q_len=1, kv_lora_rank=512, rope_dim=64,
        num_local_heads=128 // ctx.world, block_size=64, seq_lens=GPU_SEQ_LENS, backend="TRITON", tolerance=1e-2,
        lse_tolerance=2e-2, seed=99,
    )
    # A batch of empty requests only: 0 and -inf, never NaN.
    check_decode(
        ctx, DecodeContextParallel(), dtype=torch.bfloat16, q_len=1, kv_lora_rank=512, rope_dim=64,
        num_local_heads=8, block_size=16, seq_lens=[0, 0, 0], backend="TRITON", tolerance=1e-2, lse_tolerance=2e-2,
    )


def scenario_gpu_cuda_graph(ctx):
    """The whole DCP decode (all-gather, TRITON decode, combine kernel, reduce-scatter) captured and replayed."""
    saved = os.environ.get("MLA_MULTI_CHECK_INPUTS")
    os.environ["MLA_MULTI_CHECK_INPUTS"] = "0"  # the data checks read tensors on the host
    try:
        dcp = DecodeContextParallel()
        generator = torch.Generator().manual_seed(11)
        num_local, kv_lora_rank, rope_dim, block_size = 8, 512, 64, 16
        max_len = 600
        rows = random_rows([max_len] * 4, kv_lora_rank + rope_dim, generator)
        _, _, local_cache, local_table = build_caches(dcp, [r.bfloat16() for r in rows], kv_lora_rank, block_size,
                                                      ctx.device, torch.bfloat16, 5)
        q_nope = torch.zeros(4, num_local, kv_lora_rank, dtype=torch.bfloat16, device=ctx.device)
        q_pe = torch.zeros(4, num_local, rope_dim, dtype=torch.bfloat16, device=ctx.device)
        lens = torch.zeros(4, dtype=torch.int32, device=ctx.device)
        scale = 576**-0.5

        def step():
            return dcp.mla_decode(q_nope, q_pe, local_cache, local_table, lens, scale, backend="TRITON",
                                  return_lse=True)

        def fill(trial):
            g = torch.Generator().manual_seed(100 + trial)
            q_nope.copy_(torch.randn(q_nope.shape, generator=g).bfloat16())
            q_pe.copy_(torch.randn(q_pe.shape, generator=g).bfloat16())
            lens.copy_(torch.randint(0, max_len + 1, (4,), generator=g).int())
            if trial == 1:
                lens[1] = 0
                lens[2] = 1

        fill(0)
        step()  # compiles the kernels and creates the communicators outside the capture
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Thread-local capture: the process group's watchdog thread may query events of
        # earlier collectives while this thread captures.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static_out, static_lse = step()
        for trial in range(4):
            fill(trial)
            static_out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            graph_out, graph_lse = static_out.clone(), static_lse.clone()
            eager_out, eager_lse = step()
            assert torch.isfinite(graph_out).all(), trial
            assert torch.equal(graph_out, eager_out) and torch.equal(graph_lse, eager_lse), trial
            # and the graph's answer is the float64 one
            query = torch.cat([all_heads(q_nope, ctx), all_heads(q_pe, ctx)], dim=-1).unsqueeze(1)
            ref_out, _ = naive_decode(query, [r.bfloat16().double()[: int(n)] for r, n in zip(rows, lens.tolist())],
                                      scale, 1, kv_lora_rank)
            heads = slice(ctx.rank * num_local, (ctx.rank + 1) * num_local)
            assert relative_error(graph_out, ref_out.squeeze(1)[:, heads]) < 1e-2, trial
    finally:
        os.environ["MLA_MULTI_CHECK_INPUTS"] = saved if saved is not None else "1"


def all_heads(local, ctx):
    """The layer's heads from every rank's local heads [B, N_local, D] (an all-gather outside DCP)."""
    parts = [torch.empty_like(local) for _ in range(ctx.world)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=1)


def scenario_gpu_layer(ctx):
    check_layer(
        ctx, DecodeContextParallel(), dims_local=mm.MLADims.deepseek_v3(num_heads=8), dtype=torch.bfloat16,
        block_size=16, workspace_tokens=64, tolerance=2e-2, backends="TRITON",
        steps=[[(0, 70), (1, 5), (2, 33)], [(0, 1), (1, 1), (3, 20), (2, 40)], [(3, 1), (0, 1), (1, 1), (2, 1)]],
    )


GPU_SCENARIOS = {
    "local_positions": scenario_gpu_local_positions,
    "decode": scenario_gpu_decode,
    "cuda_graph": scenario_gpu_cuda_graph,
    "layer": scenario_gpu_layer,
}


# --------------------------------------------------------------------------- spawned worlds


def _worker(rank, world, init_file, backend, names, report_dir):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    results = {}
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        scenarios = GPU_SCENARIOS if backend == "nccl" else CPU_SCENARIOS
        failed = False
        for name in names:
            if failed:
                results[name] = "not run: an earlier scenario failed"
                continue
            start = time.time()
            try:
                scenarios[name](Context(rank, world, device))
                results[name] = "ok"
            except Exception:  # noqa: BLE001 - the report carries it to the test
                results[name] = traceback.format_exc()
                failed = True
            results[name + ":seconds"] = round(time.time() - start, 2)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        results["world"] = traceback.format_exc()
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)


@functools.lru_cache(maxsize=None)
def world_reports(backend: str, world: int) -> tuple[dict, ...]:
    names = list(GPU_SCENARIOS if backend == "nccl" else CPU_SCENARIOS)
    report_dir = tempfile.mkdtemp(prefix=f"mla_dcp_{backend}{world}_")
    init_file = os.path.join(report_dir, "rendezvous")
    context = torch.multiprocessing.start_processes(
        _worker, args=(world, init_file, backend, names, report_dir), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.time() + 400
    try:
        while not context.join(timeout=max(1.0, deadline - time.time())):
            if time.time() > deadline:
                break
    except Exception as error:  # noqa: BLE001 - a crashed process leaves its report missing
        print(f"spawned world failed: {error}")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    reports = []
    for rank in range(world):
        path = os.path.join(report_dir, f"rank{rank}.json")
        reports.append(json.load(open(path)) if os.path.exists(path) else {"world": f"rank {rank} wrote no report"})
    return tuple(reports)


def assert_scenario(backend: str, world: int, name: str) -> None:
    reports = world_reports(backend, world)
    problems = [
        f"rank {rank}: {report.get(name) or report.get('world')}"
        for rank, report in enumerate(reports)
        if report.get(name) != "ok"
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"gloo{w}")
@pytest.mark.parametrize("name", list(CPU_SCENARIOS))
def test_gloo(name, world):
    assert_scenario("gloo", world, name)


def _fewer_than_two_gpus() -> bool:
    return torch.cuda.device_count() < 2


@pytest.mark.gpu
@pytest.mark.skipif(_fewer_than_two_gpus(), reason="needs 2 GPUs for a 2-process NCCL group")
@pytest.mark.parametrize("name", list(GPU_SCENARIOS))
def test_nccl(name):
    assert_scenario("nccl", 2, name)


def test_not_initialised_is_an_error():
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        DecodeContextParallel()


def test_bench_dcp_runs_on_the_cpu(tmp_path, capsys):
    """`mla-multi bench dcp --device cpu`: the benchmark's processes, groups and report over gloo."""
    from mla_multi.benchmarks import dcp as bench

    report = tmp_path / "dcp.json"
    code = bench.main(["--device", "cpu", "--cases", "2x40", "--heads", "4", "--world-sizes", "1,2",
                       "--iterations", "2", "--block-size", "4", "--json", str(report)])
    assert code == 0
    assert "collect. us" in capsys.readouterr().out
    rows = {row["world"]: row for row in json.loads(report.read_text())["rows"]}
    assert set(rows) == {1, 2}
    assert rows[1]["local_tokens"] == 40 and rows[2]["local_tokens"] == 20
    assert rows[2]["cache_bytes"] * 2 == rows[1]["cache_bytes"]
    assert rows[1]["collectives_us"] == 0 and rows[2]["collectives_us"] > 0
    assert rows[2]["heads_per_gpu"] == 2 and rows[1]["speedup"] == 1.0
