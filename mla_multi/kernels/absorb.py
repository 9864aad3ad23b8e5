"""The absorbed products of a decode step (Triton): W_UK into the queries, W_UV out of the latent.

MLA's decode attends in the latent space: each head's query is multiplied into
the latent by W_UK before the attention (``ql[t, h] = q_nope[t, h] @ W_UK[h]``,
[P] x [P, Lkv]) and each head's latent output out of it by W_UV after
(``o[t, h] = latent[t, h] @ W_UV[h]``, [Lkv] x [Lkv, V]). A batched product
does both at the weights' streaming pace; for a few decode tokens a Triton
launch does the same at the same pace with half the host work of a
``torch.bmm``, and the product before the attention takes the step's cache
write into the same launch:

* `_decode_prologue_kernel`: the step's cache write (`cache_ops`' row writer,
  one program a token, FP8 caches quantised by the scale) and the W_UK
  product (one program per head and ``BLOCK_L`` latent columns, every token
  of the step in one ``[BLOCK_T, P] x [P, BLOCK_L]`` product) in one launch.
* `_up_project_kernel`: one program per head and ``BLOCK_V`` output columns,
  the latent row's ``BLOCK_K`` columns a step against the weight's rows.

Both take up to ``MAX_TOKENS`` tokens (one product tile of rows); the layer
(`mla_multi.attention.MLAAttention`) takes ``torch.bmm`` beyond. Every
tensor is read by its strides; the weights are per-head views of
``kv_b_proj``'s weight.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mla_multi.kernels import capturing_on
from mla_multi.kernels.cache_ops import _FP8_EXPONENT_BIAS as FP8_EXPONENT_BIAS
from mla_multi.kernels.cache_ops import FP8_DTYPES, FP8_MAX, _write_token_row
from mla_multi.kernels.launch import alignment_key, bound_by_layout
from mla_multi.kernels.launch_config import CompileSpec

__all__ = ["MAX_TOKENS", "DecodeProducts", "products_reason", "compile_specs"]

MAX_TOKENS = 16  # tokens a launch takes: one product tile of rows (the MMA's least)


@triton.jit
def _decode_prologue_kernel(
    Q,
    W_uk,
    Ql,
    KV_c,
    K_pe,
    KV_cache,
    Slot_mapping,
    Scale,
    Error_flag,
    num_tokens,
    stride_q_t,
    stride_q_h,
    stride_w_h,
    stride_w_p,
    stride_ql_h,
    stride_ql_t,
    stride_kv_c_t,
    stride_k_pe_t,
    stride_cache_block,
    stride_cache_token,
    block_size,
    num_slots,
    NOPE: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Programs 0 .. num_tokens - 1 write token `pid`'s ``[kv_c | k_pe]`` row into its cache slot
    (`cache_ops._write_token_row`); each later one multiplies every token's query of one head into
    BLOCK_L columns of the latent: Ql[head, t, cols] = Q[t, head, :NOPE] @ W_uk[head, :, cols]."""
    pid = tl.program_id(0)
    if pid < num_tokens:
        _write_token_row(pid.to(tl.int64), KV_c, K_pe, KV_cache, Slot_mapping, Scale, Error_flag, stride_kv_c_t,
                         stride_k_pe_t, stride_cache_block, stride_cache_token, block_size, num_slots, KV_LORA_RANK,
                         ROPE_DIM, FP8_BIAS, FP8_MAX)
    else:
        work = pid - num_tokens
        NUM_L: tl.constexpr = KV_LORA_RANK // BLOCK_L
        head = work // NUM_L
        offs_t = tl.arange(0, BLOCK_T)
        offs_p = tl.arange(0, NOPE)
        offs_l = (work % NUM_L) * BLOCK_L + tl.arange(0, BLOCK_L)
        rows = offs_t[:, None] < num_tokens
        q = tl.load(Q + offs_t[:, None] * stride_q_t + head * stride_q_h + offs_p[None, :], mask=rows, other=0.0)
        w = tl.load(W_uk + head * stride_w_h + offs_p[:, None] * stride_w_p + offs_l[None, :])
        ql = tl.dot(q, w)
        tl.store(Ql + head * stride_ql_h + offs_t[:, None] * stride_ql_t + offs_l[None, :],
                 ql.to(Ql.dtype.element_ty), mask=rows)


