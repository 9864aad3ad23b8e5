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
from mla_multi.metadata import (
    CommonAttentionMetadata,
    reorder_batch_to_split_decodes_and_prefills,
    split_decodes_and_prefills,
)
from mla_multi import platforms
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
    "CommonAttentionMetadata",
    "NoBackendError",
    "Platform",
    "UnknownBackendError",
    "WorkspaceLockedError",
    "WorkspaceManager",
    "current_platform",
    "ops",
    "reorder_batch_to_split_decodes_and_prefills",
    "select_decode_backend",
    "select_prefill_backend",
    "selected_backends",
    "split_decodes_and_prefills",
]


def default_dtype(platform: Platform) -> torch.dtype:
    """The model dtype the import-time selection assumes: bfloat16 everywhere MLA models run."""
    return torch.bfloat16


def _select_defaults() -> dict[str, str]:
    platform = current_platform()
    dims = MLADims.deepseek_v3()
    dtype = default_dtype(platform)
    return {
        "prefill": select_prefill_backend(dims, dtype).name,
        "decode": select_decode_backend(dims, dtype, "auto", 64).name,
    }


envs.validate_all()
envs.configure_logging()
from mla_multi.registry import check_forced_names  # noqa: E402

check_forced_names()
# Chosen at import where the platform is known without a GPU context (NVML / amdsmi, or no GPU); else on the
# first call, so that the import never initialises CUDA / HIP (a parent that forks workers keeps the GPU free).
_SELECTED = _select_defaults() if platforms.known_without_context() else None


def selected_backends() -> dict[str, str]:
    """{"prefill": name, "decode": name} chosen for DeepSeek-V3 dims (128 heads, bf16, block size 64): at import,
    or on the first call where the device can only be described through a GPU context."""
    global _SELECTED
    if _SELECTED is None:
        _SELECTED = _select_defaults()
    return dict(_SELECTED)
