"""Private Triton kernels of mla_multi and their launch configurations (no dispatch logic)."""