@triton.jit
def _up_project_kernel(
    Latent,
    W_uv,
    Out,
    num_tokens,
    stride_lat_t,
    stride_lat_h,
    stride_w_h,
    stride_w_l,
    stride_w_v,
    stride_out_h,
    stride_out_t,
    KV_LORA_RANK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Out[head, t, cols] = Latent[t, head, :] @ W_uv[head, :, cols] for every token (one program per head and
    BLOCK_V output columns; the latent's columns BLOCK_K a step)."""
    head = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = offs_t[:, None] < num_tokens
    latent = Latent + offs_t[:, None] * stride_lat_t + head * stride_lat_h + offs_k[None, :]
    weight = W_uv + head * stride_w_h + offs_k[:, None] * stride_w_l + offs_v[None, :] * stride_w_v
    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    for k in tl.range(0, KV_LORA_RANK, BLOCK_K, num_stages=NUM_STAGES):
        a = tl.load(latent + k, mask=rows, other=0.0)
        b = tl.load(weight + k * stride_w_l)
        acc = tl.dot(a, b, acc)
    tl.store(Out + head * stride_out_h + offs_t[:, None] * stride_out_t + offs_v[None, :], acc.to(Out.dtype.element_ty),
             mask=rows)


# tiles, from H200 timings of CUDA-graph replays against `torch.bmm` (bench/RESULTS.md): the prologue's W_UK
# product 128 latent columns a program; the W_UV product 64 output columns (32 under 64 heads: more programs)
# and 128 latent columns a step, three stages
PROLOGUE_BLOCK_L = 128
UP_BLOCK_K = 128
UP_STAGES = 3
_NUM_WARPS = 4


def up_block_v(num_heads: int, v_dim: int) -> int:
    return min(v_dim, 32 if num_heads < 64 else 64)


def products_reason(dtype: torch.dtype, nope: int, kv_lora_rank: int, v_dim: int) -> str:
    """Why a layer's absorbed products are not these kernels' ("" where they are, for steps of up to
    `MAX_TOKENS` tokens): dtypes other than float16 / bfloat16, dims that are not powers of two from 16."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{dtype} weights; these kernels take float16 and bfloat16"
    for name, value in (("qk_nope_head_dim", nope), ("kv_lora_rank", kv_lora_rank), ("v_head_dim", v_dim)):
        if value < 16 or value & (value - 1):
            return f"{name}={value}; these kernels take powers of two from 16"
    if kv_lora_rank % PROLOGUE_BLOCK_L or kv_lora_rank % UP_BLOCK_K:
        return f"kv_lora_rank={kv_lora_rank}; these kernels take multiples of {max(PROLOGUE_BLOCK_L, UP_BLOCK_K)}"
    return ""


@functools.lru_cache(maxsize=None)
def _prologue_constexprs(nope: int, kv_lora_rank: int, rope: int, cache_dtype: torch.dtype) -> dict:
    fp8 = cache_dtype in FP8_DTYPES
    return dict(NOPE=nope, KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope, BLOCK_T=MAX_TOKENS, BLOCK_L=PROLOGUE_BLOCK_L,
                FP8_BIAS=FP8_EXPONENT_BIAS[cache_dtype] if fp8 else 0, FP8_MAX=FP8_MAX[cache_dtype] if fp8 else 0.0,
                num_warps=_NUM_WARPS)


def absorbed_queries(heads: int, tokens: int, lkv: int, dtype: torch.dtype, device: torch.device, store: dict):
    """(ql [N, T, Lkv] contiguous, its [T, N, Lkv] view) for `tokens` <= MAX_TOKENS: views of one buffer of
    MAX_TOKENS tokens' absorbed queries kept in `store` (a workspace's `side` buffers: what a step's prologue
    writes lives only until the step's split kernel has read it, in stream order, so the layers that share a
    workspace share it too), its views made once per token count and given again (no allocation, no view made a
    call). During a CUDA-graph capture before the buffer exists, a tensor of the capture's own (kept by nothing:
    the graph's memory)."""
    key = ("absorbed queries", device, dtype, heads, lkv)
    found = store.get(key)
    if found is None:
        if capturing_on(device):
            ql = torch.empty((heads, tokens, lkv), dtype=dtype, device=device)
            return ql, ql.transpose(0, 1)
        found = store[key] = (torch.empty(heads * MAX_TOKENS * lkv, dtype=dtype, device=device), {})
    buffer, views = found
    pair = views.get(tokens)
    if pair is None:
        ql = buffer[: heads * tokens * lkv].view(heads, tokens, lkv)
        pair = views[tokens] = (ql, ql.transpose(0, 1))
    return pair


class DecodeProducts:
    """One layer's absorbed products as bound launches: W_UK (`w_uk` [N, P, Lkv], rows contiguous) into a
    decode step's queries with the step's cache write (`prologue`), W_UV (`w_uv` [N, Lkv, V] by strides) out
    of its latent output (`up_project`). The launches are bound by specialisation (every integer argument, the
    tensors' dtypes and 16-byte alignment) in `launch.bound_by_layout`'s cache, shared by every layer of the
    same layouts: a call only works out its arguments and launches."""

    def __init__(self, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
        self.w_uk = w_uk
        self.w_uv = w_uv
        self.num_heads, self.nope, self.kv_lora_rank = w_uk.shape
        self.v_dim = w_uv.shape[2]
        self._uk_strides = (w_uk.stride(0), w_uk.stride(1))
        self._uv_strides = tuple(w_uv.stride())
        block_v = up_block_v(self.num_heads, self.v_dim)
        self._up_grid = (self.num_heads, self.v_dim // block_v)
        self._up_constexprs = dict(KV_LORA_RANK=self.kv_lora_rank, BLOCK_T=MAX_TOKENS, BLOCK_K=UP_BLOCK_K,
                                   BLOCK_V=block_v, NUM_STAGES=UP_STAGES, num_warps=_NUM_WARPS)

    def prologue(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, scale: torch.Tensor | None, error_flag: torch.Tensor,
                 store: dict) -> torch.Tensor:
        """Write each token's ``[kv_c | k_pe]`` row into its slot of `kv_cache` (`concat_and_cache_mla`'s rules,
        FP8 caches by `scale`) and return the absorbed queries [T, N, Lkv]: q [T, N, P + R]'s nope part times
        W_UK per head (a view of a heads-first [N, T, Lkv] buffer kept in `store`, `absorbed_queries`). The
        caller checked the tensors (`MLAAttention`) and `products_reason`."""
        tokens, n, lkv = q.shape[0], self.num_heads, self.kv_lora_rank
        ql, ql_tokens_first = absorbed_queries(n, tokens, lkv, q.dtype, q.device, store)
        fp8 = kv_cache.dtype in FP8_DTYPES
        cache = kv_cache.view(torch.uint8) if fp8 else kv_cache
        q_strides, cache_strides, cache_shape = q.stride(), cache.stride(), kv_cache.shape
        ints = (tokens, q_strides[0], q_strides[1], *self._uk_strides, tokens * lkv, lkv, kv_c.stride(0),
                k_pe.stride(0), cache_strides[0], cache_strides[1], cache_shape[1], cache_shape[0] * cache_shape[1])
        scale = scale if fp8 else slot_mapping
        launch = bound_by_layout(
            _decode_prologue_kernel, (tokens + n * (lkv // PROLOGUE_BLOCK_L),),
            _prologue_constexprs(self.nope, lkv, k_pe.shape[1], kv_cache.dtype), q.device,
            (ints, q.dtype, kv_cache.dtype, alignment_key(q, self.w_uk, kv_c, k_pe, cache, slot_mapping, scale)),
            pdl=False,
        )
        launch(q, self.w_uk, ql, kv_c, k_pe, cache, slot_mapping, scale, error_flag, *ints)
        return ql_tokens_first

    def up_project(self, latent: torch.Tensor, out: torch.Tensor) -> None:
        """out[:T] [T, N * V] (columns contiguous; each head's V columns side by side, as a layer's output) =
        latent [T, N, Lkv] (rows contiguous) times W_UV per head."""
        latent_strides = latent.stride()
        ints = (latent.shape[0], latent_strides[0], latent_strides[1], *self._uv_strides, self.v_dim, out.stride(0))
        launch = bound_by_layout(_up_project_kernel, self._up_grid, self._up_constexprs, latent.device,
                                 (ints, latent.dtype, alignment_key(latent, self.w_uv, out)), pdl=False)
        launch(latent, self.w_uv, out, *ints)


def compile_specs(platform) -> list[CompileSpec]:
    """The products for `platform` on DeepSeek-V3 dims (P 128, Lkv 512, R 64, V 128), bf16: the prologue over a
    bf16 and an FP8 (e4m3fn bytes) cache, the W_UV product at both column tiles."""
    specs = []
    for fp8 in (False, True):
        specs.append(CompileSpec(
            name=f"decode_prologue[kv={'fp8' if fp8 else 'bf16'}]",
            fn=_decode_prologue_kernel,
            signature={"Q": "*bf16", "W_uk": "*bf16", "Ql": "*bf16", "KV_c": "*bf16", "K_pe": "*bf16",
                       "KV_cache": "*u8" if fp8 else "*bf16", "Slot_mapping": "*i64",
                       "Scale": "*fp32" if fp8 else "*i64", "Error_flag": "*i32",
                       **{name: "i32" for name in (
                           "num_tokens stride_q_t stride_q_h stride_w_h stride_w_p stride_ql_h stride_ql_t "
                           "stride_kv_c_t stride_k_pe_t stride_cache_block stride_cache_token block_size "
                           "num_slots").split()},
                       **{name: "constexpr" for name in ("NOPE", "KV_LORA_RANK", "ROPE_DIM", "BLOCK_T", "BLOCK_L",
                                                         "FP8_BIAS", "FP8_MAX")}},
            constexprs={"NOPE": 128, "KV_LORA_RANK": 512, "ROPE_DIM": 64, "BLOCK_T": MAX_TOKENS,
                        "BLOCK_L": PROLOGUE_BLOCK_L, "FP8_BIAS": 7 if fp8 else 0, "FP8_MAX": 448.0 if fp8 else 0.0},
            options={"num_warps": _NUM_WARPS},
            divisible_by_16=("Q", "W_uk", "Ql", "KV_c", "K_pe", "KV_cache", "Slot_mapping", "stride_q_t",
                             "stride_q_h", "stride_w_h", "stride_w_p", "stride_ql_h", "stride_ql_t",
                             "stride_cache_block", "stride_cache_token"),
        ))
    for heads in (16, 128):
        block_v = up_block_v(heads, 128)
        specs.append(CompileSpec(
            name=f"up_project[v{block_v}]",
            fn=_up_project_kernel,
            signature={"Latent": "*bf16", "W_uv": "*bf16", "Out": "*bf16",
                       **{name: "i32" for name in ("num_tokens stride_lat_t stride_lat_h stride_w_h stride_w_l "
                                                   "stride_w_v stride_out_h stride_out_t").split()},
                       # W_UV's latent rows are its columns in kv_b_proj's weight: stride 1 (Triton's
                       # specialisation of an integer 1)
                       "stride_w_l": "constexpr",
                       **{name: "constexpr" for name in ("KV_LORA_RANK", "BLOCK_T", "BLOCK_K", "BLOCK_V",
                                                         "NUM_STAGES")}},
            constexprs={"KV_LORA_RANK": 512, "BLOCK_T": MAX_TOKENS, "BLOCK_K": UP_BLOCK_K, "BLOCK_V": block_v,
                        "NUM_STAGES": UP_STAGES, "stride_w_l": 1},
            options={"num_warps": _NUM_WARPS},
            divisible_by_16=("Latent", "W_uv", "Out", "stride_lat_t", "stride_lat_h", "stride_w_h", "stride_w_v",
                             "stride_out_h", "stride_out_t"),
        ))
    return specs
