"""ROCM_AITER: AMD's aiter kernels for MLA on MI300 (gfx942) and MI350 (gfx950).

This module follows aiter v0.1.20.post1 (AITER_SOURCE_COMMIT): the functions
it calls (`AITER_CALLS`) and aiter's MLA decode kernel tables
(`AITER_DECODE_KERNELS`, from `hsa/<arch>/mla/mla_asm.csv`).

* Decode calls `aiter.mla.mla_decode_fwd`, whose assembly kernels read the
  latent cache with a page size of 1: the paged cache
  `[num_blocks, block_size, 576]` is viewed as `[num_blocks * block_size, 1, 1, 576]`.
  `aiter_decode_route` decides, from the kernel tables and aiter's dispatch
  of heads and query tokens onto them, how a configuration runs: on the
  persistent path where aiter has a persistent kernel (as vLLM's
  ROCM_AITER_MLA), else on the split-KV path; with the heads as they are
  (8, 16, 32, 64, 128; aiter folds 48-112 into groups of 16) or padded with
  zero queries; with the LSE only where the kernel writes it. `plan` builds,
  once per step for every layer, the page-1 token indices over the valid
  tokens (fixed buffers, -1 past them, nothing read back from the device)
  and aiter's persistent metadata (`get_mla_metadata_v1`), into buffers
  sized once at reservation (`get_mla_metadata_info_v1`).
* Prefill calls `aiter.flash_attn_varlen_func` (CK / assembly flash attention)
  with qk head dim 192 and v head dim 128, returning the LSE as `[N, T]`; a
  sink goes to aiter as `sink_ptr`. With FP8 keys and values on gfx950 (a
  `PrefillSelectorConfig` of the platform's FP8 dtype) it runs aiter's FP8 MLA
  prefill instead: `get_ps_metadata_v1` plans the step on the host (one read
  of cu_seqlens a call), `mla_prefill_ps_asm_fwd` runs the persistent kernel
  and `mla_reduce_v1` merges the tiles split across workgroups; k / v come
  with per-tensor scales, the query is quantised here per tensor (amax / 448,
  aiter's per_tensor_quant rule), the output is bfloat16. New tokens only (no
  cached context) and no LSE: the reduce writes the final LSE only for the
  tiles it merges. gfx942 is refused by aiter itself.
* The DeepSeek-V4 contract is declined (`_v4_reasons`): aiter's V4 decode
  kernels (`mla_v40_decode_fwd`, `mla_decode_fwd_v4_nm`) take their own FP8
  packed layouts and differ from the contract in ways a conversion cannot
  hide (the experimental switch, one cache a call, an FP8 query, a fixed
  softmax scale, no final LSE); see docs/v4.md.

What the installed aiter can run is decided from the installed aiter itself
(the parameters of its functions, `inspect.signature`, and the architectures
it ships MLA kernel objects for) and from the kernel tables. Every
configuration it cannot run is a reason naming the aiter version and the
platform, so the registry falls back to the next backend instead of
crashing inside aiter.

The softmax scale is always passed: aiter defaults to 1/sqrt(576), which is
wrong for MLA (the scale belongs to the 192-wide qk head of the model).

Decode LSE: aiter's one-split paths (the split-KV kernel with one split
returns the output early, or its second stage copies it) leave the final LSE
unwritten, and a persistent call with `return_lse` needs an LSE kernel in the
tables. The adapter asks for the LSE only on a route whose kernel writes it
(`AiterDecodeRoute.lse`; the split-KV path with at least two splits), returns
None elsewhere, and declines a `DecodeSelectorConfig(needs_lse=True)` there.

Sparse MLA (DeepSeek Sparse Attention, phases sparse_decode and
sparse_prefill) also runs on `mla_decode_fwd`'s split-KV path: every query
token is a request of its own (`qo_indptr = arange(T + 1)`), the cache is
viewed with page size 1 and a token's valid indices, compacted in order on
the device, are its `kv_indices` (`sparse_kv_indices`); at least two splits,
so the LSE (and the attention sink applied from it) is written. Where aiter
has a persistent bfloat16 kernel that writes the LSE for the heads (gfx950,
all heads but 8), it runs instead on aiter's persistent sparse metadata
(`get_mla_metadata_info_v1(is_sparse=True)`, `get_mla_metadata_v1(topk=)`,
as aiter's op_tests/test_mla_sparse.py): token t's valid indices are
compacted into kv_indices[t * topk:] (`sparse_kv_indices(by_token=True)`)
and mla_decode_fwd gets an explicit num_kv_splits, so aiter's batch gate
never sends it to the split-KV path, which would ignore the topk layout.
bfloat16 caches only. A sink passed to an aiter without `return_lse` is a
ValueError at the call. See `AiterSparseDecodeImpl`.

`AITER_CALLS` records, declaratively, every aiter function this module calls
and the keyword arguments it passes; the test suite checks it against aiter's
source (tests/fake_aiter/contract.json, or a wheel or checkout given).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import pathlib
import threading
from typing import Any, ClassVar

import torch

from mla_multi import errors
from mla_multi.backends.base import (
    FP8_DTYPES,
    DecodeSelectorConfig,
    MLADecodeBackend,
    MLADecodeImpl,
    MLAPrefillBackend,
    MLAPrefillImpl,
    MLASparseBackend,
    MLASparseImpl,
    PrefillSelectorConfig,
    SparseSelectorConfig,
    dtype_name,
    prefill_lse_heads_tokens,
)
from mla_multi.metadata import to_device
from mla_multi.platforms import Platform

# --------------------------------------------------------------------------- the calls made into aiter


@dataclasses.dataclass(frozen=True)
class AiterCall:
    """One aiter function this backend calls, and how.

    `source` is the file of the published aiter package that defines
    `function`; `keywords` are always passed (every argument is passed by
    keyword); `optional_keywords` are passed only when the installed
    signature has them.
    """

    module: str
    function: str
    source: str
    keywords: tuple[str, ...]
    optional_keywords: tuple[str, ...] = ()


MLA_DECODE_FWD = AiterCall(
    module="aiter.mla",
    function="mla_decode_fwd",
    source="aiter/mla.py",
    keywords=(
        "q",
        "kv_buffer",
        "o",
        "qo_indptr",
        "kv_indptr",
        "kv_indices",
        "kv_last_page_lens",
        "max_seqlen_q",
        "page_size",
        "nhead_kv",
        "sm_scale",
        "num_kv_splits",
        "causal",
    ),
    # the persistent path's buffers (get_mla_metadata_v1 fills them), the a8w8 scales, and the LSE where a kernel
    # writes it
    optional_keywords=(
        "work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map", "reduce_partial_map",
        "q_scale", "kv_scale", "return_lse",
    ),
)

GET_MLA_METADATA_INFO_V1 = AiterCall(
    module="aiter",
    function="get_mla_metadata_info_v1",
    source="aiter/ops/attention.py",
    keywords=("batch_size", "max_seqlen_qo", "num_head_qo", "q_dtype", "kv_dtype", "is_sparse", "fast_mode"),
)

GET_MLA_METADATA_V1 = AiterCall(
    module="aiter",
    function="get_mla_metadata_v1",
    source="aiter/ops/attention.py",
    keywords=(
        "seqlens_qo_indptr", "seqlens_kv_indptr", "kv_last_page_lens", "num_heads_per_head_k", "num_heads_k",
        "is_causal", "work_metadata_ptrs", "work_info_set", "work_indptr", "reduce_indptr", "reduce_final_map",
        "reduce_partial_map", "page_size", "kv_granularity", "max_seqlen_qo", "uni_seqlen_qo", "fast_mode",
        "dtype_q", "dtype_kv",
    ),
)

FLASH_ATTN_VARLEN_FUNC = AiterCall(
    module="aiter",
    function="flash_attn_varlen_func",
    source="aiter/ops/mha.py",
    keywords=(
        "q",
        "k",
        "v",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
        "softmax_scale",
        "causal",
        "return_lse",
    ),
    # the attention sink, where the caller gives one (one logit a head)
    optional_keywords=("sink_ptr",),
)

# Sparse MLA: the same function with one request per query token over the
# page-size-1 cache, non-persistent, at least two splits (so that aiter's
# second stage writes the LSE: see `_non_persistent_splits`).
SPARSE_MLA_DECODE_FWD = dataclasses.replace(
    MLA_DECODE_FWD,
    keywords=("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens", "max_seqlen_q",
              "sm_scale", "num_kv_splits"),
    optional_keywords=("return_lse",),
)

# Sparse MLA on aiter's persistent sparse metadata (as aiter's op_tests/test_mla_sparse.py runs it): the
# buffers sized with is_sparse=True, the work planned with topk= (each query token a batch of its own whose
# kv_indices start at token * topk and hold min(its kv length, topk) entries), and mla_decode_fwd given an
# explicit num_kv_splits (aiter's batch gate then never sends it to the split-KV path, which cannot honour topk).
SPARSE_GET_MLA_METADATA_INFO_V1 = dataclasses.replace(
    GET_MLA_METADATA_INFO_V1, keywords=GET_MLA_METADATA_INFO_V1.keywords + ("num_kv_splits",))
SPARSE_GET_MLA_METADATA_V1 = dataclasses.replace(
    GET_MLA_METADATA_V1, keywords=GET_MLA_METADATA_V1.keywords + ("topk", "max_split_per_batch"))
SPARSE_PERSISTENT_MLA_DECODE_FWD = dataclasses.replace(
    MLA_DECODE_FWD,
    keywords=("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens", "max_seqlen_q",
              "page_size", "nhead_kv", "sm_scale", "num_kv_splits", "work_meta_data", "work_indptr",
              "work_info_set", "reduce_indptr", "reduce_final_map", "reduce_partial_map", "return_lse"),
    optional_keywords=(),
)
# Splits a token's list may take on the persistent sparse path (aiter's op test passes the same number as
# get_mla_metadata_info_v1's num_kv_splits, get_mla_metadata_v1's max_split_per_batch and mla_decode_fwd's
# num_kv_splits).
AITER_SPARSE_PERSISTENT_SPLITS = 16

AITER_CALLS: tuple[AiterCall, ...] = (
    MLA_DECODE_FWD, GET_MLA_METADATA_INFO_V1, GET_MLA_METADATA_V1, FLASH_ATTN_VARLEN_FUNC, SPARSE_MLA_DECODE_FWD,
    SPARSE_GET_MLA_METADATA_INFO_V1, SPARSE_GET_MLA_METADATA_V1, SPARSE_PERSISTENT_MLA_DECODE_FWD,
)

# The aiter release whose source this module follows (its kernel tables below, its signatures above).
AITER_SOURCE_TAG = "v0.1.20.post1"
AITER_SOURCE_COMMIT = "de07f3885ee5f2030ba72b6cc5940d674fd457cf"

# Architectures aiter builds its MLA and flash-attention kernels for; used when
# the installed package's kernel inventory cannot be located.
AITER_ARCHS: tuple[str, ...] = ("gfx942", "gfx950")
# Head counts aiter's decode kernel tables hold; any other count is padded with
# zero queries up to a multiple of 16 (fewer than 16: to 16), which costs compute
# but no KV traffic; aiter's persistent path folds 48, 80, 96 and 112 heads into
# groups of 16 itself.
AITER_DECODE_NATIVE_NUM_HEADS: tuple[int, ...] = (8, 16, 32, 64, 128)
AITER_DECODE_PADDED_NUM_HEADS = 16
AITER_DECODE_MAX_NUM_HEADS = 128
# Query tokens a request: aiter's tables hold 1, 2 and 4 (3 runs on the 4-token
# kernels), and on gfx950 the persistent path folds longer ones onto them.
AITER_DECODE_MAX_QUERY_LEN = 8
# The kernels compute a 576-wide qk (512 latent + 64 rope) and a 512-wide v.
AITER_DECODE_KV_LORA_RANK = 512
AITER_DECODE_QK_ROPE_HEAD_DIM = 64
# The split count passed to the non-persistent kernel (vLLM's choice before the
# persistent path): at least two, so that aiter's second stage merges the
# splits and writes the LSE (with one split it copies the output, or returns
# it early, and leaves the LSE unwritten).
AITER_NON_PERSISTENT_SPLITS = 16
# CK flash attention handles head dims up to 256.
AITER_PREFILL_MAX_HEAD_DIM = 256
# kv_indices are int32 slot numbers of the page-size-1 view.
_MAX_INT32 = 2**31 - 1
# FP8 MLA decode kernels in aiter's source that a sparse FP8 path could build
# on, looked up by name in the installed package (none is called here):
# HipKittens' DeepSeek V3.2 decode (FP8 query and cache, heads x query tokens
# 128, gfx942 / gfx950, reached through mla_decode_fwd's persistent path;
# `hk_mla_decode_fwd` in older sources) and the gfx950 DSA V3.2 decode over
# separate FP8 NoPE / bf16 RoPE buffers with E8M0 block scales.
AITER_SPARSE_FP8_KERNELS: tuple[str, ...] = ("hk_mla_v32_decode_fwd", "hk_mla_decode_fwd", "mla_decode_fwd_ds32")

# aiter's FP8 MLA prefill at AITER_SOURCE_COMMIT: `aiter.mla.mla_prefill_ps_fwd` runs `mla_prefill_ps_asm_fwd`
# over work planned on the host by `get_ps_metadata_v1` (buffers sized by `get_ps_metadata_info_v1`) and merges
# the partial tiles (256 query rows each) with `mla_reduce_v1`. Its kernels are the prefill rows of
# hsa/<arch>/mla/mla_asm.csv with an fp8 query and cache: (heads a KV head (Gqa), causal, kernel), persistent,
# qk 192 / v 128, no LSE column. The rows are in both tables, but the C++ entry (csrc/py_itfs_cu/asm_mla.cu)
# refuses gfx942 and any Q or K that is not FP8; q / k / v scales are fp32 per tensor, the output bfloat16.
# The adapter calls the three functions itself (as aiter's op_tests/test_mla_prefill_ps.py does), not the
# wrapper, so that the partial buffers are sized once per call from the plan's buffers.
AITER_FP8_PREFILL_TABLE: dict[str, frozenset[tuple[int, int, str]]] = {
    arch: frozenset(((1, 1, "mla_pfl_qh192_vh128_m32x8_n128x1_causal1"),
                     (1, 0, "mla_pfl_qh192_vh128_m32x8_n128x1_causal0")))
    for arch in ("gfx942", "gfx950")
}
AITER_FP8_PREFILL_KERNELS: tuple[str, ...] = tuple(sorted({row[2] for rows in AITER_FP8_PREFILL_TABLE.values()
                                                           for row in rows}, reverse=True))
AITER_FP8_PREFILL_ARCHS: tuple[str, ...] = ("gfx950",)
AITER_FP8_PREFILL_QK_HEAD_DIM = 192
AITER_FP8_PREFILL_V_HEAD_DIM = 128
# mla_prefill_ps_fwd's query tile (its partial buffers hold reduce_partial_map.size(0) x 256 rows); with one
# query head a KV head the planner's qlen_granularity is the whole tile
AITER_FP8_PREFILL_TILE_Q = 256
# the planner's key unit: aiter's op test passes max(128 (the kernel's key tile), block_size); one token a page
AITER_FP8_PREFILL_KV_GRANULARITY = 128
AITER_FP8_PREFILL_BLOCK_SIZE = 1

GET_PS_METADATA_INFO_V1 = AiterCall(
    module="aiter",
    function="get_ps_metadata_info_v1",
    source="aiter/ops/attention.py",
    keywords=("batch_size", "num_head_k", "max_qlen", "qlen_granularity"),
)
GET_PS_METADATA_V1 = AiterCall(
    module="aiter",
    function="get_ps_metadata_v1",
    source="aiter/ops/attention.py",
    keywords=("seqlens_qo_indptr", "pages_kv_indptr", "context_lens", "gqa_ratio", "num_heads_k",
              "work_metadata_ptrs", "work_indptr", "work_info", "reduce_indptr", "reduce_final_map",
              "reduce_partial_map", "qhead_granularity", "qlen_granularity", "kvlen_granularity", "block_size",
              "is_causal"),
)
MLA_PREFILL_PS_ASM_FWD = AiterCall(
    module="aiter",
    function="mla_prefill_ps_asm_fwd",
    source="aiter/ops/attention.py",
    keywords=("Q", "K", "V", "qo_indptr", "kv_indptr", "kv_page_indices", "work_indptr", "work_info_set",
              "max_seqlen_q", "softmax_scale", "is_causal", "splitData", "splitLse", "output", "q_scale",
              "k_scale", "v_scale"),
)
MLA_REDUCE_V1 = AiterCall(
    module="aiter",
    function="mla_reduce_v1",
    source="aiter/ops/attention.py",
    keywords=("partial_output", "partial_lse", "reduce_indptr", "reduce_final_map", "reduce_partial_map",
              "max_seqlen_q", "num_kv_splits", "final_output"),
)
FP8_PREFILL_CALLS: tuple[AiterCall, ...] = (GET_PS_METADATA_INFO_V1, GET_PS_METADATA_V1, MLA_PREFILL_PS_ASM_FWD,
                                            MLA_REDUCE_V1)
AITER_CALLS = AITER_CALLS + FP8_PREFILL_CALLS

_FP8_PREFILL_NO_LSE = (
    "aiter's FP8 prefill returns no LSE: mla_reduce_v1 writes final_lse only for the query tiles it merges "
    "(split across workgroups by get_ps_metadata_v1); a tile one workgroup finishes is written by the kernel "
    "with no LSE"
)


def _fp8_prefill_text() -> str:
    kernels = "; ".join(AITER_FP8_PREFILL_KERNELS)
    return (f"aiter's FP8 MLA prefill (mla_prefill_ps_asm_fwd over get_ps_metadata_v1 work, partials merged by "
            f"mla_reduce_v1; kernels {kernels}; {'/'.join(AITER_FP8_PREFILL_ARCHS)} only)")


def _fp8_prefill_reasons(probe: "AiterProbe", platform: Platform, config: PrefillSelectorConfig,
                         where: str) -> list[str]:
    """Why ROCM_AITER's FP8 prefill cannot run `config` on `platform` (empty when it can)."""
    dtype, arch, dims = config.dtype, platform.arch, config.dims
    reasons = []
    if arch not in AITER_FP8_PREFILL_ARCHS:
        said = ("aiter refuses it ('fp8 mla persistent prefill is not supported on gfx942')" if arch == "gfx942"
                else "aiter has no kernel for it")
        reasons.append(f"dtype {dtype_name(dtype)} is not supported by {where}: {_fp8_prefill_text()} does not run "
                       f"on {arch}: {said}; supported there: float16, bfloat16 (flash_attn_varlen_func)")
        return reasons
    if dtype != platform.fp8_dtype:
        reasons.append(f"dtype {dtype_name(dtype)} is not supported by {where}: {_fp8_prefill_text()} takes "
                       f"{dtype_name(platform.fp8_dtype)} (the platform's FP8); supported: float16, bfloat16, "
                       f"{dtype_name(platform.fp8_dtype)}")
    if (dims.qk_head_dim, dims.v_head_dim) != (AITER_FP8_PREFILL_QK_HEAD_DIM, AITER_FP8_PREFILL_V_HEAD_DIM):
        reasons.append(f"qk_head_dim {dims.qk_head_dim} / v_head_dim {dims.v_head_dim} are not supported by "
                       f"{where} in {dtype_name(dtype)}: the kernel table's FP8 prefill kernels are qk "
                       f"{AITER_FP8_PREFILL_QK_HEAD_DIM} / v {AITER_FP8_PREFILL_V_HEAD_DIM} (qh192_vh128)")
    missing = [call.function for call in FP8_PREFILL_CALLS if call.function not in probe.fp8_prefill_parameters]
    if missing:
        reasons.append(f"{probe.label} has no {', '.join(missing)} (aiter's FP8 MLA prefill, gfx950; this adapter "
                       f"follows {AITER_SOURCE_TAG})")
    for call in FP8_PREFILL_CALLS:
        parameters = probe.fp8_prefill_parameters.get(call.function)
        lacking = _missing_keywords(call, parameters) if parameters else []
        if lacking:
            reasons.append(f"{probe.label}'s {call.function} lacks the parameters {', '.join(lacking)}")
    return reasons


