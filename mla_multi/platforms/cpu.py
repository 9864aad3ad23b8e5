"""The CPU platform: always available, the fallback when no GPU is visible."""

from __future__ import annotations

import os

from mla_multi.platforms.base import Platform


def detect_cpu() -> Platform:
    return Platform(
        name="CPU",
        vendor="cpu",
        arch="cpu",
        num_compute_units=os.cpu_count() or 1,
        warp_size=1,
        fp8_dtype=None,
        max_shared_memory_per_block=0,
    )
