"""Naive float64 MLA straight from the math, and a paged-cache scenario driver.

Used by the test suite, `mla-multi demo` and the GPU checks: no absorption,
no chunking, no paging tricks — full attention of each request's new queries
over all of its tokens, cached and new.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from mla_multi.dims import MLADims
from mla_multi.metadata import CommonAttentionMetadata


def naive_mla_attention(
    dims: MLADims,
    scale: float,
    kv_b_proj_weight: torch.Tensor,
    q: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
) -> torch.Tensor:
    """One request's attention in float64.

    q [Q, N, P + R] for the last Q of its S tokens; latent [S, Lkv] and k_pe
    [S, R] for all S tokens. Returns [Q, N * V] float64.
    """
    n, p, v = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim
    weight = kv_b_proj_weight.double().view(n, p + v, dims.kv_lora_rank)
    q = q.double()
    k_nope = torch.einsum("npl,sl->snp", weight[:, :p], latent.double())
    value = torch.einsum("nvl,sl->snv", weight[:, p:], latent.double())
    seq_len, q_len = latent.shape[0], q.shape[0]
    scores = torch.einsum("qnp,snp->nqs", q[..., :p], k_nope) + torch.einsum("qnr,sr->nqs", q[..., p:], k_pe.double())
    scores = scores * scale
    positions = torch.arange(seq_len, device=q.device)
    allowed = positions.unsqueeze(0) <= (seq_len - q_len + torch.arange(q_len, device=q.device)).unsqueeze(1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("nqs,snv->qnv", torch.softmax(scores, dim=-1), value)
    return out.reshape(q_len, n * v)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere gives inf."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    denominator = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denominator if denominator > 0 else 1.0)


@dataclasses.dataclass
class PagedScenario:
    """Requests with growing histories in a paged cache, for step-by-step checks.

    Each request keeps its float64 latent and k_pe history; blocks are handed
    out in a shuffled order so block tables are not contiguous.
    """

    dims: MLADims
    block_size: int
    num_blocks: int
    device: torch.device
    dtype: torch.dtype
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.free_blocks = list(range(self.num_blocks))
        self.rng.shuffle(self.free_blocks)
        self.blocks: dict[int, list[int]] = {}
        self.latent: dict[int, torch.Tensor] = {}
        self.k_pe: dict[int, torch.Tensor] = {}

    def randn(self, *shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, dtype=torch.float64) * std

    def seq_len(self, request: int) -> int:
        return 0 if request not in self.latent else self.latent[request].shape[0]

    def _ensure_blocks(self, request: int, seq_len: int) -> None:
        blocks = self.blocks.setdefault(request, [])
        while len(blocks) * self.block_size < seq_len:
            if not self.free_blocks:
                raise RuntimeError(f"scenario ran out of its {self.num_blocks} cache blocks")
            blocks.append(self.free_blocks.pop())

    def step(self, requests: list[tuple[int, int]], max_blocks: int | None = None):
        """Schedule (request id, new tokens) pairs, decodes first.

        Returns (metadata, q, kv_c, k_pe) with the new tokens' inputs in
        `dtype` on `device`; the float64 history is extended by the values as
        rounded to `dtype`.
        """
        d = self.dims
        query_lens, seq_lens = [], []
        new_latent, new_pe, queries = [], [], []
        for request, count in requests:
            seq_len = self.seq_len(request) + count
            self._ensure_blocks(request, seq_len)
            latent = self.randn(count, d.kv_lora_rank, std=1.0).to(self.dtype)
            pe = self.randn(count, d.qk_rope_head_dim, std=1.0).to(self.dtype)
            query = self.randn(count, d.num_heads, d.qk_head_dim, std=1.0).to(self.dtype)
            self.latent[request] = torch.cat([self.latent.get(request, torch.zeros(0, d.kv_lora_rank, dtype=torch.float64)), latent.double()])
            self.k_pe[request] = torch.cat([self.k_pe.get(request, torch.zeros(0, d.qk_rope_head_dim, dtype=torch.float64)), pe.double()])
            new_latent.append(latent)
            new_pe.append(pe)
            queries.append(query)
            query_lens.append(count)
            seq_lens.append(seq_len)
        width = max_blocks or max(len(self.blocks[r]) for r, _ in requests)
        table = torch.zeros(len(requests), width, dtype=torch.int32)
        for row, (request, _) in enumerate(requests):
            blocks = self.blocks[request]
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        metadata = CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table.to(self.device), self.block_size)
        cat = lambda parts: torch.cat(parts).to(self.device)  # noqa: E731
        return metadata, cat(queries), cat(new_latent), cat(new_pe)

    def reference(self, requests: list[tuple[int, int]], q: torch.Tensor, scale: float, kv_b_proj_weight: torch.Tensor) -> torch.Tensor:
        """The float64 naive output [T, N * V] for the step just scheduled."""
        outputs = []
        offset = 0
        for request, count in requests:
            if count:
                outputs.append(
                    naive_mla_attention(
                        self.dims, scale, kv_b_proj_weight, q[offset : offset + count],
                        self.latent[request].to(q.device), self.k_pe[request].to(q.device),
                    )
                )
            offset += count
        if not outputs:
            return torch.zeros(0, self.dims.num_heads * self.dims.v_head_dim, dtype=torch.float64, device=q.device)
        return torch.cat(outputs)

    def topk_positions(self, requests: list[tuple[int, int]], topk: int, minus_one: float = 0.1) -> torch.Tensor:
        """Random index lists [T, topk] int32 of the step just scheduled, as an indexer makes them: each new
        token's positions inside its own request, causal (at most its own position), some -1 (no token)."""
        rows = []
        for request, count in requests:
            seq_len = self.seq_len(request)
            for j in range(count):
                visible = seq_len - count + j + 1
                picks = torch.randint(0, visible, (topk,), generator=self.generator)
                picks[torch.rand(topk, generator=self.generator) < minus_one] = -1
                rows.append(picks)
        return torch.stack(rows).to(torch.int32) if rows else torch.zeros(0, topk, dtype=torch.int32)

    def sparse_reference(self, requests: list[tuple[int, int]], q: torch.Tensor, scale: float,
                         kv_b_proj_weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The float64 naive sparse MLA output [T, N * V]: token t attends to the history rows of its request
        that positions[t] names (-1 none; a duplicate counts twice), in the absorbed latent space."""
        d = self.dims
        n, p, v = d.num_heads, d.qk_nope_head_dim, d.v_head_dim
        weight = kv_b_proj_weight.double().cpu().view(n, p + v, d.kv_lora_rank)
        w_uk, w_uv = weight[:, :p], weight[:, p:]
        out = torch.zeros(q.shape[0], n * v, dtype=torch.float64)
        token = 0
        for request, count in requests:
            for _ in range(count):
                chosen = [int(i) for i in positions[token].tolist() if i >= 0]
                if chosen:
                    latent, pe = self.latent[request][chosen], self.k_pe[request][chosen]
                    query = q[token].double().cpu()
                    absorbed = torch.einsum("np,npl->nl", query[:, :p], w_uk)  # [N, Lkv]
                    logits = scale * (absorbed @ latent.T + query[:, p:] @ pe.T)
                    mixed = torch.softmax(logits, dim=-1) @ latent  # [N, Lkv]
                    out[token] = torch.einsum("nl,nvl->nv", mixed, w_uv).reshape(-1)
                token += 1
        return out.to(q.device)


def v4_prefill_inputs(heads: int, topk: int, s_kv: int, tokens: int = 5, seed: int = 0) -> dict:
    """DeepSeek-V4 sparse prefill inputs on the CPU (bfloat16 q [tokens, heads, 512] and kv [s_kv, 512], int32
    indices [tokens, topk] some outside [0, s_kv) (no token), token 1's all -1) and the optional arguments'
    values: topk_length (full, full, a third, 0, 1) and a sink per head in [-1, 1] with head 0's +inf."""
    if tokens < 5:
        raise ValueError(f"tokens={tokens}; accepted: at least 5 (the lengths name five tokens)")
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(s_kv, 512, generator=generator).to(torch.bfloat16)
    q = torch.randn(tokens, heads, 512, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-4, s_kv + 40, (tokens, topk), generator=generator, dtype=torch.int32)
    indices[1] = -1
    lengths = torch.tensor([topk, topk, topk // 3, 0, 1] + [topk] * (tokens - 5), dtype=torch.int32)
    sink = torch.linspace(-1, 1, heads)
    sink[0] = float("inf")
    return {"q": q, "kv": kv, "indices": indices, "topk_length": lengths, "attn_sink": sink}


def capture_graph(fn, repeats: int = 1, **graph_kwargs) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of `repeats` calls of `fn`, captured after one warm-up call on a side stream (as
    PyTorch's capture recipe asks); `graph_kwargs` go to `torch.cuda.graph` (e.g. capture_error_mode)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, **graph_kwargs):
        for _ in range(repeats):
            fn()
    return graph
