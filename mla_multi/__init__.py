"""mla_multi: MLA attention (DeepSeek-V2/V3/R1, Kimi-K2) for AMD and NVIDIA GPUs, behind one registry.

Importing the package parses every `MLA_MULTI_*` variable (a bad value fails
the import with its reason), probes the platform and selects the default
backends for DeepSeek-V3 dimensions; `selected_backends()` returns them.
"""

from __future__ import annotations

import os
import sys

import torch

from mla_multi import envs
from mla_multi.attention import MLAAttention, MLAAttentionV4
from mla_multi.dims import MLADims
from mla_multi.kv_cache import allocate_kv_cache
from mla_multi.metadata import (
    BatchOrder,
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
    "MLAAttentionV4",
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
    "import_selection_errors",
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


def _select_defaults() -> tuple[dict[str, str | None], dict[str, NoBackendError]]:
    """The import-time choice per phase for DeepSeek-V3 dims; a phase no backend can run (a forced backend
    that cannot run these defaults, such as TRITON under the interpreter, which takes no bfloat16) is
    recorded with its reasons instead of failing the import."""
    platform = current_platform()
    dims = MLADims.deepseek_v3()
    dtype = DEFAULT_DTYPE
    chosen: dict[str, str | None] = {}
    errors: dict[str, NoBackendError] = {}
    for phase, select in (("prefill", lambda: select_prefill_backend(dims, dtype)),
                          ("decode", lambda: select_decode_backend(dims, dtype, "auto", 64))):
        try:
            chosen[phase] = select().name
        except NoBackendError as error:
            chosen[phase] = None
            errors[phase] = error
    return chosen, errors


def _fail_import(error: Exception) -> None:
    """Re-raise `error`, or, inside the `mla-multi` command, print it as one line and exit with status 2."""
    orig_argv = getattr(sys, "orig_argv", [])
    if os.path.basename(sys.argv[0] if sys.argv else "") in ("mla-multi", "mla-multi.exe") or (
            "-m" in orig_argv and orig_argv[orig_argv.index("-m") + 1:][:1] == ["mla_multi"]):
        sys.stderr.write(f"mla-multi: error: {error}\n")
        raise SystemExit(2)
    raise error


try:
    envs.validate_all()
    envs.configure_logging()
    from mla_multi.registry import check_forced_names  # noqa: E402

    check_forced_names()
except (envs.EnvironmentValueError, UnknownBackendError) as _error:
    _fail_import(_error)
# Chosen at import where the platform is known without a GPU context (NVML / amdsmi, or no GPU); else on the
# first call, so that the import never initialises CUDA / HIP (a parent that forks workers keeps the GPU free).
_SELECTED: dict | None = None
_SELECTION_ERRORS: dict = {}


def _select_once() -> None:
    global _SELECTED, _SELECTION_ERRORS
    _SELECTED, _SELECTION_ERRORS = _select_defaults()
    if _SELECTION_ERRORS:
        import logging

        logging.getLogger("mla_multi").info(
            "import-time selection: %s", "; ".join(f"{phase}: {error}" for phase, error in _SELECTION_ERRORS.items()))


if platforms.known_without_context():
    _select_once()


def selected_backends() -> dict[str, str]:
    """{"prefill": name, "decode": name} chosen for DeepSeek-V3 dims (128 heads, bf16, block size 64): at import,
    or on the first call where the device can only be described through a GPU context.

    Raises the recorded `NoBackendError` (with every reason) when a phase had no backend for those
    dims, as when a forced backend cannot run them; `import_selection_errors()` reports it without raising.
    """
    if _SELECTED is None:
        _select_once()
    for error in _SELECTION_ERRORS.values():
        raise error
    return dict(_SELECTED)


def import_selection_errors() -> dict[str, str]:
    """{phase: the NoBackendError's message} for each phase the import-time selection could not fill."""
    if _SELECTED is None:
        _select_once()
    return {phase: str(error) for phase, error in _SELECTION_ERRORS.items()}