# --------------------------------------------------------------------------- aiter's decode kernel tables

# hsa/<arch>/mla/mla_asm.csv at AITER_SOURCE_COMMIT, the decode rows without context-parallel variants:
# (query type, cache type, heads a kernel runs (Gqa), persistent, query tokens (0: any), causal, writes the LSE)
AITER_DECODE_KERNELS: dict[str, frozenset[tuple[str, str, int, int, int, int, int]]] = {
    "gfx942": frozenset((
        ('bf16', 'bf16', 128, 0, 0, 1, 0), ('bf16', 'bf16', 16, 1, 4, 1, 0), ('bf16', 'bf16', 16, 0, 1, 1, 0),
        ('bf16', 'bf16', 16, 0, 4, 1, 0), ('bf16', 'bf16', 16, 0, 8, 1, 0), ('bf16', 'fp8', 16, 1, 4, 1, 0),
        ('bf16', 'byte', 16, 1, 4, 1, 0), ('fp8', 'fp8', 16, 1, 1, 1, 0), ('fp8', 'fp8', 64, 1, 1, 1, 0),
        ('fp8', 'fp8', 64, 1, 1, 1, 1), ('fp8', 'fp8', 16, 1, 2, 1, 0), ('fp8', 'fp8', 16, 1, 4, 1, 0),
        ('fp8', 'fp8', 16, 0, 1, 1, 0), ('fp8', 'fp8', 16, 0, 2, 1, 0), ('fp8', 'fp8', 16, 0, 4, 1, 0),
        ('fp8', 'fp8', 128, 0, 0, 1, 0), ('fp8', 'fp8', 128, 1, 0, 1, 0), ('bf16', 'bf16', 32, 0, 0, 1, 0),
        ('bf16', 'bf16', 64, 0, 0, 1, 0), ('bf16', 'bf16', 8, 0, 1, 1, 0), ('fp8', 'fp8', 8, 0, 1, 1, 0),
        ('bf16', 'bf16', 8, 1, 2, 1, 0),
    )),
    "gfx950": frozenset((
        ('bf16', 'bf16', 128, 0, 0, 1, 0), ('bf16', 'bf16', 16, 1, 4, 1, 0), ('bf16', 'bf16', 16, 1, 4, 1, 1),
        ('bf16', 'bf16', 16, 0, 1, 1, 0), ('bf16', 'bf16', 16, 0, 4, 1, 0), ('bf16', 'bf16', 16, 0, 8, 1, 0),
        ('bf16', 'fp8', 16, 1, 4, 1, 0), ('fp8', 'fp8', 16, 1, 1, 1, 0), ('fp8', 'fp8', 16, 1, 1, 1, 1),
        ('fp8', 'fp8', 16, 1, 2, 1, 0), ('fp8', 'fp8', 16, 1, 4, 1, 0), ('fp8', 'fp8', 16, 1, 4, 1, 1),
        ('fp8', 'fp8', 16, 0, 1, 1, 0), ('fp8', 'fp8', 16, 0, 2, 1, 0), ('fp8', 'fp8', 16, 0, 4, 1, 0),
        ('fp8', 'fp8', 32, 1, 4, 1, 0), ('fp8', 'fp8', 32, 1, 4, 1, 1), ('fp8', 'fp8', 32, 1, 1, 1, 0),
        ('fp8', 'fp8', 32, 1, 1, 1, 1), ('fp8', 'fp8', 128, 0, 0, 1, 0), ('bf16', 'bf16', 32, 0, 0, 1, 0),
        ('bf16', 'bf16', 64, 0, 0, 1, 0), ('bf16', 'bf16', 64, 0, 1, 1, 0), ('bf16', 'bf16', 8, 0, 1, 1, 0),
        ('bf16', 'bf16', 8, 0, 2, 1, 0), ('fp8', 'fp8', 8, 0, 1, 1, 0),
        ('fp8', 'fp8', 8, 1, 4, 1, 0), ('fp8', 'fp8', 8, 1, 4, 1, 1), ('bf16', 'bf16', 32, 1, 4, 1, 0),
        ('bf16', 'bf16', 32, 1, 4, 1, 1), ('bf16', 'bf16', 32, 1, 4, 0, 0), ('bf16', 'bf16', 32, 1, 4, 0, 1),
        ('bf16', 'bf16', 64, 1, 1, 1, 0), ('bf16', 'bf16', 64, 1, 1, 1, 1), ('bf16', 'bf16', 64, 1, 1, 0, 0),
        ('bf16', 'bf16', 64, 1, 1, 0, 1), ('fp8', 'fp8', 8, 1, 4, 0, 0), ('fp8', 'fp8', 8, 1, 4, 0, 1),
        ('fp8', 'fp8', 16, 0, 1, 0, 0), ('fp8', 'fp8', 16, 0, 4, 0, 0), ('fp8', 'fp8', 16, 1, 1, 0, 0),
        ('fp8', 'fp8', 16, 1, 1, 0, 1), ('fp8', 'fp8', 16, 1, 4, 0, 0), ('fp8', 'fp8', 16, 1, 4, 0, 1),
        ('fp8', 'fp8', 32, 1, 4, 0, 0), ('fp8', 'fp8', 32, 1, 4, 0, 1), ('fp8', 'fp8', 128, 0, 0, 0, 0),
    )),
}


def _persistent_heads_as_is(arch: str, q: str, kv: str, heads: int, q_len: int) -> bool:
    """Whether mla_decode_fwd's persistent path hands `heads` to its kernels as they are (else it folds a
    multiple of 16 from 32 to 128 into groups of 16, and refuses any other count); aiter's experimental
    kernels (AITER_ENABLE_EXPERIMENTAL) are left out."""
    same = q == kv
    if heads == 16 or (arch == "gfx950" and same and q == "bf16"):
        return True
    if not (same and q == "fp8"):
        return arch == "gfx942" and heads == 8 and same and q_len == 2
    if arch == "gfx942":
        return heads == 128 or (heads == 64 and q_len == 1)
    return heads in (32, 64, 128) or (heads == 8 and q_len == 4)


def _kernel_key(arch: str, q: str, kv: str, heads: int, q_len: int, persistent: bool) -> tuple | None:
    """The (Gqa, persistent, query tokens) key mla_decode_stage1_asm_fwd looks its kernel up by, or None
    where it raises before the lookup."""
    ps = int(persistent)
    key_heads, key_len = heads, q_len
    bf16, fp8 = q == kv == "bf16", q == kv == "fp8"
    if heads == 128:
        key_len = 0
        ps = 0 if (bf16 and arch == "gfx942") else ps
    elif heads == 16 and bf16:
        key_len = (4 if q_len <= 4 else q_len) if persistent else (1 if q_len == 1 else 4 if q_len <= 4 else 8)
    elif heads == 16 and q == "bf16":  # bf16 query over an fp8 (or byte) cache
        key_len = 4 if persistent and q_len <= 4 else q_len
    elif heads == 16 and q == "fp8":
        if q_len == 3:
            key_len = 4
        elif q_len > 4:
            if not (persistent and arch == "gfx950"):
                return None
            key_heads, key_len = 32, 4
    elif heads == 32 and bf16:
        key_len = q_len if persistent else 0
    elif heads == 32 and fp8:
        if q_len >= 3 and not (persistent and arch == "gfx950"):
            return None
        if q_len == 2 and not persistent:
            return None
        key_len = 4 if q_len >= 3 else q_len
    elif heads == 64 and bf16:
        key_len = q_len if persistent else (1 if q_len == 1 else 0)
    elif heads == 64 and fp8:
        if not persistent:
            return None
        key_len = 1 if q_len == 1 else 4
    if arch == "gfx950" and persistent:  # gfx950 runs these persistent shapes on the 32- or 64-head kernels
        product = heads * q_len
        if bf16 and (product >= 128 or heads > 64) and heads != 48:
            key_heads, key_len = 32, 4
        elif bf16 and (product >= 64 or heads >= 16):
            key_heads, key_len = 64, 1
        elif fp8 and ((heads == 32 and q_len >= 4) or (heads == 64 and q_len >= 2) or heads == 128):
            key_heads, key_len = 32, 4
        elif fp8 and ((heads == 16 and q_len in (3, 4)) or (heads == 32 and q_len in (2, 3))
                      or (heads == 64 and q_len == 1)):
            key_heads, key_len = 16, 4
    return key_heads, ps, key_len


