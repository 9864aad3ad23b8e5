"""MLA dimensions and model presets."""

from __future__ import annotations

import dataclasses

from mla_multi.checks import check_positive_int


@dataclasses.dataclass(frozen=True)
class MLADims:
    """The dimensions of one MLA layer on one device (after tensor parallelism).

    num_heads: query heads on this device (N).
    kv_lora_rank: latent width Lkv of the compressed KV (512 for DeepSeek-V3).
    qk_nope_head_dim: P, the per-head query/key width without rotary part.
    qk_rope_head_dim: R, the rotary width shared by all heads (the k_pe column block).
    v_head_dim: V, the per-head value width.
    """

    num_heads: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_positive_int(f"MLADims.{field.name}", getattr(self, field.name))

    @property
    def qk_head_dim(self) -> int:
        """P + R: the head dim of prefill attention (192 for DeepSeek-V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Lkv + R: the width of one latent cache row (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def deepseek_v3(cls, num_heads: int = 128) -> MLADims:
        """DeepSeek-V3 / R1: 128 heads at TP1, 16 at TP8."""
        return cls(num_heads, 512, 128, 64, 128)

    @classmethod
    def kimi_k2(cls, num_heads: int = 64) -> MLADims:
        """Kimi-K2: DeepSeek-V3's attention with 64 heads (8 per device at TP8)."""
        return cls(num_heads, 512, 128, 64, 128)

    @classmethod
    def deepseek_v2_lite(cls, num_heads: int = 16) -> MLADims:
        """DeepSeek-V2-Lite: 16 heads, the same latent and head widths."""
        return cls(num_heads, 512, 128, 64, 128)
