"""Decode context parallelism (DCP): the latent cache sharded by token across the ranks of a group.

MLA's latent cache has no head dimension, so tensor parallelism keeps a whole
copy of it on every GPU; at long contexts that copy is what limits the batch.
Decode context parallelism, after vLLM's, shards the cache by token across
the ranks of a `torch.distributed` process group instead:

* ownership: global position ``p`` lives on rank ``(p // interleave) % world_size``
  at local index ``(p // (interleave * world_size)) * interleave + p % interleave``
  (runs of `interleave` tokens dealt round-robin); `local_positions` maps
  positions to local indices, -1 for another rank's tokens, so a slot mapping
  built from it feeds `concat_and_cache_mla` unchanged (negative slots are
  skipped);
* one decode step: all-gather the query heads of the layer (each rank holds
  ``N_local`` of them), decode every head over the local shard with its LSE,
  all-gather the LSEs, scale each rank's partial output by its share of the
  softmax mass (`mla_multi.kernels.dcp_combine` on GPUs, PyTorch elsewhere)
  and reduce-scatter the corrected outputs back to each rank's heads.

Only `torch.distributed` collectives are used, so DCP runs wherever PyTorch's
process groups do: NCCL on NVIDIA, RCCL (also named "nccl") on ROCm, gloo on
the CPU. The decode launches nothing that synchronises the host, so the whole
step can be captured in a CUDA graph with NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mla_multi import checks, ops
from mla_multi.backends.base import FP8_DTYPES
from mla_multi.kernels import capturing_on
from mla_multi.metadata import to_device

__all__ = ["DecodeContextParallel", "correct_partial_outputs_reference"]

# Newer torch renames the flat collectives (the old names warn); older torch
# only has the old ones. gloo splits the output along dim 0 and compares each
# piece's shape with the input's, so inputs gain a leading dim of 1.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# gloo has implemented the flat reduce-scatter (as all-reduce + chunk) since
# torch 2.2 and the package needs torch >= 2.4, so no fallback is needed.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_DTYPE_CODES = {
    dtype: code
    for code, dtype in enumerate(
        (torch.float16, torch.bfloat16, torch.float32, torch.float64) + FP8_DTYPES + (torch.int32, torch.int64)
    )
}
# The device types each collective backend serves here; gloo would accept
# CUDA tensors for some collectives only, so it is held to the CPU.
_BACKEND_DEVICE_TYPES = {"nccl": ("cuda",), "gloo": ("cpu",)}


def correct_partial_outputs_reference(
    partial_output: torch.Tensor, lses: torch.Tensor, rank: int, num_local_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch version of `mla_multi.kernels.dcp_combine.dcp_correct` (any device and float dtype).

    partial_output [R, N, D]; lses [world_size, R, N] (float32, or float64 for
    float64 outputs). Returns (dest [world_size, R, N / world_size, D] in
    partial_output's dtype, lse [R, N / world_size] in lses' dtype): dest holds
    this rank's corrected output of every head, rank-major, ready for a
    reduce-scatter; lse is the LSE over all ranks of this rank's own heads.
    Computed in float32 (float64 for float64 inputs).
    """
    compute = torch.float64 if lses.dtype == torch.float64 else torch.float32
    lses = lses.to(compute)
    lses = torch.where(lses == float("inf"), torch.full_like(lses, float("-inf")), lses)
    max_lse = lses.max(dim=0).values
    all_empty = max_lse == float("-inf")
    max_safe = torch.where(all_empty, torch.zeros_like(max_lse), max_lse)
    weights = torch.exp(lses - max_safe)
    total = torch.where(all_empty, torch.ones_like(max_lse), weights.sum(dim=0))
    factor = (weights[rank] / total).unsqueeze(-1)
    # Select rather than multiply by a zero factor: a rank without tokens may
    # hold anything in its partial output (0 * NaN = NaN).
    corrected = torch.where(factor > 0, partial_output.to(compute) * factor, 0.0)
    rows, num_heads, head_dim = partial_output.shape
    world_size = num_heads // num_local_heads
    dest = corrected.view(rows, world_size, num_local_heads, head_dim).transpose(0, 1).to(partial_output.dtype)
    global_lse = torch.where(all_empty, torch.full_like(max_lse, float("-inf")), torch.log(total) + max_safe)
    own = slice(rank * num_local_heads, (rank + 1) * num_local_heads)
    return dest.contiguous(), global_lse[:, own].contiguous()


