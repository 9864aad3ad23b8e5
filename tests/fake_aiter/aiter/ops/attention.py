"""aiter's persistent-MLA metadata and reduce functions with the v0.1.20.post1 signatures (../../contract.json).

`get_ps_metadata_v1` (the FP8 prefill's planner) is computed: its work lists and reduce maps are what
`mla_prefill_ps_asm_fwd` and `mla_reduce_v1` then follow, so which rows are reduced (and get a final LSE)
is the plan's. The decode metadata is modelled, not computed: `get_mla_metadata_v1` checks its
buffers against the sizes `get_mla_metadata_info_v1` gives, stamps
`work_metadata_ptrs` and remembers for which qo / kv indptr values it was
built, so that `mla_decode_fwd` can tell metadata of another step (or none).
With `topk >= 0` (aiter's sparse metadata) the plan records topk: every query
token is then a batch of its own whose kv_indices start at token * topk and
hold min(its request's kv length, topk) entries (csrc/kernels/mla/metadata/
v1_2_device.cuh), which `mla_decode_fwd` follows.
"""

import enum
import math

import torch

from aiter import _model

CALLS = []
# stamp -> what get_mla_metadata_v1 was called with
PLANS: dict = {}


class MlaVersion(enum.Enum):
    V32 = 32


def get_mla_metadata_info_v1(
    batch_size: int,
    max_seqlen_qo: int,
    num_head_qo: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    is_sparse: bool,
    fast_mode: bool = True,
    num_kv_splits: int = 32,
    intra_batch_mode: bool = False,
    max_split_per_batch: int = -1,
):
    assert num_head_qo % 8 == 0
    CALLS.append(dict(function="get_mla_metadata_info_v1", batch_size=batch_size, max_seqlen_qo=max_seqlen_qo,
                      num_head_qo=num_head_qo, is_sparse=is_sparse, fast_mode=fast_mode))
    max_splits = _model.get_cu_num()
    seqlen = 1 if is_sparse else max_seqlen_qo
    tiles = math.ceil(seqlen * num_head_qo / 16)
    batch = batch_size * max_seqlen_qo if is_sparse else batch_size
    tile_cnt = batch * tiles
    if fast_mode:
        max_work = (batch + max_splits - 1) * tiles
        max_split_tiles = min(batch + max_splits - 1, (max_splits - 1) * 2) * tiles
    else:
        max_work = max_split_tiles = tile_cnt * max_splits
    return (
        ((2), torch.uint64),
        ((max_splits + 1), torch.int32),
        ((max_work, 8), torch.int32),
        ((tile_cnt + 1), torch.int32),
        ((tile_cnt, 2), torch.int32),
        (max_split_tiles, torch.int32),
    )


