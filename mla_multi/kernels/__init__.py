"""Private Triton kernels of mla_multi and their launch configurations (no dispatch logic)."""

from __future__ import annotations

import os


def interpreter_active() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on the CPU.

    Triton reads the variable when a kernel is defined, so it must be set
    before the kernel modules are imported; this reads it the way Triton does.
    False when Triton is not importable.
    """
    try:
        import triton  # noqa: F401
    except Exception:  # no (usable) Triton: no interpreter either
        return False
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:  # a Triton without knobs reads the variable itself
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