class DecodeContextParallel:
    """The tokens of every request sharded across the ranks of a process group, for decode.

    Args:
        group: a `torch.distributed` process group this process belongs to;
            None means the default group. `torch.distributed` must be
            initialised first.
        interleave: tokens a rank owns in a row before the next rank's turn
            (>= 1); 1 deals single tokens round-robin, a block size keeps
            whole cache blocks on one rank.

    Attributes: `group`, `rank` (in the group), `world_size`, `interleave`,
    `backend` (the group's collective backend name).

    Every rank of the group calls the same methods with the same batch (the
    same `seq_lens`, the same number of requests and query tokens); rank r
    holds the query heads [r * N_local, (r + 1) * N_local) of the layer and,
    in its cache, the tokens it owns in local order.
    """

    def __init__(self, group=None, interleave: int = 1) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialised; accepted: a DecodeContextParallel created after "
                "torch.distributed.init_process_group(...)"
            )
        checks.check_positive_int("interleave", interleave)
        if group is None:
            group = dist.group.WORLD
        elif not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"group={group!r}; accepted: a torch.distributed ProcessGroup or None (the default group)")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of group {group!r}; "
                "accepted: a group that contains it"
            )
        self.group = group
        self.rank = rank
        self.world_size = dist.get_world_size(group)
        self.interleave = interleave
        self.backend = str(dist.get_backend(group))
        self._checked_configs: set[tuple] = set()

    def __repr__(self) -> str:
        return (
            f"DecodeContextParallel(rank={self.rank}, world_size={self.world_size}, "
            f"interleave={self.interleave}, backend={self.backend})"
        )

    # ------------------------------------------------------------- ownership
    def local_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Local cache index of each global token position on this rank.

        positions: int32/int64 tensor of any shape (negative entries are
        padding). Returns a tensor of the same shape, dtype and device: the
        local index where this rank owns the position, -1 elsewhere.
        """
        checks.check_tensor("positions", positions, dtypes=checks.INDEX_DTYPES)
        span = self.interleave * self.world_size
        owner = torch.div(positions, self.interleave, rounding_mode="floor") % self.world_size
        local = torch.div(positions, span, rounding_mode="floor") * self.interleave + positions % self.interleave
        return torch.where((positions >= 0) & (owner == self.rank), local, torch.full_like(local, -1))

    def local_seq_lens(self, seq_lens: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Tokens of each request held by `rank` (default: this rank).

        seq_lens: [B] int32/int64 global lengths (negative counts as 0).
        Returns [B] int32 on the same device, computed there in closed form
        (no host synchronisation).
        """
        checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=checks.INDEX_DTYPES)
        rank = self._check_rank(rank)
        span = self.interleave * self.world_size
        lengths = seq_lens.long().clamp(min=0)
        full = torch.div(lengths, span, rounding_mode="floor")
        tail = (lengths - full * span - rank * self.interleave).clamp(0, self.interleave)
        return (full * self.interleave + tail).to(torch.int32)

    def local_num_tokens(self, num_tokens: int, rank: int | None = None) -> int:
        """Host-side `local_seq_lens` of one length: how many of positions 0 .. num_tokens - 1 `rank` owns."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens!r}; accepted: a non-negative int")
        rank = self._check_rank(rank)
        full, rem = divmod(num_tokens, self.interleave * self.world_size)
        return full * self.interleave + min(max(rem - rank * self.interleave, 0), self.interleave)

    def _check_rank(self, rank: int | None) -> int:
        if rank is None:
            return self.rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r}; accepted: None or an int in [0, {self.world_size})")
        return rank

    def local_slot_mapping(self, metadata) -> torch.Tensor:
        """This rank's cache slot of every new token of a batch, -1 for the tokens other ranks own.

        metadata: a `CommonAttentionMetadata` whose `seq_lens` are global and
        whose `block_table` holds this rank's blocks (its tokens in local
        order). Returns [num_actual_tokens] int64 on the block table's device,
        computed there (its `slot_mapping`, built from global positions, is
        not used).
        """
        block_table = metadata.block_table
        device = block_table.device
        tokens = torch.arange(metadata.num_actual_tokens, device=device, dtype=torch.int64)
        starts = metadata.query_start_loc.to(device=device, dtype=torch.int64)
        request = torch.searchsorted(starts[1:].contiguous(), tokens, right=True)
        query_lens = starts[request + 1] - starts[request]
        positions = metadata.seq_lens.to(device).long()[request] - query_lens + (tokens - starts[request])
        local = self.local_positions(positions)
        safe = local.clamp(min=0)
        block_size = metadata.block_size
        blocks = block_table[request, torch.div(safe, block_size, rounding_mode="floor")].long()
        return torch.where(local >= 0, blocks * block_size + safe % block_size, torch.full_like(local, -1))

    # ------------------------------------------------------------------- checks
    def check_device(self, name: str, device: torch.device) -> None:
        """ValueError unless the group's collective backend serves tensors on `device`."""
        backend = self.backend.lower()
        if ":" in backend:  # "cpu:gloo,cuda:nccl"
            accepted = tuple(part.split(":")[0] for part in backend.split(","))
        else:
            accepted = _BACKEND_DEVICE_TYPES.get(backend)
        if accepted is not None and device.type not in accepted:
            raise ValueError(
                f"{name} is on {device}, but the group's backend {self.backend} serves {'/'.join(accepted)} "
                f"tensors; accepted: tensors on a {'/'.join(accepted)} device (or a group of another backend)"
            )

    def _check_decode_inputs(self, q_nope, q_pe, kv_cache, block_table, seq_lens) -> None:
        checks.check_tensor("q_nope", q_nope, ndim=(3, 4), dtypes=ops.FLOAT_DTYPES)
        device = q_nope.device
        self.check_device("q_nope", device)
        checks.check_tensor(
            "q_pe", q_pe, ndim=q_nope.dim(), dtypes=(q_nope.dtype,), shape=(*q_nope.shape[:-1], None), device=device
        )
        width = q_nope.shape[-1] + q_pe.shape[-1]
        checks.check_tensor(
            "kv_cache", kv_cache, ndim=3, dtypes=ops.CACHE_DTYPES, shape=(None, None, width), device=device
        )
        batch = q_nope.shape[0]
        checks.check_tensor(
            "block_table", block_table, ndim=2, dtypes=(torch.int32,), shape=(batch, None), device=device
        )
        checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(batch,), device=device)

    def _check_across_ranks(self, fields: dict[str, int], config_names: tuple[str, ...], seq_lens, device) -> None:
        """Every rank must bring the same problem: mismatched shapes would desynchronise the collectives.

        The configuration (heads per rank, widths, dtypes, block size,
        interleave) is compared on its first use; with MLA_MULTI_CHECK_INPUTS=1
        every call also compares the batch and seq_lens. The comparison is one
        small all-gather read on the host, so it is skipped inside a CUDA-graph
        capture (warm up once before capturing).
        """
        config = tuple(fields[name] for name in config_names)
        every_call = checks.data_checks_enabled()
        if (config in self._checked_configs and not every_call) or capturing_on(device):
            return
        names = list(fields)
        values = [fields[name] for name in names]
        if every_call:
            lengths = seq_lens.detach().to("cpu", torch.int64)
            names += ["sum of seq_lens", "weighted sum of seq_lens"]
            weights = torch.arange(1, lengths.numel() + 1, dtype=torch.int64)
            values += [int(lengths.sum()), int((lengths * weights).sum())]
        local = torch.tensor(values, dtype=torch.int64, device=device)
        gathered = torch.empty((self.world_size, len(values)), dtype=torch.int64, device=device)
        _all_gather_flat(gathered, local.unsqueeze(0), group=self.group)
        table = gathered.cpu()
        for column, name in enumerate(names):
            per_rank = table[:, column].tolist()
            if len(set(per_rank)) > 1:
                raise ValueError(
                    f"{name} differs across the {self.world_size} ranks of the decode context parallel group "
                    f"(rank: value {dict(enumerate(per_rank))}); accepted: the same value on every rank"
                )
        self._checked_configs.add(config)

    # ------------------------------------------------------------------- decode
    def mla_decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        *,
        k_scale=None,
        backend: str | None = None,
        return_lse: bool = False,
    ):
        """`mla_multi.ops.mla_decode` of this rank's heads over the tokens of all ranks.

        q_nope [B, N_local, Lkv] (absorbed) or [B, Q, N_local, Lkv] for Q query
        tokens per request (token j sees global positions < seq_len - Q + 1 + j);
        q_pe [B, (Q,) N_local, R]; rank r holds heads [r * N_local, (r + 1) * N_local)
        of the layer. kv_cache [num_blocks, block_size, Lkv + R] and
        block_table [B, max_blocks] int32 hold this rank's tokens in local
        order; seq_lens [B] int32/int64 are the global lengths. `backend` names
        the decode backend of the local decode (None: the registry's choice
        for world_size * N_local heads).

        Returns out [B, (Q,) N_local, Lkv] in q's dtype, and lse [B, (Q,) N_local]
        float32 (float64 for float64 queries) with `return_lse`: this rank's
        heads of the single-device decode over the whole sequence. A request
        of length 0 gives 0 and -inf; a rank without tokens of a request
        contributes nothing.

        With Q > 1 the visible prefix of each query token is sharded
        differently from the whole sequence, so each (request, token) runs as
        its own decode row with its own local length (the cache is read once
        per token rather than once per request).

        Graph-safe with a decode backend that needs no host planning
        (TRITON): warm up once outside the capture (the configuration is
        compared across ranks on its first use) and capture with
        ``capture_error_mode="thread_local"``.
        """
        self._check_decode_inputs(q_nope, q_pe, kv_cache, block_table, seq_lens)
        checks.check_positive_float("scale", scale)
        checks.check_scale("k_scale", k_scale, required=kv_cache.dtype in FP8_DTYPES)

        def decode(local_q_nope, local_q_pe, table, local_lens):
            return ops.mla_decode(
                local_q_nope, local_q_pe, kv_cache, table, local_lens, scale,
                k_scale=k_scale, backend=backend, return_lse=True,
            )

        out, lse = self._run(q_nope, q_pe, kv_cache, block_table, seq_lens, decode)
        return (out, lse) if return_lse else out

    def forward_mqa(
        self,
        impl,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        k_scale=None,
        workspace_manager=None,
        max_seq_len: int | None = None,
        plan=None,
        num_kv_splits: int | None = None,
        step_plans: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`mla_decode` through a decode impl built for world_size * N_local heads (the layer's path).

        Shapes as in `mla_decode`; `workspace_manager`, `max_seq_len` (a host
        bound of the global seq_lens, passed on as this rank's share) and
        `plan` (for backends with a planning stage: planned with
        `local_seq_lens`) pass to `impl.forward_mqa`, and so do `num_kv_splits`
        and `step_plans` (a step's `metadata.backend_plans`, TRITON) where
        given: this rank's lengths and block table are then made once per step
        and the impl keeps its bound kernels there, so that every later layer
        only launches besides the collectives. Returns (out, lse) of this
        rank's heads.
        """
        self._check_decode_inputs(q_nope, q_pe, kv_cache, block_table, seq_lens)
        local_bound = None if max_seq_len is None else self.local_num_tokens(max_seq_len, rank=0)
        extra = {} if plan is None else {"plan": plan}
        if num_kv_splits is not None:
            extra["num_kv_splits"] = num_kv_splits
        if step_plans is not None:
            extra["step_plans"] = step_plans

        def decode(local_q_nope, local_q_pe, table, local_lens):
            # The data checks of ops.mla_decode, against this rank's share of each sequence.
            checks.check_block_table_data(
                table, local_lens, kv_cache.shape[0], kv_cache.shape[1], name="this rank's share of seq_lens"
            )
            return impl.forward_mqa(
                local_q_nope, local_q_pe, kv_cache, table, local_lens,
                k_scale=k_scale, workspace_manager=workspace_manager, max_seq_len=local_bound, **extra,
            )

        return self._run(q_nope, q_pe, kv_cache, block_table, seq_lens, decode, step_plans)

    def _local_inputs(self, block_table, seq_lens, q_len: int, step_plans: dict | None):
        """(block table, this rank's lengths) of the decode rows, once per step where `step_plans` keeps them."""
        key = ("dcp local decode inputs", id(block_table), id(seq_lens), q_len, self.world_size, self.rank,
               self.interleave)
        found = None if step_plans is None else step_plans.get(key)
        if found is not None and found[0] is block_table and found[1] is seq_lens:
            return found[2], found[3]
        if q_len > 1:
            # Token j sees global positions < seq_len - Q + 1 + j. The shard of
            # that prefix is not the shard of the whole sequence shortened by a
            # fixed count, so every (request, token) is a row with its own length.
            visible = seq_lens.long().unsqueeze(1) - q_len + 1 + torch.arange(q_len, device=seq_lens.device)
            local_lens = self.local_seq_lens(visible.reshape(-1))
            table = block_table.repeat_interleave(q_len, dim=0)
        else:
            local_lens = self.local_seq_lens(seq_lens)
            table = block_table
        if step_plans is not None:  # the inputs kept too: their ids stay theirs while the step lives
            step_plans[key] = (block_table, seq_lens, table, local_lens)
        return table, local_lens

    def _run(self, q_nope, q_pe, kv_cache, block_table, seq_lens, decode, step_plans=None):
        multi_token = q_nope.dim() == 4
        batch = q_nope.shape[0]
        q_len = q_nope.shape[1] if multi_token else 1
        num_local_heads, kv_lora_rank, rope_dim = q_nope.shape[-2], q_nope.shape[-1], q_pe.shape[-1]
        device = q_nope.device
        fields = {
            "num_heads (heads per rank, q_nope.shape[-2])": num_local_heads,
            "kv_lora_rank (q_nope.shape[-1])": kv_lora_rank,
            "qk_rope_head_dim (q_pe.shape[-1])": rope_dim,
            "q_nope dtype": _DTYPE_CODES[q_nope.dtype],
            "kv_cache dtype": _DTYPE_CODES[kv_cache.dtype],
            "block_size (kv_cache.shape[1])": kv_cache.shape[1],
            "interleave": self.interleave,
            "batch (q_nope.shape[0])": batch,
            "query tokens per request": q_len,
        }
        self._check_across_ranks(fields, tuple(fields)[:7], seq_lens, device)
        rows = batch * q_len
        width = kv_lora_rank + rope_dim
        out_shape = (batch, q_len, num_local_heads) if multi_token else (batch, num_local_heads)
        if rows == 0:
            lse_dtype = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
            return (
                torch.zeros((*out_shape, kv_lora_rank), dtype=q_nope.dtype, device=device),
                torch.full(out_shape, float("-inf"), dtype=lse_dtype, device=device),
            )
        # Query heads: one all-gather of [q_nope | q_pe], then heads in layer order.
        local_query = torch.cat([q_nope, q_pe], dim=-1).reshape(rows, num_local_heads, width)
        gathered = torch.empty((self.world_size, rows, num_local_heads, width), dtype=q_nope.dtype, device=device)
        _all_gather_flat(gathered, local_query.unsqueeze(0), group=self.group)
        query = gathered.permute(1, 0, 2, 3).reshape(rows, self.world_size * num_local_heads, width)
        table, local_lens = self._local_inputs(block_table, seq_lens, q_len, step_plans)
        partial_out, partial_lse = decode(query[..., :kv_lora_rank], query[..., kv_lora_rank:], table, local_lens)
        out, lse = self.combine(partial_out.reshape(rows, -1, kv_lora_rank), partial_lse.reshape(rows, -1))
        return out.view(*out_shape, kv_lora_rank), lse.view(out_shape)

    def combine(self, partial_output: torch.Tensor, partial_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Combine every rank's partial decode into this rank's heads.

        partial_output [R, N, D] (all N = world_size * N_local heads over this
        rank's tokens), partial_lse [R, N] float32 (float64 with float64
        outputs). Returns (out [R, N_local, D] in partial_output's dtype, lse
        [R, N_local]): out = sum_r exp(lse_r - lse) * out_r with
        lse = logsumexp_r(lse_r), corrected in float32. Collectives: one
        all-gather of the LSEs, one reduce-scatter of the corrected outputs.
        """
        checks.check_tensor("partial_output", partial_output, ndim=3, dtypes=ops.FLOAT_DTYPES)
        rows, num_heads, head_dim = partial_output.shape
        device = partial_output.device
        checks.check_tensor(
            "partial_lse", partial_lse, ndim=2, dtypes=(torch.float32, torch.float64), shape=(rows, num_heads),
            device=device,
        )
        if num_heads % self.world_size:
            raise ValueError(
                f"partial_output has {num_heads} heads; accepted: a multiple of the world size {self.world_size}"
            )
        num_local_heads = num_heads // self.world_size
        lses = torch.empty((self.world_size, rows, num_heads), dtype=partial_lse.dtype, device=device)
        _all_gather_flat(lses, partial_lse.contiguous().unsqueeze(0), group=self.group)
        if device.type == "cuda" and partial_output.dtype != torch.float64 and lses.dtype == torch.float32:
            from mla_multi.kernels.dcp_combine import dcp_correct

            dest, lse = dcp_correct(partial_output, lses, self.rank, num_local_heads)
        else:
            dest, lse = correct_partial_outputs_reference(partial_output, lses, self.rank, num_local_heads)
        out = torch.empty((rows, num_local_heads, head_dim), dtype=dest.dtype, device=device)
        _reduce_scatter_flat(out, dest.view(self.world_size * rows, num_local_heads, head_dim), group=self.group)
        return out, lse

    # ----------------------------------------------------------- chunked prefill
    def gather_context_chunk(
        self,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        starts_cpu: torch.Tensor,
        lens_cpu: torch.Tensor,
        *,
        scale=None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Cached rows of a context chunk from every rank, in global order.

        kv_cache [num_blocks, block_size, W] and block_table [B, max_blocks]
        int32 hold this rank's tokens; starts_cpu, lens_cpu [B] host int
        tensors: request i contributes global positions starts[i] ..
        starts[i] + lens[i] - 1. Returns [sum(lens), W] in `out_dtype` (as
        `ops.gather_cache`, dequantised with `scale` for an fp8 cache): each
        rank gathers its share, the shares are all-gathered (padded to the
        largest) and put back in global order. Plans on the host from the
        host tensors (no device synchronisation).
        """
        checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=ops.CACHE_DTYPES)
        device = kv_cache.device
        self.check_device("kv_cache", device)
        for name, value in (("starts_cpu", starts_cpu), ("lens_cpu", lens_cpu)):
            checks.check_tensor(name, value, ndim=1, dtypes=checks.INDEX_DTYPES, shape=(block_table.shape[0],))
            if value.device.type != "cpu":
                raise ValueError(f"{name} is on {value.device}; accepted: a CPU tensor (the chunk plan is made on the host)")
        starts, lens = starts_cpu.long(), lens_cpu.long().clamp(min=0)
        ranks = torch.arange(self.world_size)
        share = lambda lengths: self._local_counts(lengths.unsqueeze(0), ranks.unsqueeze(1))  # noqa: E731
        local_starts = share(starts)  # [world, B]: local index of each request's first chunk token
        counts = share(starts + lens) - local_starts
        totals = counts.sum(dim=1)
        max_rows = int(totals.max()) if totals.numel() else 0
        width = kv_cache.shape[-1]
        own = counts[self.rank]
        cu = torch.zeros(own.numel() + 1, dtype=torch.int32)
        cu[1:] = own.cumsum(0)
        rows = ops.gather_cache(
            kv_cache, block_table, to_device(local_starts[self.rank].to(torch.int32), device),
            to_device(own.to(torch.int32), device), scale=scale, out_dtype=out_dtype,
            cu_seq_lens=to_device(cu, device), num_tokens=int(totals[self.rank]),
        )
        if max_rows == 0:
            return rows
        padded = torch.zeros((max_rows, width), dtype=rows.dtype, device=device)
        padded[: rows.shape[0]] = rows
        gathered = torch.empty((self.world_size * max_rows, width), dtype=rows.dtype, device=device)
        _all_gather_flat(gathered, padded, group=self.group)
        # Where each global position of the chunk landed: rank owner's piece,
        # after the owner's rows of the earlier requests.
        request = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        first = torch.cumsum(lens, 0) - lens
        positions = starts[request] + torch.arange(int(lens.sum())) - first[request]
        owner = torch.div(positions, self.interleave, rounding_mode="floor") % self.world_size
        local = (
            torch.div(positions, self.interleave * self.world_size, rounding_mode="floor") * self.interleave
            + positions % self.interleave
        )
        earlier = torch.cumsum(counts, dim=1) - counts  # [world, B]
        index = owner * max_rows + earlier[owner, request] + local - local_starts[owner, request]
        return gathered.index_select(0, to_device(index, device))

    def _local_counts(self, lengths: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """`local_num_tokens` of int64 host tensors, broadcast over lengths and ranks."""
        span = self.interleave * self.world_size
        full = torch.div(lengths, span, rounding_mode="floor")
        return full * self.interleave + (lengths - full * span - rank * self.interleave).clamp(0, self.interleave)