def get_mla_metadata_v1(
    seqlens_qo_indptr: torch.Tensor,
    seqlens_kv_indptr: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    num_heads_per_head_k: int,
    num_heads_k: int,
    is_causal: bool,
    work_metadata_ptrs: torch.Tensor,
    work_info_set: torch.Tensor,
    work_indptr: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor,
    reduce_partial_map: torch.Tensor,
    page_size: int = 1,
    kv_granularity: int = 16,
    max_seqlen_qo: int = -1,
    uni_seqlen_qo: int = -1,
    fast_mode: bool = True,
    topk: int = -1,
    max_split_per_batch: int = -1,
    intra_batch_mode: bool = False,
    is_cp_round_robin: bool = False,
    mla_version: int = MlaVersion.V32.value,
    dtype_q_nope: torch.dtype | None = None,
    dtype_q_rope: torch.dtype | None = None,
    dtype_kv_nope: torch.dtype | None = None,
    dtype_kv_rope: torch.dtype | None = None,
    dtype_q: torch.dtype | None = None,
    dtype_kv: torch.dtype | None = None,
) -> None:
    for name, tensor in (("seqlens_qo_indptr", seqlens_qo_indptr), ("seqlens_kv_indptr", seqlens_kv_indptr),
                         ("kv_last_page_lens", kv_last_page_lens)):
        assert tensor.dtype == torch.int32, (name, tensor.dtype)
    batch = seqlens_qo_indptr.numel() - 1
    assert seqlens_kv_indptr.numel() == batch + 1 and kv_last_page_lens.numel() == batch
    assert num_heads_k == 1 and page_size == 1
    qo = seqlens_qo_indptr.tolist()
    seqlen = max(max_seqlen_qo, 1)
    specs = get_mla_metadata_info_v1(batch, seqlen, num_heads_per_head_k * num_heads_k, dtype_q, dtype_kv,
                                     topk > 0, fast_mode)
    CALLS.pop()
    for name, tensor, (shape, dtype) in zip(
            ("work_metadata_ptrs", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
             "reduce_partial_map"),
            (work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map),
            specs):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        assert tensor.dtype == dtype, (name, tensor.dtype, dtype)
        if name in ("work_metadata_ptrs", "work_indptr"):
            assert tuple(tensor.shape) == shape, (name, tuple(tensor.shape), shape)
        else:  # sized for at least this batch
            assert tensor.shape[0] >= shape[0] and tuple(tensor.shape[1:]) == shape[1:], (name, tensor.shape, shape)
    if uni_seqlen_qo > 0:
        assert all(qo[i + 1] - qo[i] == uni_seqlen_qo for i in range(batch)), (qo, uni_seqlen_qo)
    stamp = len(PLANS) + 1
    PLANS[stamp] = dict(qo=qo, kv=seqlens_kv_indptr.tolist(), heads=num_heads_per_head_k, causal=bool(is_causal),
                        max_seqlen_qo=max_seqlen_qo, kv_granularity=kv_granularity, dtype_q=dtype_q,
                        dtype_kv=dtype_kv, topk=topk)
    if topk >= 0:  # aiter's sparse metadata: every query token a batch, qo lengths uniform
        lengths = {qo[i + 1] - qo[i] for i in range(batch)}
        assert len(lengths) <= 1, ("the sparse metadata takes uniform query lengths", qo)
    work_metadata_ptrs.view(torch.int64)[0] = stamp
    work_info_set.fill_(-1)
    CALLS.append(dict(function="get_mla_metadata_v1", stamp=stamp, heads=num_heads_per_head_k,
                      kv_granularity=kv_granularity, fast_mode=fast_mode, page_size=page_size, topk=topk))


def mla_reduce_v1(
    partial_output: torch.Tensor,
    partial_lse: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor | None,
    reduce_partial_map: torch.Tensor,
    max_seqlen_q: int,
    num_kv_splits: int,
    final_output: torch.Tensor,
    final_lse: torch.Tensor | None = None,
) -> None:
    """The merge of the prefill's partial tiles (as mla_prefill_ps_fwd calls it: rows of `max_seqlen_q` = the
    query tile from each partial location). Group g merges partials reduce_partial_map[reduce_indptr[g]:
    reduce_indptr[g + 1]] into rows reduce_final_map[g] = [qo_start, qo_end); rows of no group (a tile one
    workgroup finished: the kernel wrote its output itself) are not touched, nor is their final_lse."""
    indptr = reduce_indptr.tolist()
    final_map = reduce_final_map.tolist()
    partial_map = reduce_partial_map.tolist()
    groups = 0
    for g in range(len(final_map)):
        first, last = indptr[g], indptr[g + 1]
        if last <= first:
            continue
        groups += 1
        qo_start, qo_end = final_map[g]
        assert qo_end - qo_start <= max_seqlen_q, ("a reduce group longer than the tile", qo_start, qo_end)
        locs, rows = partial_map[first:last], qo_end - qo_start
        lses = torch.stack([partial_lse[loc:loc + rows].double() for loc in locs])  # [P, rows, N]
        outs = torch.stack([partial_output[loc:loc + rows].double() for loc in locs])  # [P, rows, N, V]
        top = lses.max(dim=0).values
        safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weights = torch.exp(lses - safe)  # a partial of LSE -inf weighs 0
        total = weights.sum(dim=0)
        merged = (weights.unsqueeze(-1) * torch.nan_to_num(outs)).sum(dim=0) / total.clamp_min(1e-300).unsqueeze(-1)
        final_output[qo_start:qo_end] = merged.to(final_output.dtype)
        if final_lse is not None:
            final_lse[qo_start:qo_end] = torch.where(total > 0, safe + torch.log(total),
                                                     torch.full_like(total, float("-inf"))).float()
    CALLS.append(dict(function="mla_reduce_v1", groups=groups, max_seqlen_q=max_seqlen_q,
                      final_lse=final_lse is not None))


def _unpack_heads(packed: int) -> tuple[int, int]:
    return packed & 0xFFFF, packed >> 16


