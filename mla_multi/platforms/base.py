"""The `Platform` description every other module asks about the device.

A platform is a plain, frozen record: vendor, architecture, compute units, warp
size, FP8 flavour and shared memory.  Detection lives in `cuda.py`, `rocm.py`
and `cpu.py`; ready-made descriptions of common accelerators live in `specs.py`
so tests and `mla-multi info --as MI300X` can impersonate them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from mla_multi.checks import check_positive_int

Vendor = Literal["cuda", "rocm", "cpu"]


@dataclasses.dataclass(frozen=True)
class Platform:
    """What kernels, heuristics and the registry need to know about a device.

    Attributes:
        name: human name ("MI300X", "H100", "NVIDIA H200", "CPU").
        vendor: "cuda", "rocm" or "cpu".
        arch: "gfx942", "gfx950", "gfx90a", "gfx1100", "sm_80", "sm_90", ... or "cpu".
        device_capability: (major, minor) on NVIDIA only.  ROCm reports a
            capability tuple through torch too (gfx942 gives (9, 4)), which
            passes every ``>= (9, 0)`` check by accident, so it is never kept.
        num_compute_units: streaming multiprocessors (NVIDIA) or compute units (AMD).
        warp_size: 32 on NVIDIA and RDNA, 64 on CDNA.
        fp8_dtype: the FP8 KV-cache dtype the hardware computes with, or None.
        max_shared_memory_per_block: shared memory (NVIDIA) or LDS (AMD) in bytes
            that one program may use.
        device_index: the torch device index, None for impersonated platforms.
        num_xcds: the dies (AMD XCDs) the device deals a launch's programs to in turn, program i to die
            i % num_xcds, each die with its own L2 (MI300X and MI355X: 8); 1 elsewhere.
    """

    name: str
    vendor: Vendor
    arch: str
    num_compute_units: int
    warp_size: int
    fp8_dtype: torch.dtype | None
    max_shared_memory_per_block: int
    device_capability: tuple[int, int] | None = None
    device_index: int | None = None
    num_xcds: int = 1

    def __post_init__(self) -> None:
        if self.vendor not in ("cuda", "rocm", "cpu"):
            raise ValueError(
                f"Platform.vendor={self.vendor!r}; accepted: 'cuda', 'rocm', 'cpu'"
            )
        check_positive_int("Platform.num_xcds", self.num_xcds)
        if self.vendor != "cuda" and self.device_capability is not None:
            raise ValueError(
                f"Platform.device_capability={self.device_capability!r} on vendor "
                f"{self.vendor!r}; only NVIDIA platforms carry a capability"
            )

    def is_cuda(self) -> bool:
        return self.vendor == "cuda"

    def is_rocm(self) -> bool:
        return self.vendor == "rocm"

    def is_cpu(self) -> bool:
        return self.vendor == "cpu"

    def is_gpu(self) -> bool:
        return self.vendor != "cpu"

    def is_cdna3_or_newer(self) -> bool:
        """MI300 (gfx942) and MI350/MI355 (gfx950): the arches aiter's MLA targets."""
        return self.arch in ("gfx942", "gfx950")

    def has_device_capability(self, major: int, minor: int = 0) -> bool:
        """True on NVIDIA devices of at least this capability; always False elsewhere."""
        return self.device_capability is not None and self.device_capability >= (major, minor)

    @property
    def torch_device(self) -> torch.device:
        if self.vendor == "cpu":
            return torch.device("cpu")
        # ROCm PyTorch exposes HIP devices under the "cuda" device type.
        return torch.device("cuda", self.device_index or 0)

    def triton_target(self):
        """The Triton `GPUTarget` for compiling ahead of time, or None on the CPU."""
        if self.vendor == "cpu":
            return None
        from triton.backends.compiler import GPUTarget

        if self.vendor == "rocm":
            return GPUTarget("hip", self.arch, self.warp_size)
        major, minor = self.device_capability or _capability_from_arch(self.arch)
        return GPUTarget("cuda", major * 10 + minor, self.warp_size)

    def describe(self) -> dict:
        """A JSON-friendly summary (used by `mla-multi info`)."""
        return {
            "name": self.name,
            "vendor": self.vendor,
            "arch": self.arch,
            "device_capability": list(self.device_capability) if self.device_capability else None,
            "num_compute_units": self.num_compute_units,
            "warp_size": self.warp_size,
            "fp8_dtype": str(self.fp8_dtype).replace("torch.", "") if self.fp8_dtype else None,
            "max_shared_memory_per_block": self.max_shared_memory_per_block,
            "num_xcds": self.num_xcds,
        }


def _capability_from_arch(arch: str) -> tuple[int, int]:
    digits = arch.removeprefix("sm_").rstrip("a")
    return int(digits[:-1]), int(digits[-1])