def aiter_decode_kernel(arch: str, q: str, kv: str, heads: int, q_len: int, persistent: bool,
                        lse: bool) -> tuple[int, int] | None:
    """(heads the kernel runs, its query tokens) of the kernel `mla_decode_fwd` launches for a causal decode of
    `heads` query heads (aiter folds 48-112 into 16 where its persistent path does), or None where it has none.
    `lse`: with `return_lse` (only the persistent path looks for a kernel that writes the LSE)."""
    table = AITER_DECODE_KERNELS.get(arch)
    if table is None:
        return None
    if persistent and not _persistent_heads_as_is(arch, q, kv, heads, q_len):
        if heads not in range(32, 129, 16):
            return None
        heads = 16
    key = _kernel_key(arch, q, kv, heads, q_len, persistent)
    if key is None:
        return None
    key_heads, ps, key_len = key
    row = (q, kv, key_heads, ps, key_len, 1, int(lse and persistent))
    return (key_heads, key_len) if row in table else None


@dataclasses.dataclass(frozen=True)
class AiterDecodeRoute:
    """How a decode configuration runs on aiter: the heads passed (the model's, or padded with zero queries),
    the persistent path or the split-KV one, and whether the LSE is asked for (only where it is written)."""

    arch: str
    num_heads: int
    heads: int
    query_len: int
    q_type: str
    kv_type: str
    persistent: bool
    lse: bool

    @property
    def padded(self) -> bool:
        return self.heads != self.num_heads

    @property
    def folded(self) -> bool:
        """aiter folds the heads into groups of 16 (persistent path), and with several query tokens hands the
        output back in a tensor of its own (`o.set_`): such a call's output is never a workspace view."""
        return self.persistent and not _persistent_heads_as_is(self.arch, self.q_type, self.kv_type, self.heads,
                                                               self.query_len)

    def describe(self) -> str:
        path = "persistent" if self.persistent else "split-KV"
        lse = "LSE" if self.lse else "no LSE"
        heads = f"{self.num_heads} heads" + (f" padded to {self.heads}" if self.padded else "")
        return f"{path}, {lse} ({heads}, {self.query_len} query tokens, {self.q_type} query, {self.kv_type} cache)"


def _runtime_arch() -> str:
    """The architecture whose kernel tables a call follows: the current platform's, or gfx942 where the current
    platform is none of aiter's (a CPU test run against the stand-in aiter; selection never gets there)."""
    from mla_multi.platforms import current_platform

    arch = current_platform().arch
    return arch if arch in AITER_DECODE_KERNELS else AITER_ARCHS[0]


