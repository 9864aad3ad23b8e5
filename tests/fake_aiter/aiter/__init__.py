"""Test stand-in for AMD's aiter (see tests/fake_aiter/README.md)."""

__version__ = "0.1.20.post1+fake"

from aiter.ops.mha import flash_attn_varlen_func  # noqa: E402,F401
from aiter.ops.attention import (  # noqa: E402,F401
    get_mla_metadata_info_v1,
    get_mla_metadata_v1,
    get_ps_metadata_info_v1,
    get_ps_metadata_v1,
    mla_prefill_ps_asm_fwd,
    mla_reduce_v1,
)
from aiter import mla  # noqa: E402,F401
