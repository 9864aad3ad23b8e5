"""NVIDIA detection through torch's CUDA runtime."""

from __future__ import annotations

import torch

from mla_multi.platforms.base import Platform


def _shared_memory_per_block(props, capability: tuple[int, int]) -> int:
    # torch exposes the opt-in limit on recent releases; fall back to the
    # documented per-architecture values.
    value = getattr(props, "shared_memory_per_block_optin", None)
    if value:
        return int(value)
    return {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024}.get(capability, 227 * 1024)


def detect_cuda(device_index: int = 0) -> Platform:
    """Describe the CUDA device `device_index`. Creates the CUDA context (unavoidable for properties)."""
    props = torch.cuda.get_device_properties(device_index)
    capability = (int(props.major), int(props.minor))
    fp8 = torch.float8_e4m3fn if capability >= (8, 9) else None
    return Platform(
        name=str(props.name),
        vendor="cuda",
        arch=f"sm_{capability[0]}{capability[1]}",
        num_compute_units=int(props.multi_processor_count),
        warp_size=int(getattr(props, "warp_size", 32) or 32),
        fp8_dtype=fp8,
        max_shared_memory_per_block=_shared_memory_per_block(props, capability),
        device_capability=capability,
        device_index=device_index,
    )