def mla_prefill_ps_asm_fwd(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    work_indptr: torch.Tensor | None,
    work_info_set: torch.Tensor | None,
    max_seqlen_q: int,
    softmax_scale: float,
    is_causal: bool,
    splitData: torch.Tensor,
    splitLse: torch.Tensor,
    output: torch.Tensor,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The FP8 persistent prefill kernel (csrc/py_itfs_cu/asm_mla.cu): Q [T, Hq, Dqk], K [pages, Hk, Dqk],
    V [pages, Hk, Dv] FP8 with fp32 per-tensor scales, one token a page. Every workgroup runs its works
    (work_info_set rows: batch, partial location or -1, qo_start, qo_end, kv_start, kv_end (pages), kv_offset,
    query heads); a work of location -1 writes its rows of `output` (bf16), any other its partial rows of
    splitData / splitLse. Numerics: q.k in float64 over the dequantised values times softmax_scale, the
    probabilities exp(s - max) rounded to Q's FP8 type before they multiply V (the kernel's FP8 PV product),
    their sum taken before rounding."""
    arch = _model.get_gfx()
    if Q.dtype not in _model.FP8:
        raise _model.AiterError(f"mla_prefill_ps_asm_fwd: unsupport Q dtype: {Q.dtype}")
    if K.dtype not in _model.FP8:
        raise _model.AiterError(f"mla_prefill_ps_asm_fwd: unsupport K dtype: {K.dtype}")
    if arch == "gfx942":
        raise _model.AiterError("mla_prefill_ps_asm_fwd: fp8 mla persistent prefill is not supported on gfx942")
    num_heads_q, num_heads_k = Q.shape[1], K.shape[1]
    gqa = num_heads_q // num_heads_k
    row = None
    for entry in _model.kernel_table(arch):
        if (entry["q"], entry["kv"], entry["gqa"], entry["ps"], entry["prefill"], entry["causal"]) == (
                "fp8", "fp8", gqa, 1, 1, int(bool(is_causal))):
            row = entry
            break
    if row is None:
        raise _model.AiterError("mla_prefill_ps_asm_fwd: cannot find suitable kernel")
    assert work_indptr is not None and work_info_set is not None, "the persistent prefill takes its work lists"
    assert Q.shape[2] == K.shape[2] and V.shape[:2] == K.shape[:2], (Q.shape, K.shape, V.shape)
    assert tuple(output.shape) == (Q.shape[0], num_heads_q, V.shape[2]), (output.shape, Q.shape, V.shape)
    plan = PS_PLANS.get(_stamp(work_info_set))
    assert plan is not None, "work_info_set was not filled by get_ps_metadata_v1"
    scales = [1.0 if s is None else float(s.reshape(-1)[0]) for s in (q_scale, k_scale, v_scale)]
    queries = Q.double() * scales[0]
    keys = K.double() * scales[1]
    values = V.double() * scales[2]
    pages = kv_page_indices.long()
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    works = work_info_set.tolist()
    count = int(work_indptr[-1])
    for w in range(count):
        batch, loc, qo_start, qo_end, kv_start, kv_end, _, heads = works[w]
        h0, h1 = _unpack_heads(heads)
        q_len, kv_len = qo[batch + 1] - qo[batch], kv[batch + 1] - kv[batch]
        rows = torch.arange(qo_start, qo_end) - qo[batch]  # query positions in the request
        cols = torch.arange(kv_start, kv_end) - kv[batch]  # key positions (one token a page)
        k_rows = keys[pages[kv_start:kv_end], h0 // gqa]  # [n, Dqk]
        v_rows = values[pages[kv_start:kv_end], h0 // gqa]
        scores = torch.einsum("thd,nd->thn", queries[qo_start:qo_end, h0:h1], k_rows) * softmax_scale
        if is_causal:
            visible = cols.view(1, 1, -1) <= (rows + kv_len - q_len).view(-1, 1, 1)
            scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.max(dim=-1, keepdim=True).values
        safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        probs = torch.exp(scores - safe)
        total = probs.sum(dim=-1, keepdim=True)
        rounded = probs.to(Q.dtype).double()  # the FP8 P of the PV product
        out = torch.einsum("thn,nd->thd", rounded, v_rows) / total.clamp_min(1e-300)
        lse = torch.where(total > 0, safe + torch.log(total), torch.full_like(total, float("-inf"))).squeeze(-1)
        if loc < 0:
            output[qo_start:qo_end, h0:h1] = out.to(output.dtype)
        else:
            splitData[loc:loc + qo_end - qo_start, h0:h1] = out.float()
            splitLse[loc:loc + qo_end - qo_start, h0:h1] = lse.float()
    CALLS.append(dict(function="mla_prefill_ps_asm_fwd", kernel=row["kernel"], causal=bool(is_causal),
                      softmax_scale=softmax_scale, scales=scales, works=count, q_dtype=Q.dtype, k_dtype=K.dtype))


# stamp -> what get_ps_metadata_v1 planned
PS_PLANS: dict = {}


# work_info's data pointer -> the stamp of the plan last written there
PS_LAST: dict = {}


def _stamp(work_info: torch.Tensor) -> int:
    return int(PS_LAST.get(work_info.data_ptr(), 0))


def get_ps_metadata_info_v1(
    batch_size: int,
    num_head_k: int,
    max_qlen: int,
    qlen_granularity: int = 256,
):
    """Buffer sizes for get_ps_metadata_v1, as aiter computes them from the device's compute units."""
    cu_num = _model.get_cu_num()
    cus_per_cluster = cu_num // math.gcd(num_head_k, cu_num)
    splits = math.ceil(max_qlen / qlen_granularity)
    tiles = batch_size * splits
    max_works = (batch_size + cus_per_cluster - 1) * splits * num_head_k
    max_partials = min(batch_size + cus_per_cluster - 1, (cus_per_cluster - 1) * 2) * splits
    CALLS.append(dict(function="get_ps_metadata_info_v1", batch_size=batch_size, num_head_k=num_head_k,
                      max_qlen=max_qlen, qlen_granularity=qlen_granularity))
    return (
        (2, torch.uint64),
        (cu_num + 1, torch.int32),
        ((max_works, 8), torch.int32),
        (tiles + 1, torch.int32),
        ((tiles, 2), torch.int32),
        (max_partials, torch.int32),
    )


