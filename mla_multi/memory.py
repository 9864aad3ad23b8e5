"""What the shared workspace of a device holds for a model, and why: `memory_plan`.

Computed, not allocated: the decode and prefill backends' `reserve_workspace`
run against a recording workspace, so the figures are the ones `MLAAttention` reserves on
this device (or on an impersonated one, `mla_multi.platforms.override`).
Every layer of a device shares the buffer, so a model of 61 layers reserves
what one layer does; decode and prefill run one after the other and share it
too (the buffer holds the largest reservation, not their sum).
"""

from __future__ import annotations

import dataclasses

import torch

from mla_multi.backends.base import resolve_kv_cache_dtype
from mla_multi.checks import check_positive_int
from mla_multi.dims import MLADims
from mla_multi.workspace import WorkspaceManager

__all__ = ["MemoryPlan", "memory_plan"]


class _RecordingWorkspace(WorkspaceManager):
    """A workspace that records reservations without allocating (on the meta device)."""

    def __init__(self) -> None:
        super().__init__("meta")
        self.largest = 0

    def _ensure(self, nbytes: int) -> None:
        self.largest = max(self.largest, nbytes)


@dataclasses.dataclass
class MemoryPlan:
    """The reservations of one layer configuration; `workspace_bytes` is what the shared buffer holds."""

    platform: str
    dims: MLADims
    max_num_seqs: int
    max_model_len: int
    decode_backend: str
    prefill_backend: str
    entries: list[tuple[str, int, str]]  # (purpose, bytes, how it was sized)
    workspace_bytes: int
    num_layers: int

    def decode_bytes(self) -> int:
        return sum(b for purpose, b, _ in self.entries if purpose.startswith("decode"))

    def __str__(self) -> str:
        mib = 2**20
        lines = [
            f"workspace on {self.platform}: {self.dims.num_heads} heads, max_num_seqs {self.max_num_seqs}, "
            f"max_model_len {self.max_model_len}, decode {self.decode_backend}, prefill {self.prefill_backend}",
        ]
        for purpose, nbytes, what in self.entries:
            lines.append(f"  {nbytes / mib:9.1f} MiB  {purpose}: {what}")
        lines.append(
            f"  {self.workspace_bytes / mib:9.1f} MiB  one buffer shared by all {self.num_layers} layers "
            "(the largest reservation: decode and prefill run one after the other)"
        )
        return "\n".join(lines)


def memory_plan(
    dims: MLADims,
    max_num_seqs: int,
    max_model_len: int,
    *,
    block_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    kv_cache_dtype: str | torch.dtype = "auto",
    workspace_tokens: int | None = None,
    max_query_len: int = 1,
    num_layers: int = 61,
    decode_backend: str | None = None,
    prefill_backend: str | None = None,
) -> MemoryPlan:
    """What `MLAAttention` layers of `dims` reserve in the device's shared workspace (see the module doc).

    The backends are the registry's choice on the current (or impersonated)
    platform unless forced; `num_layers` only labels the report, since every
    layer shares the one buffer.
    """
    from mla_multi.attention import default_workspace_tokens
    from mla_multi.platforms import current_platform
    from mla_multi.registry import select_decode_backend, select_prefill_backend

    if not isinstance(dims, MLADims):
        raise ValueError(f"dims={dims!r}; accepted: an MLADims")
    for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len), ("block_size", block_size),
                        ("max_query_len", max_query_len), ("num_layers", num_layers)):
        check_positive_int(name, value)
    platform = current_platform()
    cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, platform)
    decode = select_decode_backend(dims, dtype, cache_dtype, block_size, max_query_len=max_query_len,
                                   backend=decode_backend)
    prefill = select_prefill_backend(dims, dtype, backend=prefill_backend)
    impl = decode.get_decode_impl_cls()(
        dims.num_heads, dims.qk_head_dim**-0.5, dims.kv_lora_rank, dims.qk_rope_head_dim, cache_dtype, block_size,
        torch.device("meta"),
    )
    recorder = _RecordingWorkspace()
    impl.reserve_workspace(recorder, max_num_seqs, max_model_len, max_query_len, dtype=dtype)
    prefill.get_prefill_impl_cls()(
        dims.num_heads, dims.qk_head_dim**-0.5, dims.kv_lora_rank, dims.qk_nope_head_dim, dims.qk_rope_head_dim,
        dims.v_head_dim, torch.device("meta"),
    ).reserve_workspace(recorder)
    tokens = workspace_tokens or default_workspace_tokens(max_model_len, max_num_seqs, block_size)
    recorder.reserve(
        ((tokens, dims.kv_cache_width), dtype),
        purpose="prefill: one gathered context chunk",
        what=f"workspace_tokens={tokens} latent rows of {dims.kv_cache_width}",
    )
    return MemoryPlan(
        platform=platform.name,
        dims=dims,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        decode_backend=decode.name,
        prefill_backend=prefill.name,
        entries=recorder.describe(),
        workspace_bytes=recorder.largest,
        num_layers=num_layers,
    )
