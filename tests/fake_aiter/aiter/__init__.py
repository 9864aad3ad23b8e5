"""Test stand-in for AMD's aiter (see tests/fake_aiter/README.md)."""

__version__ = "0.1.7.post2.dev18+fake"

from aiter.ops.mha import flash_attn_varlen_func  # noqa: E402,F401
from aiter import mla  # noqa: E402,F401