def get_ps_metadata_v1(
    seqlens_qo_indptr: torch.Tensor,
    pages_kv_indptr: torch.Tensor,
    context_lens: torch.Tensor,
    gqa_ratio: int,
    num_heads_k: int,
    work_metadata_ptrs: torch.Tensor,
    work_indptr: torch.Tensor,
    work_info: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor,
    reduce_partial_map: torch.Tensor,
    qhead_granularity: int = 1,
    qlen_granularity: int = 256,
    kvlen_granularity: int = 16,
    block_size: int = 16,
    is_causal: bool = True,
) -> None:
    """The host planner of the FP8 prefill (csrc/kernels/mla/metadata/v1_2_host.cuh), modelled: the query of
    each request cut into tiles of qlen_granularity (taken head, tail, head, ...), each tile's keys (up to the
    causal edge) counted in units of kvlen_granularity; the heads' clusters (gcd(num_heads_k, CUs)) each deal
    the units evenly over their workgroups, a tile one workgroup finishes from its start is written directly
    (location -1), every other piece gets a partial location (qlen_granularity rows each); the reduce maps
    group the partial locations by tile. A plan larger than its buffers is an AiterError (aiter would write
    past them)."""
    assert kvlen_granularity % block_size == 0, (kvlen_granularity, block_size)
    qo, pages, ctx = seqlens_qo_indptr.tolist(), pages_kv_indptr.tolist(), context_lens.tolist()
    batch = len(qo) - 1
    cu_num = _model.get_cu_num()
    clusters = math.gcd(num_heads_k, cu_num)
    tgs = cu_num // clusters
    heads_per_cluster = num_heads_k // clusters
    blocks_per_unit = kvlen_granularity // block_size
    tiles, total_units = [], 0
    for b in range(batch):
        q_len, kv_len = qo[b + 1] - qo[b], ctx[b]
        ranges = [(s, min(s + qlen_granularity, q_len)) for s in range(0, q_len, qlen_granularity)]
        n = len(ranges)
        for i in range(n):
            start, end = ranges[i // 2 if i % 2 == 0 else n - 1 - i // 2]
            effective = min(kv_len - q_len + end, kv_len) if is_causal else kv_len
            units = -(-effective // kvlen_granularity)
            tiles.append((b, qo[b] + start, qo[b] + end, units * blocks_per_unit, effective))
            total_units += units
    average, remainder = divmod(total_units, tgs)
    works, indptr = [], [0] * (cu_num + 1)
    partial_count = 0
    for cluster in range(clusters):
        tile_idx = block_idx = partial_idx = 0
        for tg in range(tgs):
            saved = (tile_idx, block_idx, partial_idx)
            for offset in range(heads_per_cluster):
                k_head = cluster * heads_per_cluster + offset
                heads = (k_head * qhead_granularity) | (((k_head + 1) * qhead_granularity) << 16)
                tile_idx, block_idx, partial_idx = saved
                capacity = (average + (1 if tg < remainder else 0)) * blocks_per_unit
                while tile_idx < len(tiles) and capacity > 0:
                    b, qo_start, qo_end, blocks, effective = tiles[tile_idx]
                    kv_start = block_idx + pages[b]
                    if effective - block_idx * block_size <= capacity * block_size:
                        used = blocks - block_idx
                        loc = -1 if block_idx == 0 else qlen_granularity * partial_idx
                        partial_idx += block_idx != 0
                        works.append([b, loc, qo_start, qo_end, kv_start, min(kv_start + used, pages[b + 1]), 0, heads])
                        tile_idx, block_idx = tile_idx + 1, 0
                    else:
                        used = capacity
                        loc = qlen_granularity * partial_idx
                        partial_idx += 1
                        kv_end = min(kv_start + used, pages[b + 1])
                        works.append([b, loc, qo_start, qo_end, kv_start, kv_end,
                                      ctx[b] - (kv_end - pages[b]) * block_size, heads])
                        block_idx += used
                    capacity -= used
            indptr[cluster * tgs + tg + 1] = len(works)
        partial_count = max(partial_count, partial_idx)
    groups: dict = {}
    for work in works:
        if work[1] >= 0:
            groups.setdefault((work[2], work[3]), set()).add(work[1])
    if len(works) > work_info.shape[0]:
        raise _model.AiterError(f"get_ps_metadata_v1: {len(works)} works for a work_info of {work_info.shape[0]} rows")
    partials = sum(len(v) for v in groups.values())
    if partials > reduce_partial_map.shape[0] or len(groups) > reduce_final_map.shape[0]:
        raise _model.AiterError(f"get_ps_metadata_v1: {partials} partial tiles in {len(groups)} groups for "
                                f"reduce buffers of {reduce_partial_map.shape[0]} / {reduce_final_map.shape[0]}")
    work_indptr.copy_(torch.tensor(indptr, dtype=torch.int32))
    work_info.zero_()
    if works:
        work_info[:len(works)] = torch.tensor(works, dtype=torch.int32)
    flat_indptr, finals, locs = [0], [], []
    for key in sorted(groups):
        locs += sorted(groups[key])
        finals.append(list(key))
        flat_indptr.append(len(locs))
    flat_indptr += [len(locs)] * (reduce_indptr.shape[0] - len(flat_indptr))
    reduce_indptr.copy_(torch.tensor(flat_indptr[:reduce_indptr.shape[0]], dtype=torch.int32))
    reduce_final_map.zero_()
    if finals:
        reduce_final_map[:len(finals)] = torch.tensor(finals, dtype=torch.int32)
    reduce_partial_map.zero_()
    if locs:
        reduce_partial_map[:len(locs)] = torch.tensor(locs, dtype=torch.int32)
    stamp = len(PS_PLANS) + 1
    PS_PLANS[stamp] = dict(qo=qo, kv=pages, causal=bool(is_causal), partial_tiles=partial_count)
    PS_LAST[work_info.data_ptr()] = stamp
    work_metadata_ptrs.view(torch.int64)[0] = stamp
    CALLS.append(dict(function="get_ps_metadata_v1", stamp=stamp, works=len(works), groups=len(groups),
                      partials=partials, gqa_ratio=gqa_ratio, num_heads_k=num_heads_k,
                      qhead_granularity=qhead_granularity, qlen_granularity=qlen_granularity,
                      kvlen_granularity=kvlen_granularity, block_size=block_size, is_causal=bool(is_causal)))


def hk_mla_v40_decode_fwd(
    query: torch.Tensor,
    query_rope: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_buffer_rope: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    work_indptr: torch.Tensor,
    work_info_set: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    split_output: torch.Tensor,
    split_lse: torch.Tensor,
    final_output: torch.Tensor,
    attn_sink: torch.Tensor | None = None,
) -> None:
    if _model.get_gfx() not in ("gfx942", "gfx950"):
        raise NotImplementedError(f"hk_mla_v40_decode_fwd has no implementation for arch {_model.get_gfx()}")
    raise NotImplementedError("hk_mla_v40_decode_fwd: not modelled by the stand-in aiter")
