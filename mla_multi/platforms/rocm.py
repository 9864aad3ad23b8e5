"""AMD detection: the architecture comes from `gcnArchName`, never from torch's capability tuple."""

from __future__ import annotations

import torch

from mla_multi.platforms.base import Platform

# LDS per workgroup by architecture; CDNA4 (gfx950) raised it to 160 KiB.
_LDS_BYTES = {"gfx950": 160 * 1024}
_DEFAULT_LDS_BYTES = 64 * 1024
# Wave64 on CDNA (gfx9xx); RDNA (gfx10xx-gfx12xx) runs wave32 kernels by default.
_FP8_DTYPES = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}


# Compute units an XCD (a die with its own L2; the device deals a launch's workgroups to its XCDs in turn):
# MI300X / MI325X 8 x 38 (304), MI300A 6 x 38 (228), MI350X / MI355X 8 x 32 (256). ROCm has no query for
# the count; a compute partition (DPX, QPX, CPX) shows whole XCDs, hence the CU count divided by these.
_CUS_PER_XCD = {"gfx942": 38, "gfx950": 32}
# parts whose XCDs hold other counts: MI308X (gfx942, 4 XCDs of 20 CUs)
_XCDS_BY_ARCH_AND_CUS = {("gfx942", 80): 4}


def xcds_for(arch: str, compute_units: int) -> int:
    """The XCDs of a device of `arch` with `compute_units` (1 where the part is not known to have several)."""
    if (arch, compute_units) in _XCDS_BY_ARCH_AND_CUS:
        return _XCDS_BY_ARCH_AND_CUS[(arch, compute_units)]
    per = _CUS_PER_XCD.get(arch)
    if per is None or compute_units < per or compute_units % per:
        return 1
    return compute_units // per


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


def rocm_platform(name: str, arch: str, compute_units: int, device_index: int, warp: int | None = None) -> Platform:
    """The `Platform` of an AMD device from what amdsmi or torch's properties tell of it."""
    return Platform(
        name=name or arch,
        vendor="rocm",
        arch=arch,
        num_compute_units=compute_units,
        warp_size=warp or warp_size_for_arch(arch),
        fp8_dtype=fp8_dtype_for_arch(arch),
        max_shared_memory_per_block=_LDS_BYTES.get(arch, _DEFAULT_LDS_BYTES),
        device_capability=None,
        device_index=device_index,
        num_xcds=xcds_for(arch, compute_units),
    )


def probe_amdsmi(index: int = 0) -> Platform | None:
    """Describe the HIP device of amdsmi index `index` without creating a HIP context (amdsmi's ASIC info: the
    gfx target and the compute units); None where amdsmi is missing or does not say them."""
    try:
        import amdsmi

        amdsmi.amdsmi_init()
        try:
            handle = amdsmi.amdsmi_get_processor_handles()[index]
            info = amdsmi.amdsmi_get_gpu_asic_info(handle)
        finally:
            amdsmi.amdsmi_shut_down()
        arch = parse_gcn_arch_name(str(info.get("target_graphics_version", "")))
        compute_units = int(info["num_compute_units"])
        name = str(info.get("market_name") or arch)
    except Exception:
        return None
    if compute_units <= 0:
        return None
    return rocm_platform(name, arch, compute_units, 0)


def detect_rocm(device_index: int = 0) -> Platform:
    """Describe the HIP device `device_index` (ROCm PyTorch exposes it as a CUDA device)."""
    props = torch.cuda.get_device_properties(device_index)
    arch = parse_gcn_arch_name(str(getattr(props, "gcnArchName", "")))
    warp = int(getattr(props, "warp_size", 0) or warp_size_for_arch(arch))
    return rocm_platform(str(props.name), arch, int(props.multi_processor_count), device_index, warp)
