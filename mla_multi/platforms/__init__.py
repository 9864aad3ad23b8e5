"""Platform probing and impersonation.

`current_platform()` detects the device lazily, once: ROCm when torch is a HIP
build with a visible device, CUDA when torch sees an NVIDIA device, otherwise
the CPU.  Detection never raises: a failing probe degrades to the CPU platform
and the error is kept in `detection_error()`.

`override(spec)` replaces the current platform inside a ``with`` block, so tests
and ``mla-multi info --as MI300X`` see exactly what that device would.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from mla_multi.platforms.base import Platform, Vendor
from mla_multi.platforms.cpu import detect_cpu
from mla_multi.platforms.specs import SPECS, get_spec

__all__ = [
    "Platform",
    "Vendor",
    "SPECS",
    "get_spec",
    "current_platform",
    "detect_platform",
    "detection_error",
    "override",
]

_lock = threading.Lock()
_detected: Platform | None = None
_detection_error: str | None = None
_override_stack: list[Platform] = []


def detect_platform() -> tuple[Platform, str | None]:
    """Probe the machine. Returns (platform, error text or None); never raises."""
    try:
        is_hip = getattr(torch.version, "hip", None) is not None
        # device_count() asks the driver without creating a context.
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            if is_hip:
                from mla_multi.platforms.rocm import detect_rocm

                return detect_rocm(torch.cuda.current_device()), None
            from mla_multi.platforms.cuda import detect_cuda

            return detect_cuda(torch.cuda.current_device()), None
    except Exception as error:  # a broken driver must not break import
        return detect_cpu(), f"{type(error).__name__}: {error}"
    return detect_cpu(), None


def current_platform() -> Platform:
    """The platform in force: the innermost `override`, else the detected device."""
    global _detected, _detection_error
    if _override_stack:
        return _override_stack[-1]
    if _detected is None:
        with _lock:
            if _detected is None:
                _detected, _detection_error = detect_platform()
    return _detected


def detection_error() -> str | None:
    """Why GPU detection fell back to the CPU, if it did."""
    current_platform()
    return _detection_error


@contextlib.contextmanager
def override(platform: Platform | str) -> Iterator[Platform]:
    """Impersonate `platform` (a `Platform` or a name from `SPECS`) inside the block."""
    spec = get_spec(platform) if isinstance(platform, str) else platform
    if not isinstance(spec, Platform):
        raise ValueError(f"override() got {platform!r}; accepted: a Platform or one of {', '.join(SPECS)}")
    _override_stack.append(spec)
    try:
        yield spec
    finally:
        _override_stack.pop()
