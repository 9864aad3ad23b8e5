"""Platform probing and impersonation.

`current_platform()` detects the device lazily, once: ROCm when torch is a HIP
build with a visible device, CUDA when torch sees an NVIDIA device, otherwise
the CPU.  Detection never raises: a failing probe degrades to the CPU platform
and the error is kept in `detection_error()`.

Detection creates no CUDA / HIP context where it can avoid it (a process that
forks workers after `import mla_multi` must leave the GPU to them): NVML (or
amdsmi on ROCm) gives the name, compute capability / gfx target and the SM /
CU count (`probe_without_context`); only where they cannot does the first
call that needs the platform read torch's device properties, which creates
the context. `known_without_context()` says whether the platform is known, or
can be, without one: the import-time selection runs only then, else on the
first `selected_backends()`.

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


def _visible_device_token() -> int | str | None:
    """torch's device 0 as its management-library index (an int) or UUID (a str) from the visibility variable
    (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES), through torch's own parser; -1 where no device is visible."""
    parse = getattr(torch.cuda, "_parse_visible_devices", None)
    if parse is None:
        return 0
    visible = parse()
    if not visible:
        return -1
    first = visible[0]
    return first if isinstance(first, int) else str(first)


def probe_without_context() -> tuple[Platform, str | None] | None:
    """(platform, error) as `detect_platform` gives it, found without creating a CUDA / HIP context (NVML or
    amdsmi; torch's device count, which asks them), or None where they cannot describe the device (then
    only `detect_platform`, which reads torch's device properties, can). Never raises."""
    try:
        if not getattr(torch.cuda, "_is_compiled", lambda: True)():
            return detect_cpu(), None
        is_hip = getattr(torch.version, "hip", None) is not None
        token = _visible_device_token()
        if token == -1:
            return detect_cpu(), None
        if is_hip:
            from mla_multi.platforms.rocm import probe_amdsmi

            platform = probe_amdsmi(token) if isinstance(token, int) else None
        else:
            from mla_multi.platforms.cuda import probe_nvml

            platform = probe_nvml(token)
        if platform is None:
            return None
        # torch's count asks NVML / amdsmi (not the runtime) where they answer, which they just did
        if torch.cuda.device_count() <= 0:
            return detect_cpu(), None
        return platform, None
    except Exception:
        return None


def _detect() -> tuple[Platform, str | None]:
    found = probe_without_context()
    return found if found is not None else detect_platform()


def current_platform() -> Platform:
    """The platform in force: the innermost `override`, else the detected device."""
    global _detected, _detection_error
    if _override_stack:
        return _override_stack[-1]
    if _detected is None:
        with _lock:
            if _detected is None:
                _detected, _detection_error = _detect()
    return _detected


def known_without_context() -> bool:
    """Whether the detected platform is known, or can be found now, without creating a GPU context (the probe
    through NVML / amdsmi, kept when it succeeds); False where only torch's device properties would tell."""
    global _detected, _detection_error
    if _detected is not None:
        return True
    found = probe_without_context()
    if found is None:
        return False
    with _lock:
        if _detected is None:
            _detected, _detection_error = found
    return True


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
