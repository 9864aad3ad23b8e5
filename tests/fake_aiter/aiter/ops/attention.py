"""aiter's persistent-MLA metadata and reduce functions with the v0.1.20.post1 signatures (../../contract.json).

The metadata is modelled, not computed: `get_mla_metadata_v1` checks its
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
    raise NotImplementedError("the stand-in aiter merges inside mla_decode_fwd")


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
    raise NotImplementedError("not modelled by the stand-in aiter")


# aiter's FP8 MLA prefill planner (gfx950): not modelled; ROCM_AITER declines FP8 prefill with a reason
# (AiterMLAPrefillBackend.validate_configuration), so nothing here is called.
def get_ps_metadata_info_v1(
    batch_size: int,
    num_head_k: int,
    max_qlen: int,
    qlen_granularity: int = 256,
):
    raise NotImplementedError("not modelled by the stand-in aiter")


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
    raise NotImplementedError("not modelled by the stand-in aiter")
