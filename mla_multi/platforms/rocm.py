"""AMD detection: the architecture comes from `gcnArchName`, never from torch's capability tuple."""

from __future__ import annotations

import torch

from mla_multi.platforms.base import Platform

# LDS per workgroup by architecture; CDNA4 (gfx950) raised it to 160 KiB.
_LDS_BYTES = {"gfx950": 160 * 1024}
_DEFAULT_LDS_BYTES = 64 * 1024
# Wave64 on CDNA (gfx9xx); RDNA (gfx10xx-gfx12xx) runs wave32 kernels by default.
_FP8_DTYPES = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}


def parse_gcn_arch_name(gcn_arch_name: str) -> str:
    """'gfx942:sramecc+:xnack-' -> 'gfx942'."""
    arch = gcn_arch_name.split(":", 1)[0].strip()
    if not arch.startswith("gfx"):
        raise ValueError(
            f"gcnArchName={gcn_arch_name!r} does not name a gfx architecture; accepted: 'gfxNNN[:features]'"
        )
    return arch


def warp_size_for_arch(arch: str) -> int:
    return 64 if arch.startswith("gfx9") else 32


def fp8_dtype_for_arch(arch: str) -> torch.dtype | None:
    if arch in _FP8_DTYPES:
        return _FP8_DTYPES[arch]
    if arch.startswith("gfx12"):
        return torch.float8_e4m3fn
    return None


def detect_rocm(device_index: int = 0) -> Platform:
    """Describe the HIP device `device_index` (ROCm PyTorch exposes it as a CUDA device)."""
    props = torch.cuda.get_device_properties(device_index)
    arch = parse_gcn_arch_name(str(getattr(props, "gcnArchName", "")))
    warp = int(getattr(props, "warp_size", 0) or warp_size_for_arch(arch))
    return Platform(
        name=str(props.name) or arch,
        vendor="rocm",
        arch=arch,
        num_compute_units=int(props.multi_processor_count),
        warp_size=warp,
        fp8_dtype=fp8_dtype_for_arch(arch),
        max_shared_memory_per_block=_LDS_BYTES.get(arch, _DEFAULT_LDS_BYTES),
        device_capability=None,
        device_index=device_index,
    )
