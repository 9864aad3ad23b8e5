"""Ready-made descriptions of common accelerators, for impersonation.

Compute units, warp size, FP8 flavour and shared memory per block follow the
vendors' documentation: LDS is 64 KiB on CDNA2/CDNA3 and RDNA3 and 160 KiB on
CDNA4 (gfx950); an sm_90 block may opt into 227 KiB of shared memory, sm_80
163 KiB, sm_100 227 KiB. MI300X / MI325X and MI355X are eight XCDs (dies with their own
L2) of 38 and 32 compute units.
"""

from __future__ import annotations

import torch

from mla_multi.platforms.base import Platform
from mla_multi.platforms.rocm import xcds_for

_KIB = 1024


def _rocm(name: str, arch: str, compute_units: int, fp8_dtype, lds: int) -> Platform:
    """A CDNA device of wave 64, its XCDs as `rocm.detect_rocm` counts them."""
    return Platform(name, "rocm", arch, compute_units, 64, fp8_dtype, lds, num_xcds=xcds_for(arch, compute_units))


SPECS: dict[str, Platform] = {
    spec.name: spec
    for spec in (
        _rocm("MI300X", "gfx942", 304, torch.float8_e4m3fnuz, 64 * _KIB),
        _rocm("MI325X", "gfx942", 304, torch.float8_e4m3fnuz, 64 * _KIB),
        _rocm("MI355X", "gfx950", 256, torch.float8_e4m3fn, 160 * _KIB),
        Platform("MI250X", "rocm", "gfx90a", 110, 64, None, 64 * _KIB),
        Platform("RX7900XTX", "rocm", "gfx1100", 96, 32, None, 64 * _KIB),
        Platform("A100", "cuda", "sm_80", 108, 32, None, 163 * _KIB, (8, 0)),
        Platform("H100", "cuda", "sm_90", 132, 32, torch.float8_e4m3fn, 227 * _KIB, (9, 0)),
        Platform("H200", "cuda", "sm_90", 132, 32, torch.float8_e4m3fn, 227 * _KIB, (9, 0)),
        Platform("B200", "cuda", "sm_100", 148, 32, torch.float8_e4m3fn, 227 * _KIB, (10, 0)),
        Platform("CPU", "cpu", "cpu", 1, 1, None, 0),
    )
}


def get_spec(name: str) -> Platform:
    """Look a ready spec up by name, case-insensitively ("mi300x" works)."""
    by_lower = {key.lower(): spec for key, spec in SPECS.items()}
    try:
        return by_lower[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown platform spec {name!r}; accepted: {', '.join(SPECS)}"
        ) from None