def _head_candidates(num_heads: int) -> list[int]:
    """The head counts tried for `num_heads`, in order: the count itself where aiter's tables or its fold take
    it, the next multiple of 16 (16 for fewer), then the next count of its tables (48 -> 64, 80-112 -> 128)."""
    found = [num_heads] if num_heads in AITER_DECODE_NATIVE_NUM_HEADS or num_heads in range(48, 113, 16) else []
    padded = AITER_DECODE_PADDED_NUM_HEADS if num_heads < 16 else -(-num_heads // 16) * 16
    native = [h for h in AITER_DECODE_NATIVE_NUM_HEADS if h >= max(num_heads, AITER_DECODE_PADDED_NUM_HEADS)]
    for heads in [padded] + native[:1]:
        if heads not in found and heads <= AITER_DECODE_MAX_NUM_HEADS:
            found.append(heads)
    return found


def _types(kv_cache_dtype: torch.dtype) -> tuple[str, str] | None:
    if kv_cache_dtype == torch.bfloat16:
        return "bf16", "bf16"
    if kv_cache_dtype in FP8_DTYPES:
        return "fp8", "fp8"  # the a8w8 kernels: the query is quantised to the cache's type
    return None


@functools.lru_cache(maxsize=None)
def aiter_decode_route(arch: str, num_heads: int, query_len: int, kv_cache_dtype: torch.dtype) -> AiterDecodeRoute | None:
    """The route of a decode on `arch`, or None where aiter has no kernel for it: the persistent path where it has
    a kernel (vLLM's ROCM_AITER_MLA), asking for the LSE where that kernel writes it; else the split-KV path with
    at least two splits (its second stage then writes the LSE; an FP8 split count aiter may cut to one, so no LSE
    there). Heads aiter's tables lack are padded to a multiple of 16."""
    types = _types(kv_cache_dtype)
    if types is None or not 1 <= num_heads <= AITER_DECODE_MAX_NUM_HEADS or query_len < 1:
        return None
    q, kv = types
    for heads in _head_candidates(num_heads):
        for persistent, lse in ((True, True), (True, False), (False, q == "bf16")):
            if aiter_decode_kernel(arch, q, kv, heads, query_len, persistent, lse) is not None:
                return AiterDecodeRoute(arch, num_heads, heads, query_len, q, kv, persistent, lse)
    return None


# --------------------------------------------------------------------------- probing the installed aiter


@dataclasses.dataclass(frozen=True)
class AiterProbe:
    """What the installed aiter offers; `error` is set when it cannot be used at all."""

    version: str
    error: str | None = None
    decode_parameters: tuple[str, ...] = ()
    prefill_parameters: tuple[str, ...] = ()
    # Architectures with MLA kernel objects in the installed package, or None when unknown.
    kernel_archs: tuple[str, ...] | None = None
    # Which of AITER_SPARSE_FP8_KERNELS the installed package defines.
    sparse_fp8_kernels: tuple[str, ...] = ()
    # Whether it has get_mla_metadata_info_v1 and get_mla_metadata_v1 (the persistent path's metadata).
    has_metadata: bool = False
    # The parameters of the FP8 prefill's functions it has (FP8_PREFILL_CALLS; () where a signature is unreadable).
    fp8_prefill_parameters: dict = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"aiter {self.version}"

    def decode_has(self, name: str) -> bool:
        return name in self.decode_parameters

    def prefill_has(self, name: str) -> bool:
        return name in self.prefill_parameters


def _installed_version() -> str | None:
    for distribution in ("amd-aiter", "aiter"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken installation's metadata must not break probing
            continue
    return None


def _parameters(function: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def _kernel_archs(aiter_module: Any) -> tuple[str, ...] | None:
    """Architectures whose `hsa/<arch>/mla/*.co` kernel objects the installed aiter ships."""
    roots = []
    try:
        spec = importlib.util.find_spec("aiter_meta")
        if spec is not None and spec.submodule_search_locations:
            roots.extend(pathlib.Path(p) for p in spec.submodule_search_locations)
    except Exception:
        pass
    module_file = getattr(aiter_module, "__file__", None)
    if module_file:
        package_dir = pathlib.Path(module_file).parent
        roots.extend([package_dir.parent / "aiter_meta", package_dir])
    for root in roots:
        hsa = root / "hsa"
        if hsa.is_dir():
            archs = sorted(
                entry.name for entry in hsa.iterdir() if (entry / "mla").is_dir() and any((entry / "mla").glob("*.co"))
            )
            return tuple(archs)
    return None


@functools.lru_cache(maxsize=1)
def probe_aiter() -> AiterProbe:
    """Import aiter once and record what it offers. Never raises.

    `import aiter` raises RuntimeError (not ImportError) on a machine without
    ROCm, and may raise anything when its JIT setup is broken: every exception
    becomes `AiterProbe.error`.
    """
    version = _installed_version()
    try:
        aiter_module = importlib.import_module("aiter")
    except Exception as error:
        if isinstance(error, ModuleNotFoundError) and error.name == "aiter":
            return AiterProbe(version="(not installed)", error="aiter is not installed (pip package amd-aiter)")
        label = version or "(version unknown)"
        return AiterProbe(version=label, error=f"import aiter {label} failed: {type(error).__name__}: {error}")
    if version is None:
        version = str(getattr(aiter_module, "__version__", None) or "(version unknown)")
    try:
        mla_module = importlib.import_module(MLA_DECODE_FWD.module)
        decode_function = getattr(mla_module, MLA_DECODE_FWD.function, None)
    except Exception as error:
        return AiterProbe(version=version, error=f"import aiter.mla from aiter {version} failed: {type(error).__name__}: {error}")
    prefill_function = getattr(aiter_module, FLASH_ATTN_VARLEN_FUNC.function, None)
    fp8_kernels = tuple(
        name for name in AITER_SPARSE_FP8_KERNELS
        if getattr(aiter_module, name, None) is not None or getattr(mla_module, name, None) is not None
    )
    return AiterProbe(
        version=version,
        decode_parameters=_parameters(decode_function) if decode_function is not None else (),
        prefill_parameters=_parameters(prefill_function) if prefill_function is not None else (),
        kernel_archs=_kernel_archs(aiter_module),
        sparse_fp8_kernels=fp8_kernels,
        has_metadata=all(getattr(aiter_module, call.function, None) is not None
                         for call in (GET_MLA_METADATA_INFO_V1, GET_MLA_METADATA_V1)),
        fp8_prefill_parameters={call.function: _parameters(getattr(aiter_module, call.function))
                                for call in FP8_PREFILL_CALLS if getattr(aiter_module, call.function, None) is not None},
    )


def clear_probe_cache() -> None:
    """Forget the probe (tests that change what `import aiter` finds call this)."""
    probe_aiter.cache_clear()


def _missing_keywords(call: AiterCall, parameters: tuple[str, ...]) -> list[str]:
    return [name for name in call.keywords if name not in parameters]


def _call_reasons(call: AiterCall, phase: str) -> list[str]:
    """Why the installed aiter cannot take `call` (empty when it can), against the signature the probe read
    of its decode function (`phase` "decode") or its prefill one ("prefill")."""
    probe = probe_aiter()
    if probe.error:
        return [probe.error]
    parameters = probe.decode_parameters if phase == "decode" else probe.prefill_parameters
    if not parameters:
        return [f"{probe.label} has no {call.module}.{call.function}"]
    missing = _missing_keywords(call, parameters)
    if missing:
        return [f"{probe.label}'s {call.function} lacks the parameters {', '.join(missing)}"]
    return []


def _where(platform: Platform) -> str:
    return f"{platform.name} ({platform.arch})"


def _arch_reasons(probe: AiterProbe, platform: Platform, what: str) -> list[str]:
    archs = AITER_ARCHS if probe.kernel_archs is None else tuple(a for a in probe.kernel_archs if a in AITER_ARCHS)
    if platform.arch not in archs:
        source = "supported" if probe.kernel_archs is None else "shipped with kernels"
        return [f"{probe.label} has no {what} kernels for {_where(platform)}; {source}: {', '.join(archs) or 'none'}"]
    return []


def _rocm_platform_reasons(platform: Platform) -> list[str]:
    if platform.vendor != "rocm":
        return [f"platform {platform.name} ({platform.vendor} {platform.arch}) is not supported; aiter runs on ROCm only"]
    return []


def _sparse_heads(arch: str, num_heads: int) -> int | None:
    """The heads the sparse path passes for `num_heads` on `arch` (split-KV, one bf16 query token a request):
    the count itself where aiter's tables have its kernel, else padded to a multiple of 16; None where neither."""
    for heads in _head_candidates(num_heads):
        if aiter_decode_kernel(arch, "bf16", "bf16", heads, 1, False, False) is not None:
            return heads
    return None


def _decode_num_heads_text(arch: str | None = None) -> str:
    archs = (arch,) if arch in AITER_DECODE_KERNELS else tuple(AITER_DECODE_KERNELS)
    parts = []
    for each in archs:
        native = [h for h in AITER_DECODE_NATIVE_NUM_HEADS if _sparse_heads(each, h) == h]
        parts.append(f"{', '.join(map(str, native))} on {each}")
    return "; ".join(parts) + "; other counts padded to a multiple of 16 that runs"


def _decode_shape_reasons(dims, where: str, arch: str) -> list[str]:
    """The head counts and latent widths the sparse path's `mla_decode_fwd` kernels take."""
    reasons = []
    num_heads = dims.num_heads
    if arch in AITER_DECODE_KERNELS and _sparse_heads(arch, num_heads) is None:
        reasons.append(
            f"num_heads {num_heads} is not supported by {where}'s mla_decode_fwd (split-KV, one bfloat16 query "
            f"token a request); supported: {_decode_num_heads_text(arch)}"
        )
    if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (AITER_DECODE_KV_LORA_RANK, AITER_DECODE_QK_ROPE_HEAD_DIM):
        reasons.append(
            f"kv_lora_rank {dims.kv_lora_rank} / qk_rope_head_dim {dims.qk_rope_head_dim} are not supported by "
            f"{where}; its kernels are built for {AITER_DECODE_KV_LORA_RANK} / {AITER_DECODE_QK_ROPE_HEAD_DIM}"
        )
    return reasons


def _padded_query(query: torch.Tensor, heads: int) -> torch.Tensor:
    """query [T, N, D] with zero queries on extra heads up to `heads` (their outputs are dropped)."""
    tokens, num_heads, width = query.shape
    if num_heads >= heads:
        return query
    padded = query.new_zeros(tokens, heads, width)
    padded[:, :num_heads] = query
    return padded


# --------------------------------------------------------------------------- decode


def paged_kv_indices(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, fill: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """aiter's page-size-1 indexing of a paged cache, built on the device.

    block_table [B, max_blocks] int32, seq_lens [B] int32 (each at most
    max_blocks * block_size). Returns, all int32 on block_table's device:
    qo_indptr [B + 1] (one query per request), kv_indptr [B + 1] (prefix sums
    of seq_lens), kv_indices [B * max_blocks * block_size] (request b's token
    j is entry kv_indptr[b] + j and holds the cache row
    block_table[b, j // block_size] * block_size + j % block_size; the tail
    past kv_indptr[B] holds `fill` and is never read) and kv_last_page_lens [B] (ones).

    Shapes depend only on the input shapes and nothing is read back to the
    host, so the construction can be captured in a graph; the price is
    O(B * max_blocks * block_size) temporary index memory, once a step (the plan).
    """
    device = block_table.device
    batch, max_blocks = block_table.shape
    capacity = max_blocks * block_size
    positions = torch.arange(capacity, device=device, dtype=torch.int32)
    block_of_position = (positions // block_size).long()
    slots = block_table.index_select(1, block_of_position).to(torch.int32) * block_size + positions % block_size
    seq_lens32 = seq_lens.to(torch.int32)
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(seq_lens32, dim=0, dtype=torch.int32)
    valid = positions.unsqueeze(0) < seq_lens32.unsqueeze(1)
    # Tokens past a request's length go to one spare entry, cut off below.
    spare = batch * capacity
    destination = torch.where(
        valid, kv_indptr[:-1].unsqueeze(1).long() + positions.unsqueeze(0).long(), torch.full_like(valid, spare, dtype=torch.long)
    )
    kv_indices = torch.full((spare + 1,), fill, dtype=torch.int32, device=device)
    kv_indices.scatter_(0, destination.reshape(-1), torch.where(valid, slots, fill).reshape(-1))
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)
    kv_last_page_lens = torch.ones(batch, dtype=torch.int32, device=device)
    return qo_indptr, kv_indptr, kv_indices[:spare], kv_last_page_lens


def _scale_tensor(value, device: torch.device) -> torch.Tensor:
    if torch.is_tensor(value):
        return value.to(device=device, dtype=torch.float32).reshape(1)
    return torch.tensor([float(value)], dtype=torch.float32, device=device)


_TORCH_TYPES = {"bf16": torch.bfloat16}


@dataclasses.dataclass
class AiterDecodePlan:
    """One decode step on aiter, made once per step (`AiterMLADecodeImpl.plan`) and shared by every layer:
    the page-size-1 indexing over the step's valid tokens and, on the persistent path, aiter's work metadata.

    Every tensor lives in buffers fixed per (device, configuration, batch, query tokens, block-table width):
    a graph captured after one plan replays correctly after the next."""

    batch: int
    query_len: int
    route: AiterDecodeRoute
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_lens: torch.Tensor
    work: dict[str, torch.Tensor] | None
    cuda_graph: bool


_plan_buffers: dict = {}
_plan_lock = threading.Lock()


_WORK_NAMES = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
               "reduce_partial_map")


def _allocate_work(specs, device: torch.device, names: tuple[str, ...] = _WORK_NAMES) -> dict[str, torch.Tensor]:
    """The persistent paths' six work buffers, named in the order aiter's *_metadata_info_v1 returns their
    (shape, dtype) specs."""
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in zip(names, specs)}


def _metadata_buffers(route: AiterDecodeRoute, batch: int, device: torch.device, q_dtype: torch.dtype,
                      kv_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The persistent path's six buffers, shaped by aiter's get_mla_metadata_info_v1 for `batch` requests."""
    import aiter

    specs = aiter.get_mla_metadata_info_v1(
        batch_size=batch, max_seqlen_qo=route.query_len, num_head_qo=route.heads, q_dtype=q_dtype,
        kv_dtype=kv_dtype, is_sparse=False, fast_mode=True,
    )
    return _allocate_work(specs, device)


class AiterMLADecodeImpl(MLADecodeImpl):
    """Decode through `aiter.mla.mla_decode_fwd` on the page-size-1 view of the cache, persistent where aiter
    has a persistent kernel for the configuration (`aiter_decode_route`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reserved: tuple[int, int] | None = None  # (max_num_seqs, max_query_len) of reserve_workspace

    def plan_key(self) -> tuple:
        return ("ROCM_AITER", "decode", self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim,
                self.kv_cache_dtype, self.block_size)

    def route(self, query_len: int) -> AiterDecodeRoute:
        """The route of this layer's decode with `query_len` tokens a request on the current platform."""
        arch = _runtime_arch()
        found = aiter_decode_route(arch, self.num_heads, query_len, self.kv_cache_dtype)
        if found is None:
            raise ValueError(
                f"ROCM_AITER has no mla_decode_fwd kernel on {arch} for {self.num_heads} heads, {query_len} query "
                f"tokens a request and a {dtype_name(self.kv_cache_dtype)} cache; accepted here: "
                + _routes_text(arch, query_len, self.kv_cache_dtype)
            )
        return found

    def _dtypes(self, route: AiterDecodeRoute) -> tuple[torch.dtype, torch.dtype]:
        if route.q_type == "fp8":
            return self.kv_cache_dtype, self.kv_cache_dtype
        return torch.bfloat16, torch.bfloat16

    def reserve_workspace(self, workspace_manager, max_num_seqs: int, max_model_len: int, max_query_len: int = 1,
                          dtype: torch.dtype | None = None) -> None:
        """The output rows in the shared workspace; the persistent path's metadata buffers, which must outlive
        the layers of a step (the workspace is scratch), sized once here by aiter for the largest batch."""
        self._reserved = (max_num_seqs, max_query_len)
        routes = []
        for query_len in range(1, max_query_len + 1):
            try:
                routes.append(self.route(query_len))
            except ValueError:
                continue
        if not routes:
            return
        heads = max(r.heads for r in routes)
        workspace_manager.reserve(
            ((max_num_seqs * max_query_len, heads, self.kv_lora_rank), dtype or torch.bfloat16),
            purpose="decode: ROCM_AITER output",
            what=f"max_num_seqs={max_num_seqs} x max_query_len={max_query_len} rows of {heads} heads",
        )
        device = self.device if self.device is not None else torch.device("cpu")
        if device.type == "meta" or probe_aiter().error:
            return
        for route in routes:
            if route.persistent:
                self._work_buffers(route, max_num_seqs, device)

    def _work_buffers(self, route: AiterDecodeRoute, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Metadata buffers for `route`, shared by every layer of this configuration; grown (never under a
        graph capture) only when a batch exceeds the reservation."""
        key = ("work", device, self.plan_key(), route)
        with _plan_lock:
            found = _plan_buffers.get(key)
            if found is None or found[0] < batch:
                size = max(batch, self._reserved[0] if self._reserved else 0)
                found = _plan_buffers[key] = (size, _metadata_buffers(route, size, device, *self._dtypes(route)))
        return found[1]

    def plan(self, seq_lens_cpu: torch.Tensor | None, block_table: torch.Tensor, query_len: int = 1, *,
             k_scale=None, cuda_graph: bool = False, seq_lens: torch.Tensor | None = None) -> AiterDecodePlan:
        """Build one step's indexing and metadata on the device, once for every layer.

        seq_lens_cpu [B] on the host (or None, with `seq_lens` on the device), block_table [B, max_blocks] on
        the device. Nothing is read back from the device; the indices cover the valid tokens only, the rest of
        the list holds -1. A `cuda_graph` plan writes the indexing into buffers fixed per (configuration,
        batch, block-table width), so that a graph captured after it replays after the next plan; an eager
        plan's list is cut to the step's tokens (aiter's split-KV heuristic reads its length). The persistent
        path's metadata comes from aiter's get_mla_metadata_v1 into buffers sized at reservation."""
        import aiter

        route = self.route(query_len)
        device = block_table.device
        batch, max_blocks = block_table.shape
        if seq_lens is None:
            seq_lens = to_device(torch.as_tensor(seq_lens_cpu).to(torch.int32), device)
        _, kv_indptr, kv_indices, kv_last_page_lens = paged_kv_indices(block_table, seq_lens, self.block_size)
        qo_indptr = torch.arange(0, (batch + 1) * query_len, query_len, dtype=torch.int32, device=device)
        if cuda_graph:  # fixed per shape, rewritten by every plan: a captured graph reads them at replay
            key = ("indices", device, self.plan_key(), route, batch, max_blocks)
            with _plan_lock:
                buffers = _plan_buffers.get(key)
                if buffers is None:
                    buffers = _plan_buffers[key] = (torch.empty_like(qo_indptr), torch.empty_like(kv_indptr),
                                                    torch.empty_like(kv_indices), torch.empty_like(kv_last_page_lens))
            for buffer, value in zip(buffers, (qo_indptr, kv_indptr, kv_indices, kv_last_page_lens)):
                buffer.copy_(value)
            qo_indptr, kv_indptr, kv_indices, kv_last_page_lens = buffers
        elif seq_lens_cpu is not None:
            # aiter's split-KV heuristic reads the index list's length: the step's tokens, known on the host
            kv_indices = kv_indices[: max(1, int(torch.as_tensor(seq_lens_cpu).sum()))]
        work = None
        if route.persistent:
            work = self._work_buffers(route, batch, device)
            q_dtype, kv_dtype = self._dtypes(route)
            aiter.get_mla_metadata_v1(
                seqlens_qo_indptr=qo_indptr,
                seqlens_kv_indptr=kv_indptr,
                kv_last_page_lens=kv_last_page_lens,
                num_heads_per_head_k=route.heads,
                num_heads_k=1,
                is_causal=True,
                work_metadata_ptrs=work["work_meta_data"],
                work_info_set=work["work_info_set"],
                work_indptr=work["work_indptr"],
                reduce_indptr=work["reduce_indptr"],
                reduce_final_map=work["reduce_final_map"],
                reduce_partial_map=work["reduce_partial_map"],
                page_size=1,
                # aiter's 64-head FP8 kernel produces partials of 32 tokens
                kv_granularity=32 if (route.heads == 64 and route.q_type == "fp8") else 16,
                max_seqlen_qo=query_len,
                uni_seqlen_qo=query_len,
                fast_mode=True,
                dtype_q=q_dtype,
                dtype_kv=kv_dtype,
            )
        return AiterDecodePlan(batch, query_len, route, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, work,
                               cuda_graph)

    def forward_mqa(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        num_kv_splits: int | None = None,
        workspace_manager=None,
        max_seq_len: int | None = None,
        plan: AiterDecodePlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q_nope [B, N, Lkv] or [B, Q, N, Lkv] (causal within the request), q_pe [B, (Q,) N, R] bfloat16;
        kv_cache [num_blocks, block_size, Lkv + R] bfloat16 or fp8 (with k_scale); block_table [B, max_blocks]
        int32; seq_lens [B] int32.

        Returns out with q_nope's shape (bfloat16) and the LSE [B, (Q,) N] float32 where the route's kernel
        writes it (`AiterDecodeRoute.lse`), else None. `plan` (from `plan`, once a step) carries the indexing
        and metadata; without it they are built here. On the persistent path the split count is aiter's (its
        batch gate may send a large batch to the split-KV kernel); on the split-KV path `num_kv_splits`
        (default AITER_NON_PERSISTENT_SPLITS) is raised to at least 2 so that the LSE is written.
        """
        probe = probe_aiter()
        if probe.error:
            raise RuntimeError(probe.error)
        from aiter.mla import mla_decode_fwd

        single_token = q_nope.dim() == 3
        if single_token:
            q_nope, q_pe = q_nope.unsqueeze(1), q_pe.unsqueeze(1)
        batch, query_len, num_heads, kv_lora_rank = q_nope.shape
        num_blocks, block_size, width = kv_cache.shape
        if num_blocks * block_size > _MAX_INT32:
            raise ValueError(
                f"kv_cache has {num_blocks * block_size} rows; accepted by ROCM_AITER: at most {_MAX_INT32} (int32 kv_indices)"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache is not contiguous; accepted by ROCM_AITER: a contiguous cache (viewed with page size 1)")
        if plan is None:
            plan = self.plan(None, block_table, query_len, seq_lens=seq_lens)
        elif (plan.batch, plan.query_len) != (batch, query_len):
            raise ValueError(f"the ROCM_AITER plan is for {plan.batch} requests of {plan.query_len} tokens; "
                             f"q_nope has {batch} of {query_len}")
        route = plan.route
        heads = route.heads
        query = torch.cat([q_nope, q_pe], dim=-1)
        if heads != num_heads:  # zero queries on the padding heads; their outputs are dropped
            padded = query.new_zeros(batch, query_len, heads, width)
            padded[:, :, :num_heads] = query
            query = padded
        query = query.reshape(batch * query_len, heads, width)
        rows = batch * query_len
        if (workspace_manager is not None and self._reserved is not None and query_len <= self._reserved[1]
                and not (route.folded and query_len > 1)
                and rows <= self._reserved[0] * self._reserved[1]):
            output = workspace_manager.get_simultaneous(((rows, heads, kv_lora_rank), q_nope.dtype))[0]
        else:
            output = torch.empty(rows, heads, kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device)

        keywords: dict[str, Any] = dict(sm_scale=self.scale)
        if route.persistent:
            work = plan.work
            keywords.update(
                num_kv_splits=None, work_meta_data=work["work_meta_data"], work_indptr=work["work_indptr"],
                work_info_set=work["work_info_set"], reduce_indptr=work["reduce_indptr"],
                reduce_final_map=work["reduce_final_map"], reduce_partial_map=work["reduce_partial_map"],
            )
        else:
            keywords["num_kv_splits"] = max(2, num_kv_splits or AITER_NON_PERSISTENT_SPLITS)
        if route.q_type == "fp8":
            # aiter's fp8 cache kernels are a8w8: the query is quantised to the
            # cache's fp8 type with a per-tensor scale computed on the device.
            if k_scale is None:
                raise ValueError("k_scale=None with an fp8 kv_cache; accepted: a float or a 1-element tensor")
            finite_max = torch.finfo(kv_cache.dtype).max
            q_scale = (query.abs().amax().float() / finite_max).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
            query = (query.float() / q_scale).clamp(-finite_max, finite_max).to(kv_cache.dtype)
            keywords.update(q_scale=q_scale, kv_scale=_scale_tensor(k_scale, query.device))
        if route.lse:
            keywords["return_lse"] = True

        result = mla_decode_fwd(
            q=query,
            kv_buffer=kv_cache.view(num_blocks * block_size, 1, 1, width),
            o=output,
            qo_indptr=plan.qo_indptr,
            kv_indptr=plan.kv_indptr,
            kv_indices=plan.kv_indices,
            kv_last_page_lens=plan.kv_last_page_lens,
            max_seqlen_q=query_len,
            page_size=1,
            nhead_kv=1,
            causal=True,
            **keywords,
        )
        # A query token that sees no cached token (seq_len 0, or fewer tokens than the query's position needs)
        # is left undefined by aiter; the convention is 0 / -inf.
        visible = seq_lens.to(torch.int32).unsqueeze(1) - query_len + 1 + torch.arange(
            query_len, device=seq_lens.device, dtype=torch.int32)
        empty = (visible <= 0).to(output.device).unsqueeze(2)  # [B, Q, 1]
        out = output.view(batch, query_len, heads, kv_lora_rank)[:, :, :num_heads]
        out = out.masked_fill(empty.unsqueeze(3), 0)
        lse = None
        if route.lse:
            raw = result[1] if isinstance(result, (tuple, list)) and len(result) > 1 else None
            if raw is None:
                raise RuntimeError(f"{probe.label}'s mla_decode_fwd(return_lse=True) returned no LSE")
            lse = raw.reshape(batch, query_len, heads)[:, :, :num_heads].float().masked_fill(empty, float("-inf"))
        if single_token:
            out = out.squeeze(1)
            lse = lse.squeeze(1) if lse is not None else None
        return out, lse


def _routes_text(arch: str, query_len: int, kv_cache_dtype: torch.dtype) -> str:
    """What runs on `arch` with `query_len` tokens and this cache: heads and how."""
    parts = []
    for heads in (8, 16, 32, 48, 64, 80, 96, 112, 128):
        route = aiter_decode_route(arch, heads, query_len, kv_cache_dtype)
        if route is not None and not route.padded:
            parts.append(f"{heads} ({'persistent' if route.persistent else 'split-KV'}"
                         f"{', LSE' if route.lse else ''})")
    if not parts:
        return "no head count"
    return "num_heads " + ", ".join(parts) + "; others padded to a multiple of 16 where that runs"


def route_table(platform: Platform, num_heads: tuple[int, ...] = (8, 16, 32, 64, 128),
                query_lens: tuple[int, ...] = (1, 2, 3, 4)) -> dict | None:
    """How aiter's decode kernel tables (AITER_SOURCE_TAG) run DeepSeek decodes on `platform`, per cache dtype,
    head count and query tokens: "persistent, LSE", "split-KV" ... or the reason it falls back. None off gfx942 /
    gfx950. Read from the tables only: it holds whether or not aiter is installed (`mla-multi info`)."""
    if platform.arch not in AITER_DECODE_KERNELS:
        return None
    kv_dtypes = [torch.bfloat16] + ([platform.fp8_dtype] if platform.fp8_dtype is not None else [])
    table = {}
    for kv in kv_dtypes:
        rows = {}
        for heads in num_heads:
            row = {}
            for query_len in query_lens:
                route = aiter_decode_route(platform.arch, heads, query_len, kv)
                if route is None:
                    row[query_len] = "falls back: no kernel in aiter's tables"
                else:
                    row[query_len] = (("persistent" if route.persistent else "split-KV")
                                      + (", LSE" if route.lse else ", no LSE")
                                      + (f", padded to {route.heads}" if route.padded else ""))
            rows[heads] = row
        table[dtype_name(kv)] = rows
    return {"aiter_source": f"{AITER_SOURCE_TAG} ({AITER_SOURCE_COMMIT[:12]})", "routes": table}


class AiterMLADecodeBackend(MLADecodeBackend):
    """`aiter.mla.mla_decode_fwd`: bfloat16 (or a8w8 fp8) decode on gfx942 / gfx950, persistent where aiter has
    the kernel."""

    name: ClassVar[str] = "ROCM_AITER"
    vendors = frozenset({"rocm"})
    supported_dtypes = (torch.bfloat16,)
    supported_kv_cache_dtypes = (torch.bfloat16, torch.float8_e4m3fnuz, torch.float8_e4m3fn)
    max_num_heads = AITER_DECODE_MAX_NUM_HEADS
    max_query_len = AITER_DECODE_MAX_QUERY_LEN
    # Index construction and metadata are on the device into fixed buffers (see AiterMLADecodeImpl.plan).
    supports_cuda_graphs = True
    requires_plan: ClassVar[bool] = True

    @staticmethod
    def get_decode_impl_cls():
        return AiterMLADecodeImpl

    @classmethod
    def availability_reasons(cls) -> list[str]:
        reasons = _call_reasons(MLA_DECODE_FWD, "decode")
        probe = probe_aiter()
        if not reasons and not probe.error and not probe.has_metadata:
            reasons.append(f"{probe.label} has no get_mla_metadata_info_v1 / get_mla_metadata_v1 (aiter's "
                           f"persistent MLA decode, in aiter since 2025-12; this adapter follows {AITER_SOURCE_TAG})")
        return reasons

    @classmethod
    def provides_decode_lse(cls, platform: Platform | None = None, config: DecodeSelectorConfig | None = None) -> bool:
        """Whether forward_mqa returns an LSE: for `config` on `platform` (the current one by default), its
        route's kernel writes it; without a config, for the DeepSeek-V3 configurations of 16 and 128 heads
        with a bf16 cache."""
        probe = probe_aiter()
        if probe.error or not probe.decode_has("return_lse"):
            return False
        from mla_multi.platforms import current_platform

        platform = platform or current_platform()
        if config is None:
            return all(getattr(aiter_decode_route(platform.arch, n, 1, torch.bfloat16), "lse", False) for n in (16, 128))
        return all(getattr(aiter_decode_route(platform.arch, config.dims.num_heads, q, config.kv_cache_dtype),
                           "lse", False) for q in range(1, config.max_query_len + 1))

    @classmethod
    def supported_num_heads_text(cls) -> str:
        return (f"{', '.join(map(str, AITER_DECODE_NATIVE_NUM_HEADS))} natively, 48-112 folded by aiter, others "
                "padded to a multiple of 16, where aiter's kernel tables have a kernel")

    @classmethod
    def fp8_kv_cache_reasons(cls, probe: AiterProbe, platform: Platform, kv_cache_dtype: torch.dtype) -> list[str]:
        where = f"{probe.label} on {_where(platform)}"
        if platform.fp8_dtype is None:
            return [f"kv_cache_dtype {dtype_name(kv_cache_dtype)} is not supported by {where}: the platform has no fp8"]
        if kv_cache_dtype != platform.fp8_dtype:
            return [
                f"kv_cache_dtype {dtype_name(kv_cache_dtype)} is not supported by {where}; "
                f"its fp8 type is {dtype_name(platform.fp8_dtype)}"
            ]
        if not (probe.decode_has("q_scale") and probe.decode_has("kv_scale")):
            return [
                f"kv_cache_dtype {dtype_name(kv_cache_dtype)} is not supported by {where}: "
                "its mla_decode_fwd takes no q_scale / kv_scale (no fp8 kernels)"
            ]
        return []

    @classmethod
    def route_reasons(cls, platform: Platform, config: DecodeSelectorConfig, where: str) -> list[str]:
        """Why aiter's kernel tables cannot run `config` (each query length up to its max_query_len), and, where
        the config needs the LSE, which of them write none."""
        reasons = []
        num_heads = config.dims.num_heads
        kv = dtype_name(config.kv_cache_dtype)
        missing, no_lse = [], []
        for query_len in range(1, config.max_query_len + 1):
            route = aiter_decode_route(platform.arch, num_heads, query_len, config.kv_cache_dtype)
            if route is None:
                missing.append(query_len)
            elif not route.lse:
                no_lse.append(query_len)
        if num_heads > AITER_DECODE_MAX_NUM_HEADS:
            return [f"num_heads {num_heads} is not supported by {where}'s mla_decode_fwd; accepted: 1-"
                    f"{AITER_DECODE_MAX_NUM_HEADS} ({cls.supported_num_heads_text()})"]
        if config.max_query_len > AITER_DECODE_MAX_QUERY_LEN:
            reasons.append(f"max_query_len {config.max_query_len} is not supported by {where}'s mla_decode_fwd; "
                           f"accepted: 1-{AITER_DECODE_MAX_QUERY_LEN} where its kernel tables have a kernel")
        for query_len in missing:
            if query_len > AITER_DECODE_MAX_QUERY_LEN:
                break
            reasons.append(
                f"num_heads {num_heads} with {query_len} query token{'s' if query_len > 1 else ''} and a {kv} cache "
                f"is not supported by {where}: aiter's kernel tables ({AITER_SOURCE_TAG}) have no mla_decode_fwd "
                f"kernel for it; accepted with {query_len}: {_routes_text(platform.arch, query_len, config.kv_cache_dtype)}"
            )
        if getattr(config, "needs_lse", False) and no_lse:
            reasons.append(
                f"the LSE with num_heads {num_heads}, {', '.join(map(str, no_lse))} query tokens and a {kv} cache is "
                f"not written by {where}'s mla_decode_fwd (no kernel of its tables that runs it writes the LSE); "
                f"accepted with the LSE: the configurations whose route says LSE (mla-multi info), or another backend"
            )
        return reasons

    @classmethod
    def validate_configuration(cls, platform: Platform, config: DecodeSelectorConfig) -> list[str]:
        """Reasons the installed aiter cannot run `config` on `platform` (empty when it can)."""
        reasons = cls.availability_reasons() + _rocm_platform_reasons(platform)
        if reasons:
            return reasons
        probe = probe_aiter()
        where = f"{probe.label} on {_where(platform)}"
        reasons += _arch_reasons(probe, platform, "MLA decode")
        if reasons:
            return reasons
        if config.dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {dtype_name(config.dtype)} is not supported by {where}; supported: bfloat16")
        if config.kv_cache_dtype in (torch.float8_e4m3fnuz, torch.float8_e4m3fn):
            reasons += cls.fp8_kv_cache_reasons(probe, platform, config.kv_cache_dtype)
        elif config.kv_cache_dtype != torch.bfloat16:
            reasons.append(
                f"kv_cache_dtype {dtype_name(config.kv_cache_dtype)} is not supported by {where}; "
                f"supported: bfloat16{', ' + dtype_name(platform.fp8_dtype) if platform.fp8_dtype else ''}"
            )
        dims = config.dims
        if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (AITER_DECODE_KV_LORA_RANK, AITER_DECODE_QK_ROPE_HEAD_DIM):
            reasons.append(
                f"kv_lora_rank {dims.kv_lora_rank} / qk_rope_head_dim {dims.qk_rope_head_dim} are not supported by "
                f"{where}; its kernels are built for {AITER_DECODE_KV_LORA_RANK} / {AITER_DECODE_QK_ROPE_HEAD_DIM}"
            )
        if config.block_size < 1:
            reasons.append(f"block_size {config.block_size} is not supported by {where}; accepted: any positive size")
        if not reasons:
            reasons += cls.route_reasons(platform, config, where)
        return reasons

    @classmethod
    def info(cls) -> dict[str, Any]:
        info = super().info()
        probe = probe_aiter()
        from mla_multi.platforms import current_platform

        platform = current_platform()
        info.update(
            aiter_version=probe.version,
            aiter_source=f"{AITER_SOURCE_TAG} ({AITER_SOURCE_COMMIT[:12]})",
            num_heads=cls.supported_num_heads_text(),
            returns_lse=cls.provides_decode_lse(platform),
            kernel_archs=list(probe.kernel_archs) if probe.kernel_archs is not None else "unknown",
        )
        table = route_table(platform, (16, 32, 64, 128))
        if table is not None:
            info["routes"] = table["routes"]
        return info


# --------------------------------------------------------------------------- prefill


def quantize_per_tensor(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in `fp8_dtype`, its float32 scale [1]): scale = amax(|x|) / the FP8 type's largest finite value (aiter's
    per_tensor_quant rule), computed on x's device (no host read); an all-zero x gets scale 1."""
    from mla_multi.backends.reference import quantize_to_fp8

    amax = x.detach().abs().amax().float().reshape(1)
    scale = torch.where(amax > 0, amax / torch.finfo(fp8_dtype).max, torch.ones_like(amax))
    return quantize_to_fp8(x, scale, fp8_dtype), scale


def _fp8_prefill_metadata(batch: int, num_heads: int, max_seqlen_q: int, device: torch.device
                          ) -> dict[str, torch.Tensor]:
    """The FP8 prefill plan's six buffers, sized by aiter for this batch (one token a page, one query head a
    KV head)."""
    import aiter

    specs = aiter.get_ps_metadata_info_v1(
        batch_size=batch,
        num_head_k=num_heads,
        max_qlen=max(int(max_seqlen_q), 1),
        qlen_granularity=AITER_FP8_PREFILL_TILE_Q,
    )
    # get_ps_metadata_v1 names two of them otherwise
    return _allocate_work(specs, device, ("work_metadata_ptrs", "work_indptr", "work_info", "reduce_indptr",
                                         "reduce_final_map", "reduce_partial_map"))


def _fp8_prefill(q8, k8, v8, q_scale, k_scale, v_scale, cu_seqlens_q, qo_cpu, max_seqlen_q: int,
                 scale: float, causal: bool) -> torch.Tensor:
    """aiter's FP8 MLA prefill on FP8 q [T, N, 192], k [T, N, 192], v [T, N, 128] (one query head a KV head,
    one token a page): plan on the host (get_ps_metadata_v1), the persistent kernel, the reduce of the split
    tiles; qo_cpu: cu_seqlens_q on the host (the keys' too: no cached context). Returns out [T, N, 128]
    bfloat16."""
    import aiter

    device = q8.device
    tokens, num_heads = q8.shape[0], q8.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    lengths = (qo_cpu[1:] - qo_cpu[:-1]).to(torch.int32)
    buffers = _fp8_prefill_metadata(batch, num_heads, max_seqlen_q, device)
    aiter.get_ps_metadata_v1(
        seqlens_qo_indptr=qo_cpu,
        pages_kv_indptr=qo_cpu,
        context_lens=lengths,
        gqa_ratio=1,
        num_heads_k=num_heads,
        work_metadata_ptrs=buffers["work_metadata_ptrs"],
        work_indptr=buffers["work_indptr"],
        work_info=buffers["work_info"],
        reduce_indptr=buffers["reduce_indptr"],
        reduce_final_map=buffers["reduce_final_map"],
        reduce_partial_map=buffers["reduce_partial_map"],
        qhead_granularity=1,
        qlen_granularity=AITER_FP8_PREFILL_TILE_Q,
        kvlen_granularity=AITER_FP8_PREFILL_KV_GRANULARITY,
        block_size=AITER_FP8_PREFILL_BLOCK_SIZE,
        is_causal=bool(causal),
    )
    rows = buffers["reduce_partial_map"].shape[0] * AITER_FP8_PREFILL_TILE_Q
    partial_out = torch.empty((rows, num_heads, AITER_FP8_PREFILL_V_HEAD_DIM), dtype=torch.float32, device=device)
    partial_lse = torch.empty((rows, num_heads), dtype=torch.float32, device=device)
    out = torch.empty((tokens, num_heads, AITER_FP8_PREFILL_V_HEAD_DIM), dtype=torch.bfloat16, device=device)
    indptr = cu_seqlens_q.to(device=device, dtype=torch.int32)
    aiter.mla_prefill_ps_asm_fwd(
        Q=q8,
        K=k8,
        V=v8,
        qo_indptr=indptr,
        kv_indptr=indptr,
        kv_page_indices=torch.arange(k8.shape[0], dtype=torch.int32, device=device),
        work_indptr=buffers["work_indptr"],
        work_info_set=buffers["work_info"],
        max_seqlen_q=int(max_seqlen_q),
        softmax_scale=float(scale),
        is_causal=bool(causal),
        splitData=partial_out,
        splitLse=partial_lse,
        output=out,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    aiter.mla_reduce_v1(
        partial_output=partial_out,
        partial_lse=partial_lse,
        reduce_indptr=buffers["reduce_indptr"],
        reduce_final_map=buffers["reduce_final_map"],
        reduce_partial_map=buffers["reduce_partial_map"],
        max_seqlen_q=AITER_FP8_PREFILL_TILE_Q,
        num_kv_splits=0,
        final_output=out,
    )
    return out


class AiterMLAPrefillImpl(MLAPrefillImpl):
    """Varlen prefill through `aiter.flash_attn_varlen_func` (qk 192, v 128, no padding); with FP8 keys and
    values on gfx950, aiter's FP8 MLA prefill (`_fp8_prefill`)."""

    def forward_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        return_softmax_lse: bool,
        sink: torch.Tensor | None = None,
        *,
        q_scale=None,
        k_scale=None,
        v_scale=None,
    ):
        """q [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv] (float16 / bfloat16), cu_seqlens int32 [B + 1];
        sink float32 [N] (one logit a head that joins every row's softmax denominator), through aiter's
        `sink_ptr`.

        Returns out [Tq, N, Dv] and, with `return_softmax_lse`, lse [N, Tq] float32 (the keys' own; aiter
        picks its v3 assembly kernel on gfx942 / gfx950 when the LSE is asked for).

        FP8 (k and v in the platform's FP8 type, gfx950): aiter's FP8 MLA prefill, qk 192 / v 128, for new
        tokens with no cached context (cu_seqlens_k equal to cu_seqlens_q). k_scale / v_scale: their per-tensor
        dequantisation scales (a float or a 1-element tensor). The query, float16 / bfloat16 / float32, is
        quantised here per tensor (scale amax(|q|) / 448, on the device); an FP8 query takes its q_scale. The
        output is bfloat16 (float16 where q is). No LSE (`return_softmax_lse=True` and so context chunks are a
        ValueError) and no sink.
        """
        probe = probe_aiter()
        if probe.error:
            raise RuntimeError(probe.error)
        if k.dtype in FP8_DTYPES:
            return self._forward_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, return_softmax_lse,
                                     sink, q_scale, k_scale, v_scale)
        for name, value in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None:
                raise ValueError(f"{name} with {dtype_name(k.dtype)} keys: the scales belong to FP8 k / v; "
                                 f"accepted: {name}=None")
        import aiter

        keywords: dict[str, Any] = {}
        if sink is not None:
            if not probe.prefill_has("sink_ptr"):
                raise ValueError(f"a sink with ROCM_AITER prefill on {probe.label}: its flash_attn_varlen_func "
                                 "takes no sink_ptr; accepted: sink=None, or aiter v0.1.20 or later")
            keywords["sink_ptr"] = sink.to(device=q.device, dtype=torch.float32).contiguous()
        result = aiter.flash_attn_varlen_func(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=int(max_seqlen_q),
            max_seqlen_k=int(max_seqlen_k),
            softmax_scale=self.scale,
            causal=causal,
            return_lse=return_softmax_lse,
            **keywords,
        )
        if not return_softmax_lse:
            return result[0] if isinstance(result, (tuple, list)) else result
        out, lse = result[0], result[1]
        return out, prefill_lse_heads_tokens(lse, q.shape[1], q.shape[0], "aiter", out)

    def _forward_fp8(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, return_softmax_lse, sink,
                     q_scale, k_scale, v_scale):
        from mla_multi.platforms import current_platform

        platform = current_platform()
        where = f"ROCM_AITER's FP8 prefill on {_where(platform)}"
        if platform.arch not in AITER_FP8_PREFILL_ARCHS:
            raise ValueError(f"k dtype {dtype_name(k.dtype)}: {_fp8_prefill_text()} does not run on "
                             f"{platform.arch}; accepted: float16 / bfloat16 k and v")
        fp8 = platform.fp8_dtype
        if return_softmax_lse:
            raise ValueError(f"return_softmax_lse=True with {where}: {_FP8_PREFILL_NO_LSE}; accepted: "
                             "return_softmax_lse=False (new tokens without cached context), or float16 / "
                             "bfloat16 k and v")
        if sink is not None:
            raise ValueError(f"a sink with {where}: mla_prefill_ps_asm_fwd takes none; accepted: sink=None")
        tokens, heads = q.shape[0], q.shape[1]
        if (q.shape[2], v.shape[2]) != (AITER_FP8_PREFILL_QK_HEAD_DIM, AITER_FP8_PREFILL_V_HEAD_DIM):
            raise ValueError(f"q head dim {q.shape[2]} / v head dim {v.shape[2]} with {where}; accepted: "
                             f"{AITER_FP8_PREFILL_QK_HEAD_DIM} / {AITER_FP8_PREFILL_V_HEAD_DIM}")
        for name, tensor in (("k", k), ("v", v)):
            if tensor.dtype != fp8:
                raise ValueError(f"{name} dtype {dtype_name(tensor.dtype)} with {where}; accepted: "
                                 f"{dtype_name(fp8)} (with {name}_scale)")
            if tensor.shape[1] != heads:
                raise ValueError(f"{name} has {tensor.shape[1]} heads, q {heads}; accepted: one query head a KV "
                                 "head (aiter's FP8 prefill kernels are Gqa 1)")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"v has {v.shape[0]} tokens, k {k.shape[0]}; accepted: equal")
        if k_scale is None or v_scale is None:
            raise ValueError(f"k_scale={k_scale!r}, v_scale={v_scale!r} with FP8 k / v; accepted: a float or a "
                             "1-element tensor each (per-tensor dequantisation scales)")
        if q.dtype in FP8_DTYPES:
            if q.dtype != fp8 or q_scale is None:
                raise ValueError(f"an FP8 query ({dtype_name(q.dtype)}, q_scale={q_scale!r}) with {where}; "
                                 f"accepted: {dtype_name(fp8)} with q_scale, or a float query (quantised here)")
            q8, q_scale = q, _scale_tensor(q_scale, q.device)
        else:
            if q_scale is not None:
                raise ValueError(f"q_scale with a {dtype_name(q.dtype)} query: the adapter quantises it with its "
                                 "own per-tensor scale; accepted: q_scale=None, or an FP8 query")
            q8, q_scale = quantize_per_tensor(q, fp8)
        qo_cpu = cu_seqlens_q.to("cpu", torch.int32)  # aiter's planner runs on the host: one read a call
        if cu_seqlens_k is not cu_seqlens_q and not torch.equal(qo_cpu, cu_seqlens_k.to("cpu", torch.int32)):
            raise ValueError(f"cu_seqlens_k differs from cu_seqlens_q with {where}: it runs new tokens with no "
                             "cached context (their keys are the queries' own); accepted: cu_seqlens_k = "
                             "cu_seqlens_q, or float16 / bfloat16 k and v for context")
        if k.shape[0] != tokens:
            raise ValueError(f"k has {k.shape[0]} tokens, q {tokens}; accepted: equal (no cached context)")
        out_dtype = torch.float16 if q.dtype == torch.float16 else torch.bfloat16
        if tokens == 0:
            return q.new_zeros((0, heads, AITER_FP8_PREFILL_V_HEAD_DIM), dtype=out_dtype)
        out = _fp8_prefill(q8.contiguous(), k.contiguous(), v.contiguous(), q_scale, _scale_tensor(k_scale, k.device),
                           _scale_tensor(v_scale, v.device), cu_seqlens_q, qo_cpu, max_seqlen_q, self.scale, causal)
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


class AiterMLAPrefillBackend(MLAPrefillBackend):
    """`aiter.flash_attn_varlen_func`: CK / assembly flash attention on gfx942 / gfx950; FP8 keys and values
    (gfx950) through aiter's FP8 MLA prefill."""

    name: ClassVar[str] = "ROCM_AITER"
    vendors = frozenset({"rocm"})
    supported_dtypes = (torch.float16, torch.bfloat16)

    @staticmethod
    def get_prefill_impl_cls():
        return AiterMLAPrefillImpl

    @classmethod
    def availability_reasons(cls) -> list[str]:
        return _call_reasons(FLASH_ATTN_VARLEN_FUNC, "prefill")

    @classmethod
    def validate_configuration(cls, platform: Platform, config: PrefillSelectorConfig) -> list[str]:
        """Reasons the installed aiter cannot run `config` on `platform` (empty when it can). An FP8 dtype is
        the FP8 prefill's (FP8 k and v; see `AiterMLAPrefillImpl.forward_varlen`)."""
        reasons = cls.availability_reasons() + _rocm_platform_reasons(platform)
        if reasons:
            return reasons
        probe = probe_aiter()
        where = f"{probe.label} on {_where(platform)}"
        reasons += _arch_reasons(probe, platform, "flash-attention")
        dims = config.dims
        if config.dtype in FP8_DTYPES:
            return reasons + _fp8_prefill_reasons(probe, platform, config, where)
        if config.dtype not in cls.supported_dtypes:
            fp8 = (f", {dtype_name(platform.fp8_dtype)} (FP8 k / v: aiter's FP8 MLA prefill)"
                   if platform.arch in AITER_FP8_PREFILL_ARCHS and platform.fp8_dtype is not None else "")
            reasons.append(
                f"dtype {dtype_name(config.dtype)} is not supported by {where}; supported: "
                + ", ".join(dtype_name(d) for d in cls.supported_dtypes) + fp8
            )
        for label, value in (("qk_head_dim", dims.qk_head_dim), ("v_head_dim", dims.v_head_dim)):
            if value > AITER_PREFILL_MAX_HEAD_DIM or value % 8:
                reasons.append(
                    f"{label} {value} is not supported by {where}; accepted: a multiple of 8 up to {AITER_PREFILL_MAX_HEAD_DIM}"
                )
        return reasons

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes or dtype in FP8_DTYPES

    @classmethod
    def info(cls) -> dict[str, Any]:
        info = super().info()
        summary = fp8_prefill_summary()
        info.update(aiter_version=probe_aiter().version, fp8_prefill=summary,
                    implementation=f"flash_attn_varlen_func; FP8 prefill: {summary}")
        return info


def fp8_prefill_summary(platform: Platform | None = None) -> str:
    """One line on ROCM_AITER's FP8 prefill on `platform` (the current one by default), from aiter's tables."""
    if platform is None:
        from mla_multi.platforms import current_platform

        platform = current_platform()
    if platform.vendor != "rocm" or platform.arch not in AITER_FP8_PREFILL_TABLE:
        return "none off gfx942 / gfx950"
    if platform.arch not in AITER_FP8_PREFILL_ARCHS:
        return (f"declined on {platform.arch}: aiter refuses it ('fp8 mla persistent prefill is not supported on "
                "gfx942')")
    return (f"FP8 k / v ({dtype_name(platform.fp8_dtype)}, per-tensor k_scale / v_scale; the query quantised here "
            f"per tensor, amax / 448): mla_prefill_ps_asm_fwd ({', '.join(AITER_FP8_PREFILL_KERNELS)}) over "
            "get_ps_metadata_v1 work + mla_reduce_v1, any head count (one query head a KV head), qk 192 / v 128, "
            "causal or not, new tokens only (no cached context), bfloat16 out, no LSE, no sink")


# --------------------------------------------------------------------------- sparse MLA


@dataclasses.dataclass(frozen=True)
class SparseKVIndices:
    """Sparse index lists as `mla_decode_fwd`'s page-size-1 indexing, one request per query token.

    All int32 on the indices' device: qo_indptr [T + 1] (arange), kv_indptr
    [T + 1] (prefix sums of `counts`), kv_indices [T * topk] (token t's valid
    rows, in list order, at kv_indptr[t] .. kv_indptr[t + 1]; the tail past
    kv_indptr[T] holds 0 and is never read), kv_last_page_lens [T] (ones) and
    counts [T] (valid entries a token). `bad` [T] bool marks the tokens whose
    list holds an index outside [-1, num_rows) (None where such an index is
    simply no token).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_lens: torch.Tensor
    counts: torch.Tensor
    bad: torch.Tensor | None


def sparse_kv_indices(
    indices: torch.Tensor, num_rows: int, topk_length: torch.Tensor | None = None, *, out_of_range_is_bad: bool = True,
    by_token: bool = False,
) -> SparseKVIndices:
    """aiter's indexing of sparse index lists, built on the device.

    indices int32 [T, topk] (rows of a page-size-1 cache; -1 is no token, a
    duplicate counts twice), topk_length [T] (only the first topk_length[t]
    entries count), num_rows the cache's rows. An entry is valid when it is
    in [0, num_rows) and within topk_length; valid entries are compacted,
    stably, to the front of kv_indices: entry k of the flattened list goes to
    the number of valid entries before it, the invalid ones fill the tail in
    order, so one scatter writes every position once. An index outside
    [-1, num_rows) is never passed on; with `out_of_range_is_bad` it marks its
    token in `bad` (decode), wherever it stands in the list.

    Shapes depend only on the input shapes and nothing is read back to the
    host (no synchronisation; capturable in a graph); the price is O(T * topk)
    temporary index memory.

    `by_token`: aiter's persistent sparse layout instead: token t's valid
    entries compacted to the front of kv_indices[t * topk : (t + 1) * topk]
    (its invalid ones after them), kv_indptr still the prefix sums of counts
    (the metadata reads min(count, topk) = count entries from t * topk).
    """
    device = indices.device
    tokens, topk = indices.shape
    total = tokens * topk
    if total > _MAX_INT32:
        raise ValueError(
            f"indices has {tokens} x {topk} entries; accepted by ROCM_AITER: at most {_MAX_INT32} (int32 kv_indices)"
        )
    if num_rows > _MAX_INT32:
        raise ValueError(f"the cache has {num_rows} rows; accepted by ROCM_AITER: at most {_MAX_INT32} (int32 kv_indices)")
    index = indices.to(torch.int32)
    in_range = (index >= 0) & (index < num_rows)
    bad = (~in_range & (index != -1)).any(dim=1) if out_of_range_is_bad else None
    valid = in_range
    if topk_length is not None:
        positions = torch.arange(topk, device=device, dtype=torch.int32)
        valid = valid & (positions.unsqueeze(0) < topk_length.to(device=device, dtype=torch.int32).unsqueeze(1))
    counts = valid.sum(dim=1, dtype=torch.int32)
    kv_indptr = torch.zeros(tokens + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(counts, dim=0, dtype=torch.int32)
    kv_indices = torch.zeros(total, dtype=torch.int32, device=device)
    if total and by_token:
        before_valid = torch.cumsum(valid, dim=1, dtype=torch.int32) - valid.to(torch.int32)
        before_invalid = torch.cumsum(~valid, dim=1, dtype=torch.int32) - (~valid).to(torch.int32)
        rows = torch.arange(tokens, device=device, dtype=torch.int32).unsqueeze(1) * topk
        destination = rows + torch.where(valid, before_valid, counts.unsqueeze(1) + before_invalid)
        kv_indices.scatter_(0, destination.reshape(-1).long(), torch.where(valid, index, 0).reshape(-1))
    elif total:
        flat_valid = valid.reshape(-1)
        valid_through = torch.cumsum(flat_valid, dim=0)  # valid entries up to and including each entry
        entry = torch.arange(total, device=device)
        destination = torch.where(flat_valid, valid_through - 1, valid_through[-1] + entry - valid_through)
        kv_indices.scatter_(0, destination, torch.where(flat_valid, index.reshape(-1), 0))
    return SparseKVIndices(
        qo_indptr=torch.arange(tokens + 1, dtype=torch.int32, device=device),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_lens=torch.ones(tokens, dtype=torch.int32, device=device),
        counts=counts,
        bad=bad,
    )


def _sparse_mla_decode_fwd(
    query: torch.Tensor, kv_buffer: torch.Tensor, output: torch.Tensor, index: SparseKVIndices, scale: float,
    with_lse: bool, probe: AiterProbe,
) -> torch.Tensor | None:
    """The sparse phases' one call into aiter: writes `output`, returns aiter's LSE [T, heads] with `with_lse`."""
    from aiter.mla import mla_decode_fwd

    # at least two splits: aiter's second stage then merges them and writes the LSE (one split leaves it unwritten)
    keywords: dict[str, Any] = dict(sm_scale=float(scale), num_kv_splits=AITER_NON_PERSISTENT_SPLITS)
    if with_lse:
        keywords["return_lse"] = True
    result = mla_decode_fwd(
        q=query,
        kv_buffer=kv_buffer,
        o=output,
        qo_indptr=index.qo_indptr,
        kv_indptr=index.kv_indptr,
        kv_indices=index.kv_indices,
        kv_last_page_lens=index.kv_last_page_lens,
        max_seqlen_q=1,
        **keywords,
    )
    if not with_lse:
        return None
    lse = result[1] if isinstance(result, (tuple, list)) and len(result) > 1 else None
    if lse is None:
        raise RuntimeError(f"{probe.label}'s mla_decode_fwd(return_lse=True) returned no LSE")
    return lse


def _sparse_persistent_heads(probe: AiterProbe, arch: str, heads: int, with_lse: bool) -> bool:
    """Whether the sparse call for `heads` (bfloat16, one query token a batch) runs on aiter's persistent sparse
    metadata: where this aiter has the metadata functions, and aiter's table a persistent kernel for the heads as
    they are (no folding) that writes the LSE (the sparse phases return it; gfx942 has no bfloat16 one)."""
    return (probe.has_metadata and with_lse and _persistent_heads_as_is(arch, "bf16", "bf16", heads, 1)
            and aiter_decode_kernel(arch, "bf16", "bf16", heads, 1, True, True) is not None)


def _sparse_persistent_mla_decode_fwd(
    query: torch.Tensor, kv_buffer: torch.Tensor, output: torch.Tensor, index: SparseKVIndices, scale: float,
    topk: int, probe: AiterProbe,
) -> torch.Tensor:
    """The persistent sparse call: aiter's sparse metadata for `index` (built `by_token`), then mla_decode_fwd;
    writes `output`, returns aiter's LSE [T, heads]."""
    import aiter
    from aiter.mla import mla_decode_fwd

    tokens, heads, _ = query.shape
    device = query.device
    specs = aiter.get_mla_metadata_info_v1(
        batch_size=tokens, max_seqlen_qo=1, num_head_qo=heads, q_dtype=query.dtype, kv_dtype=kv_buffer.dtype,
        is_sparse=True, fast_mode=True, num_kv_splits=AITER_SPARSE_PERSISTENT_SPLITS,
    )
    work = _allocate_work(specs, device)
    aiter.get_mla_metadata_v1(
        seqlens_qo_indptr=index.qo_indptr,
        seqlens_kv_indptr=index.kv_indptr,
        kv_last_page_lens=index.kv_last_page_lens,
        num_heads_per_head_k=heads,
        num_heads_k=1,
        is_causal=True,
        work_metadata_ptrs=work["work_meta_data"],
        work_info_set=work["work_info_set"],
        work_indptr=work["work_indptr"],
        reduce_indptr=work["reduce_indptr"],
        reduce_final_map=work["reduce_final_map"],
        reduce_partial_map=work["reduce_partial_map"],
        page_size=1,
        kv_granularity=16,
        max_seqlen_qo=1,
        uni_seqlen_qo=1,
        fast_mode=True,
        topk=topk,
        max_split_per_batch=AITER_SPARSE_PERSISTENT_SPLITS,
        dtype_q=query.dtype,
        dtype_kv=kv_buffer.dtype,
    )
    result = mla_decode_fwd(
        q=query,
        kv_buffer=kv_buffer,
        o=output,
        qo_indptr=index.qo_indptr,
        kv_indptr=index.kv_indptr,
        kv_indices=index.kv_indices,
        kv_last_page_lens=index.kv_last_page_lens,
        max_seqlen_q=1,
        page_size=1,
        nhead_kv=1,
        sm_scale=float(scale),
        num_kv_splits=AITER_SPARSE_PERSISTENT_SPLITS,
        work_meta_data=work["work_meta_data"],
        work_indptr=work["work_indptr"],
        work_info_set=work["work_info_set"],
        reduce_indptr=work["reduce_indptr"],
        reduce_final_map=work["reduce_final_map"],
        reduce_partial_map=work["reduce_partial_map"],
        return_lse=True,
    )
    lse = result[1] if isinstance(result, (tuple, list)) and len(result) > 1 else None
    if lse is None:
        raise RuntimeError(f"{probe.label}'s mla_decode_fwd(return_lse=True) returned no LSE")
    return lse


class _AiterSparseImpl(MLASparseImpl):
    """Sparse MLA through `aiter.mla.mla_decode_fwd`: each query token a request of its own over page-size-1 rows.

    Results follow the REFERENCE semantics: a token without a valid index
    gives 0 and LSE -inf (aiter leaves such a request undefined: the rows are
    replaced after the call from the per-token counts); attn_sink scales out
    by 1 / (1 + exp(sink - lse)) after the call; in decode a token whose list
    holds an index outside [-1, num_slots) gets NaN rows and LSE and ORs
    `errors.SPARSE_INDEX` into the device's error flag, its bad entries never
    reaching aiter. The LSE is aiter's (natural log) where its mla_decode_fwd
    has `return_lse`; elsewhere the LSE returned is None and attn_sink is a
    ValueError. Nothing is read back to the host.
    """

    out_of_range_is_bad: ClassVar[bool] = True
    phase: ClassVar[str] = "sparse_decode"

    def _attend(self, q_nope, q_pe, kv_buffer, indices, scale, topk_length, attn_sink):
        probe = probe_aiter()
        if probe.error:
            raise RuntimeError(probe.error)
        with_lse = probe.decode_has("return_lse")
        if attn_sink is not None and not with_lse:
            raise ValueError(
                f"attn_sink with ROCM_AITER {self.phase} on {probe.label}: the sink is applied from the LSE, and "
                "this aiter's mla_decode_fwd returns none (it has no return_lse parameter); accepted: attn_sink=None, "
                "an aiter whose mla_decode_fwd has return_lse, or another backend (REFERENCE, TRITON)"
            )
        if q_nope.dtype != torch.bfloat16 or q_pe.dtype != torch.bfloat16:
            raise ValueError(
                f"q_nope / q_pe are {dtype_name(q_nope.dtype)} / {dtype_name(q_pe.dtype)}; accepted by ROCM_AITER: bfloat16"
            )
        tokens, num_heads, kv_lora_rank = q_nope.shape
        width = kv_buffer.shape[-1]
        if kv_lora_rank + q_pe.shape[-1] != width:
            raise ValueError(
                f"q_nope / q_pe widths {kv_lora_rank} / {q_pe.shape[-1]} do not add up to the kv width {width}"
            )
        device = q_nope.device
        arch = _runtime_arch()
        heads = _sparse_heads(arch, num_heads)
        if heads is None:
            raise ValueError(f"num_heads {num_heads} is not supported by ROCM_AITER {self.phase} on {arch}; "
                             f"supported: {_decode_num_heads_text(arch)}")
        persistent = _sparse_persistent_heads(probe, arch, heads, with_lse)
        index = sparse_kv_indices(indices, kv_buffer.shape[0], topk_length,
                                  out_of_range_is_bad=self.out_of_range_is_bad, by_token=persistent)
        query = _padded_query(torch.cat([q_nope, q_pe], dim=-1), heads)
        padded_heads = query.shape[1]
        output = torch.empty(tokens, padded_heads, kv_lora_rank, dtype=q_nope.dtype, device=device)
        raw_lse = None
        if index.kv_indices.numel() and persistent:
            raw_lse = _sparse_persistent_mla_decode_fwd(query, kv_buffer, output, index, scale, indices.shape[1],
                                                        probe)
        elif index.kv_indices.numel():
            raw_lse = _sparse_mla_decode_fwd(query, kv_buffer, output, index, scale, with_lse, probe)
        # aiter leaves a request without tokens undefined; the convention is 0 / -inf.
        has_tokens = (index.counts > 0).unsqueeze(1)
        out = torch.where(has_tokens.unsqueeze(2), output[:, :num_heads], torch.zeros((), dtype=output.dtype, device=device))
        lse = None
        if with_lse:
            minus_inf = torch.full((), float("-inf"), device=device)
            if raw_lse is None:  # no entries at all: aiter was not called
                lse = minus_inf.expand(tokens, num_heads).clone()
            else:
                lse = torch.where(has_tokens, raw_lse.reshape(tokens, padded_heads)[:, :num_heads].float(), minus_inf)
            if attn_sink is not None:
                factor = torch.sigmoid(torch.where(has_tokens, lse, 0.0) - attn_sink.to(device=device, dtype=torch.float32))
                factor = torch.where(has_tokens, factor, 1.0)
                out = (out.float() * factor.unsqueeze(2)).to(output.dtype)
        if index.bad is not None:
            bad = index.bad.unsqueeze(1)
            out = out.masked_fill(bad.unsqueeze(2), float("nan"))
            lse = lse.masked_fill(bad, float("nan")) if lse is not None else None
            # recorded on the device without a synchronisation
            errors.error_flag(device).bitwise_or_(index.bad.any().to(torch.int32) * errors.SPARSE_INDEX)
        return out, lse


class AiterSparseDecodeImpl(_AiterSparseImpl):
    """Sparse decode over the paged cache [num_blocks, block_size, 576] (bfloat16), viewed with page size 1."""

    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        """q_nope [T, N, 512], q_pe [T, N, 64] bfloat16; kv the paged bfloat16 cache; indices int32 [T, topk]
        (slot = block * block_size + offset); topk_length [T]; attn_sink float32 [N].

        Returns out [T, N, 512] bfloat16 and lse [T, N] float32, or None where the installed aiter returns no LSE.
        """
        if kv.dim() != 3 or kv.dtype != torch.bfloat16:
            raise ValueError(
                f"kv_cache is {dtype_name(kv.dtype)} of shape {tuple(kv.shape)}; accepted by ROCM_AITER sparse decode: "
                "a bfloat16 cache [num_blocks, block_size, 576]"
            )
        if not kv.is_contiguous():
            raise ValueError("kv_cache is not contiguous; accepted by ROCM_AITER: a contiguous cache (viewed with page size 1)")
        num_blocks, block_size, width = kv.shape
        kv_buffer = kv.view(num_blocks * block_size, 1, 1, width)
        return self._attend(q_nope, q_pe, kv_buffer, indices, scale, topk_length, attn_sink)


class AiterSparsePrefillImpl(_AiterSparseImpl):
    """Sparse prefill over kv rows [S_kv, 576] (bfloat16), a cache of one-token pages; an index -1 or outside
    [0, S_kv) is no token."""

    out_of_range_is_bad: ClassVar[bool] = False
    phase: ClassVar[str] = "sparse_prefill"

    def forward(self, q_nope, q_pe, kv, indices, scale, *, k_scale=None, topk_length=None, attn_sink=None):
        """q_nope [T, N, 512], q_pe [T, N, 64] bfloat16; kv [S_kv, 576] bfloat16; indices int32 [T, topk] rows of kv.

        Returns out [T, N, 512] bfloat16 and lse [T, N] float32, or None where the installed aiter returns no LSE.
        """
        if kv.dim() != 2 or kv.dtype != torch.bfloat16:
            raise ValueError(
                f"kv is {dtype_name(kv.dtype)} of shape {tuple(kv.shape)}; accepted by ROCM_AITER sparse prefill: "
                "bfloat16 rows [S_kv, 576]"
            )
        rows, width = kv.shape
        kv_buffer = kv.contiguous().view(rows, 1, 1, width)
        return self._attend(q_nope, q_pe, kv_buffer, indices, scale, topk_length, attn_sink)


def _sparse_fp8_future(probe: AiterProbe) -> str:
    present = probe.sparse_fp8_kernels
    where = f"present in {probe.label}: {', '.join(present)}" if present else f"none of them is in {probe.label}"
    return (
        "possible future paths in aiter's source: hk_mla_v32_decode_fwd, HipKittens' DeepSeek V3.2 decode kernel "
        "(FP8 query and cache, heads x query tokens = 128, or 64 on gfx950; gfx942 / gfx950; experimental, behind "
        "mla_decode_fwd's persistent metadata), and mla_decode_fwd_ds32 (gfx950; FP8 NoPE with E8M0 block scales "
        f"and bf16 RoPE in separate buffers); {where}"
    )


def _sparse_kv_dtype_reasons(probe: AiterProbe, where: str, kv_dtype: torch.dtype) -> list[str]:
    """Why an FP8 or fp8_ds_mla cache cannot go through the sparse path (the base class names the dtype)."""
    if kv_dtype in FP8_DTYPES:
        return [
            f"an FP8 cache ({dtype_name(kv_dtype)}) is not supported by ROCM_AITER sparse MLA on {where}: the sparse "
            "path passes the bfloat16 query as it is, and mla_decode_fwd reads an FP8 cache only in its a8w8 kernels "
            "(FP8 query with a per-tensor q_scale); " + _sparse_fp8_future(probe)
        ]
    if kv_dtype == torch.uint8:
        return [
            f"the fp8_ds_mla cache (uint8, 656 bytes a token: FP8 values with a float32 scale per 128, then bf16 "
            f"rotary values) is not supported by ROCM_AITER sparse MLA on {where}: mla_decode_fwd has no kernel that "
            "reads this layout; " + _sparse_fp8_future(probe)
        ]
    return []


# aiter's DeepSeek-V4 decode entry points at AITER_SOURCE_COMMIT, both declined (`_v4_reasons`):
# * `aiter.mla.mla_v40_decode_fwd`: gfx950 only, and only with AITER_ENABLE_EXPERIMENTAL set (else
#   NotImplementedError), heads x query tokens 64 or 128, page size 1 or 64, persistent over
#   get_mla_metadata_v1(mla_version=V40) work for dense per-request pages; an FP8 query packed with its UE8M0
#   scales (448 e4m3 + the 7 per-64 scales each duplicated, 14 bytes, + 50 pad = 512 bytes) and its RoPE part in a
#   separate bf16 buffer; the cache the same: 512 + 128 = 640 bytes a token; an optional sink folded into the
#   softmax (and so into the LSE it returns); HipKittens' hk_mla_v40_decode_fwd runs it.
# * `aiter.mla.mla_decode_fwd_v4_nm`: a required sink, FP8 query and cache packed with UE8M0 scales and the RoPE
#   parts in separate bf16 buffers, page size 1, non-persistent splits merged without a final LSE, the softmax
#   scale fixed at 1/sqrt(512) in the kernel (sm_scale ignored); one kernel in hsa/gfx950/mla_v4/mla_v4_asm.csv
#   (Gqa 64, one query token), onto which csrc/py_itfs_cu/asm_mla_v4.cu maps 16 heads x 1, 2 or 4 query tokens and
#   32, 64 or 128 heads x 1.
AITER_V4_EXPERIMENTAL_SWITCH = "AITER_ENABLE_EXPERIMENTAL"
AITER_V40_ARCHS: tuple[str, ...] = ("gfx950",)
AITER_V40_HEADS_X_QUERY_TOKENS: tuple[int, ...] = (64, 128)
AITER_V40_PAGE_SIZES: tuple[int, ...] = (1, 64)
AITER_V40_DIMS = {"_V40_DIM_NOPE": 448, "_V40_DIM_ROPE": 64, "_V40_DIM_QK_PACKED": 512}
AITER_V40_TOKEN_BYTES = AITER_V40_DIMS["_V40_DIM_QK_PACKED"] + 2 * AITER_V40_DIMS["_V40_DIM_ROPE"]  # 640
AITER_V4_NM_TABLE: dict[str, frozenset[tuple[str, str, int, int, int, int, int, int, str]]] = {
    "gfx950": frozenset({("fp8", "fp8", 64, 0, 1, 0, 0, 0, "mla_a8w8_qh64_qseqlen1_gqaratio64_nm")}),
}
AITER_V4_NM_HEADS: dict[int, tuple[int, ...]] = {16: (1, 2, 4), 32: (1,), 64: (1,), 128: (1,)}
AITER_V4_KERNELS: tuple[str, ...] = ("mla_v40_decode_fwd", "mla_decode_fwd_v4_nm")


def _v4_reasons(platform: Platform, config: SparseSelectorConfig, where: str) -> list[str]:
    """Why ROCM_AITER declines the V4 contract on `platform`: what aiter's V4 kernels take, and the decision."""
    formats = " and ".join(dict.fromkeys(f for f in (config.kv_format, config.extra_kv_format) if f is not None))
    reasons = [f"the V4 contract (d_qk = d_v = 512) over {formats} is not implemented by ROCM_AITER; V4 formats "
               f"supported: none (aiter {AITER_SOURCE_TAG}'s V4 kernels {', '.join(AITER_V4_KERNELS)} are declined)"]
    if config.kv_format == "rows":
        reasons.append(f"aiter {AITER_SOURCE_TAG} has no V4 sparse prefill: its V4 kernels are decodes over FP8 "
                       "packed caches; none reads float rows")
        return reasons
    if platform.arch not in AITER_V40_ARCHS:
        reasons.append(f"aiter {AITER_SOURCE_TAG}'s V4 decode kernels ({', '.join(AITER_V4_KERNELS)}) run on gfx950 "
                       f"only (mla_decode_fwd_v4_nm also on gfx1250); none for {where}")
        return reasons
    heads, queries = config.dims.num_heads, config.max_query_len
    switch = os.environ.get(AITER_V4_EXPERIMENTAL_SWITCH)
    reasons.append(
        f"mla_v40_decode_fwd declined (not converted): aiter runs it only with {AITER_V4_EXPERIMENTAL_SWITCH} set "
        f"(here {'unset' if switch is None else repr(switch)}) and heads x query tokens "
        f"{' or '.join(map(str, AITER_V40_HEADS_X_QUERY_TOKENS))} (here {heads} x {queries}); it reads one cache a "
        "call (the window segment would have to be copied beside the top-k one), an FP8 query with UE8M0 scales "
        "(the V4 contract's query is bfloat16), and returns its LSE with the sink folded in; its cache row is "
        f"{AITER_V40_TOKEN_BYTES} bytes (448 e4m3 + the 7 UE8M0 scales each twice + 50 pad, and the RoPE part in "
        "a separate bf16 buffer): fp8_ds_mla_v4's 584 bytes convert exactly (the same e4m3 values and scales), "
        f"at 584 bytes read and {AITER_V40_TOKEN_BYTES} written a token a step before the kernel reads the copy"
    )
    nm_heads = ", ".join(f"{h} x {'/'.join(map(str, q))}" for h, q in AITER_V4_NM_HEADS.items())
    reasons.append(
        "mla_decode_fwd_v4_nm declined: its kernel fixes the softmax scale at 1/sqrt(512) (sm_scale ignored; the "
        "V4 contract takes the caller's), its split merge writes no final LSE (the V4 op returns one), it "
        "requires a sink and takes FP8 packed query and cache rows, page size 1, heads x query tokens "
        f"{nm_heads} (here {heads} x {queries})"
    )
    return reasons


class _AiterSparseBackend(MLASparseBackend):
    """What both sparse phases need: an aiter with `mla_decode_fwd` on ROCm gfx942 / gfx950, bfloat16 throughout."""

    name: ClassVar[str] = "ROCM_AITER"
    vendors = frozenset({"rocm"})
    supported_dtypes = (torch.bfloat16,)
    supported_kv_dtypes = (torch.bfloat16,)
    max_num_heads = 128
    # Query tokens are flattened: each is a request of its own.
    max_query_len = 1 << 16
    # As the dense decode: the indexing is built on the device with static shapes (sparse_kv_indices).
    supports_cuda_graphs: ClassVar[bool] = True

    @classmethod
    def availability_reasons(cls) -> list[str]:
        return _call_reasons(SPARSE_MLA_DECODE_FWD, "decode")

    @classmethod
    def platform_reasons(cls, platform: Platform) -> list[str]:
        reasons = _rocm_platform_reasons(platform)
        probe = probe_aiter()
        if reasons or probe.error:
            return reasons
        return _arch_reasons(probe, platform, "MLA decode")

    @classmethod
    def provides_lse(cls) -> bool:
        """Whether forward returns an LSE, and so takes attn_sink (aiter's mla_decode_fwd has `return_lse`)."""
        probe = probe_aiter()
        return probe.error is None and probe.decode_has("return_lse")

    @classmethod
    def validate_configuration(cls, platform: Platform, config: SparseSelectorConfig) -> list[str]:
        """Reasons the installed aiter cannot run `config` on `platform` (empty when it can); a V4 configuration
        always has them (`_v4_reasons`, from aiter's source, installed or not)."""
        reasons = super().validate_configuration(platform, config)
        if config.v4:
            generic = [r for r in reasons if r.startswith("the V4 contract")]
            reasons = [r for r in reasons if r not in generic]
            return reasons + _v4_reasons(platform, config, _where(platform))
        probe = probe_aiter()
        if probe.error or platform.vendor != "rocm":
            return reasons
        where = f"{probe.label} on {_where(platform)}"
        reasons += _sparse_kv_dtype_reasons(probe, where, config.kv_dtype)
        reasons += _decode_shape_reasons(config.dims, where, platform.arch)
        return reasons

    @classmethod
    def info(cls) -> dict[str, Any]:
        info = super().info()
        probe = probe_aiter()
        info.update(
            aiter_version=probe.version,
            num_heads=_decode_num_heads_text(),
            cuda_graphs=cls.supports_cuda_graphs,
            returns_lse=cls.provides_lse(),
            attn_sink="applied from the LSE" if cls.provides_lse() else "needs an aiter with return_lse (ValueError)",
            v4=f"declined: aiter {AITER_SOURCE_TAG}'s {', '.join(AITER_V4_KERNELS)} (gfx950; their own "
               f"{AITER_V40_TOKEN_BYTES}-byte FP8 layouts, see the reasons)",
        )
        return info


class AiterSparseDecodeBackend(_AiterSparseBackend):
    """Sparse decode through `aiter.mla.mla_decode_fwd`, one request per query token (bfloat16 caches)."""

    @staticmethod
    def get_impl_cls():
        return AiterSparseDecodeImpl


class AiterSparsePrefillBackend(_AiterSparseBackend):
    """Sparse prefill through `aiter.mla.mla_decode_fwd` over kv rows as one-token pages (bfloat16)."""

    @staticmethod
    def get_impl_cls():
        return AiterSparsePrefillImpl


__all__ = [
    "AITER_CALLS",
    "AiterCall",
    "AiterMLADecodeBackend",
    "AiterMLADecodeImpl",
    "AiterMLAPrefillBackend",
    "AiterMLAPrefillImpl",
    "AiterProbe",
    "AiterSparseDecodeBackend",
    "AiterSparseDecodeImpl",
    "AiterSparsePrefillBackend",
    "AiterSparsePrefillImpl",
    "SparseKVIndices",
    "fp8_prefill_summary",
    "quantize_per_tensor",
    "clear_probe_cache",
    "paged_kv_indices",
    "probe_aiter",
    "sparse_kv_indices",
]
