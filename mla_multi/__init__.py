"""mla_multi: MLA attention (DeepSeek-V2/V3/R1, Kimi-K2) for AMD and NVIDIA GPUs, behind one registry.

Importing the package parses every `MLA_MULTI_*` variable (a bad value fails
the import with its reason), probes the platform and selects the default
backends for DeepSeek-V3 dimensions; `selected_backends()` returns them.
"""

from __future__ import annotations

import torch

from mla_multi import envs
from mla_multi.attention import MLAAttention
from mla_multi.dims import MLADims
from mla_multi.kv_cache import allocate_kv_cache
from mla_multi.metadata import (
    BatchOrder,
    CommonAttentionMetadata,
    reorder_batch_to_split_decodes_and_prefills,
    split_decodes_and_prefills,
)
from mla_multi.platforms import Platform, current_platform
from mla_multi.registry import NoBackendError, UnknownBackendError, select_decode_backend, select_prefill_backend
from mla_multi.workspace import WorkspaceLockedError, WorkspaceManager

from mla_multi import ops  # noqa: E402  (the functional ops, `mm.ops.*`)
from mla_multi import library  # noqa: E402,F401  (registers torch.ops.mla_multi.*)
from mla_multi.library import set_step  # noqa: E402  (the current step of the compiled MLAAttention.forward)
from mla_multi import memory, workspace  # noqa: E402,F401  (mm.memory.memory_plan, mm.workspace.current_workspace_manager)

__version__ = "0.1.0"

__all__ = [
    "MLAAttention",
    "MLADims",
    "BatchOrder",
    "CommonAttentionMetadata",
    "NoBackendError",
    "Platform",
    "UnknownBackendError",
    "WorkspaceLockedError",
    "WorkspaceManager",
    "allocate_kv_cache",
    "current_platform",
    "ops",
    "reorder_batch_to_split_decodes_and_prefills",
    "select_decode_backend",
    "select_prefill_backend",
    "selected_backends",
    "split_decodes_and_prefills",
]


# The model dtype the import-time selection (and `mla-multi info`) assumes: bfloat16 everywhere MLA models run.
DEFAULT_DTYPE = torch.bfloat16


def default_dtype(platform: Platform | None = None) -> torch.dtype:
    """Deprecated: `DEFAULT_DTYPE` (the dtype never depended on the platform)."""
    import warnings

    warnings.warn("mla_multi.default_dtype() is deprecated; use mla_multi.DEFAULT_DTYPE", DeprecationWarning,
                  stacklevel=2)
    return DEFAULT_DTYPE


def _select_defaults() -> dict[str, str]:
    platform = current_platform()
    dims = MLADims.deepseek_v3()
    dtype = DEFAULT_DTYPE
    return {
        "prefill": select_prefill_backend(dims, dtype).name,
        "decode": select_decode_backend(dims, dtype, "auto", 64).name,
    }


envs.validate_all()
envs.configure_logging()
from mla_multi.registry import check_forced_names  # noqa: E402

check_forced_names()
_SELECTED = _select_defaults()


def selected_backends() -> dict[str, str]:
    """{"prefill": name, "decode": name} chosen at import for DeepSeek-V3 dims (128 heads, bf16, block size 64)."""
    return dict(_SELECTED)
