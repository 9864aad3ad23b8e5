"""CUDA_FLASH_ATTN: FlashAttention on NVIDIA GPUs, from the best implementation present.

Prefill, in order of preference:

1. FlashAttention-3 (`flash_attn_interface.flash_attn_varlen_func`, Hopper
   sm_90): qk 192 / v 128 natively. Releases whose varlen function has no
   `return_attn_probs` return no LSE; the calls that need one then go to the
   next implementation.
2. FlashAttention-2 (`flash_attn.flash_attn_varlen_func`, sm_80 / sm_86 /
   sm_89 / sm_90): one head dim for q, k and v, so V is zero-padded to 192 and
   the output cut back to 128; `return_attn_probs=True` adds the softmax LSE
   (the attention probabilities are only materialised with dropout).
3. PyTorch's own FlashAttention-2 build, through
   `torch.nn.attention.varlen.varlen_attn` where torch has it, else
   `torch.ops.aten._flash_attention_forward`; both return the output in q's
   head dim (V padded as for FlashAttention-2) and the LSE as [N, T].
4. Last, PyTorch's cuDNN attention (`torch.ops.aten._cudnn_attention_forward`,
   cuDNN 9+): ragged [T, N, D] inputs with v head dim 128 natively and the
   LSE as [T, N, 1]. It is correct but slow in varlen form: on an H200 with
   torch 2.11 / cuDNN 9.19 every call cost about 50 ms whatever its size
   (bench/gpu_check_vendor.py; the dense cuDNN kernel runs the same 8192-token
   causal problem in 0.6 ms), so it only serves where no flash kernel runs.
   Its causal mask is aligned top-left, which equals bottom-right only when
   every sequence has as many queries as keys, so it takes causal calls only
   when the same cu_seqlens tensor is passed for q and k (the new-token
   prefill); rows without keys are set to 0 / -inf.

Decode uses FlashAttention-3's MLA path: `flash_attn_with_kvcache` with the
rope part as q / k (64 wide) and the latent part as `qv` / v (512 wide), the
paged cache addressed by `page_table` and `cache_seqlens`, on sm_90 only.

`FLASH_ATTN_CALLS` records the calls made into flash-attention; the test
suite checks them against flash-attention's published source.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from mla_multi.backends.base import (
    DecodeSelectorConfig,
    MLADecodeBackend,
    MLADecodeImpl,
    MLAPrefillBackend,
    MLAPrefillImpl,
    PrefillSelectorConfig,
    dtype_name,
    prefill_lse_heads_tokens,
)
from mla_multi.platforms import Platform, current_platform


@dataclasses.dataclass(frozen=True)
class FlashAttnCall:
    """One flash-attention function this backend calls: where it is published and the keywords passed.

    `source` is the file of the flash-attn source distribution that defines
    `function`; `optional_keywords` are passed only when the installed
    signature has them.
    """

    module: str
    function: str
    source: str
    keywords: tuple[str, ...]
    optional_keywords: tuple[str, ...] = ()


FA3_VARLEN = FlashAttnCall(
    module="flash_attn_interface",
    function="flash_attn_varlen_func",
    source="hopper/flash_attn_interface.py",
    keywords=("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal"),
    optional_keywords=("return_attn_probs",),
)
FA3_KVCACHE = FlashAttnCall(
    module="flash_attn_interface",
    function="flash_attn_with_kvcache",
    source="hopper/flash_attn_interface.py",
    keywords=(
        "q",
        "k_cache",
        "v_cache",
        "qv",
        "cache_seqlens",
        "page_table",
        "softmax_scale",
        "causal",
        "num_splits",
        "return_softmax_lse",
    ),
)
FA2_VARLEN = FlashAttnCall(
    module="flash_attn",
    function="flash_attn_varlen_func",
    source="flash_attn/flash_attn_interface.py",
    keywords=(
        "q",
        "k",
        "v",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
        "softmax_scale",
        "causal",
        "return_attn_probs",
    ),
)
FLASH_ATTN_CALLS: tuple[FlashAttnCall, ...] = (FA3_VARLEN, FA3_KVCACHE, FA2_VARLEN)

# Implementation names, in order of preference.
FLASH_ATTN_3 = "flash_attn_3"
FLASH_ATTN_2 = "flash_attn_2"
TORCH_CUDNN_ATTENTION = "torch._cudnn_attention_forward"
TORCH_VARLEN_ATTN = "torch.varlen_attn"
TORCH_FLASH_ATTENTION_FORWARD = "torch._flash_attention_forward"
PREFILL_IMPLEMENTATIONS = (FLASH_ATTN_3, FLASH_ATTN_2, TORCH_VARLEN_ATTN, TORCH_FLASH_ATTENTION_FORWARD, TORCH_CUDNN_ATTENTION)
# cuDNN's ragged (varlen) SDPA needs cuDNN 9.
MIN_CUDNN_VERSION = 90000

# FlashAttention-2 kernels (flash-attn's and PyTorch's build) handle head dims
# up to 256 in multiples of 8.
MAX_HEAD_DIM = 256
# FA3's MLA decode: qk = rope (64) on q / k_cache and latent (512) on qv / v_cache.
FA3_MLA_QK_ROPE_HEAD_DIM = 64
FA3_MLA_KV_LORA_RANK = 512


# --------------------------------------------------------------------------- probing


@dataclasses.dataclass(frozen=True)
class ImplementationProbe:
    """One prefill/decode implementation: usable or the reason it is not, and its parameters."""

    name: str
    version: str | None = None
    error: str | None = None
    parameters: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def has(self, function: str, parameter: str) -> bool:
        return parameter in self.parameters.get(function, ())


def _parameters(function: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except Exception:
            continue
    return None


def _probe_module(name: str, module_name: str, functions: tuple[str, ...], distributions: tuple[str, ...]) -> ImplementationProbe:
    version = _distribution_version(*distributions)
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # a wheel built for another torch raises ImportError or OSError
        if isinstance(error, ModuleNotFoundError) and error.name == module_name:
            return ImplementationProbe(name, version, f"{name}: module {module_name} is not installed")
        return ImplementationProbe(name, version, f"{name}: import {module_name} failed: {type(error).__name__}: {error}")
    version = version or getattr(module, "__version__", None)
    parameters = {}
    for function in functions:
        target = getattr(module, function, None)
        if target is None:
            return ImplementationProbe(name, version, f"{name}: {module_name} {version or ''} has no {function}".replace("  ", " "))
        parameters[function] = _parameters(target)
    return ImplementationProbe(name, version, None, parameters)


def _probe_torch_varlen() -> ImplementationProbe:
    try:
        module = importlib.import_module("torch.nn.attention.varlen")
        function = module.varlen_attn
    except Exception as error:
        return ImplementationProbe(
            TORCH_VARLEN_ATTN, torch.__version__, f"{TORCH_VARLEN_ATTN}: torch {torch.__version__} has none ({type(error).__name__})"
        )
    return ImplementationProbe(TORCH_VARLEN_ATTN, torch.__version__, None, {"varlen_attn": _parameters(function)})


def _probe_torch_flash_forward() -> ImplementationProbe:
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return ImplementationProbe(
            TORCH_FLASH_ATTENTION_FORWARD, torch.__version__, f"{TORCH_FLASH_ATTENTION_FORWARD}: torch {torch.__version__} has none"
        )
    if not torch.backends.cuda.is_flash_attention_available():
        return ImplementationProbe(
            TORCH_FLASH_ATTENTION_FORWARD,
            torch.__version__,
            f"{TORCH_FLASH_ATTENTION_FORWARD}: torch {torch.__version__} is built without flash attention",
        )
    return ImplementationProbe(TORCH_FLASH_ATTENTION_FORWARD, torch.__version__)


def _probe_torch_cudnn() -> ImplementationProbe:
    name = TORCH_CUDNN_ATTENTION
    if not hasattr(torch.ops.aten, "_cudnn_attention_forward"):
        return ImplementationProbe(name, torch.__version__, f"{name}: torch {torch.__version__} has none")
    try:
        cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        cudnn_version = None
    if cudnn_version is None:
        return ImplementationProbe(name, torch.__version__, f"{name}: torch {torch.__version__} has no cuDNN")
    if cudnn_version < MIN_CUDNN_VERSION:
        return ImplementationProbe(name, str(cudnn_version), f"{name}: cuDNN {cudnn_version} is older than {MIN_CUDNN_VERSION}")
    return ImplementationProbe(name, f"cuDNN {cudnn_version}")


@functools.lru_cache(maxsize=1)
def probe_implementations() -> dict[str, ImplementationProbe]:
    """Every implementation by name, probed once. Never raises."""
    probes = {
        FLASH_ATTN_3: _probe_module(
            FLASH_ATTN_3, "flash_attn_interface", (FA3_VARLEN.function, FA3_KVCACHE.function), ("flash_attn_3", "flash-attn-3")
        ),
        TORCH_CUDNN_ATTENTION: _probe_torch_cudnn(),
        FLASH_ATTN_2: _probe_module(FLASH_ATTN_2, "flash_attn", (FA2_VARLEN.function,), ("flash-attn", "flash_attn")),
        TORCH_VARLEN_ATTN: _probe_torch_varlen(),
        TORCH_FLASH_ATTENTION_FORWARD: _probe_torch_flash_forward(),
    }
    if torch.version.cuda is None:
        # A CPU or ROCm build of torch runs none of them on an NVIDIA GPU.
        build = "a ROCm" if torch.version.hip else "a CPU-only"
        for name in (TORCH_CUDNN_ATTENTION, TORCH_VARLEN_ATTN, TORCH_FLASH_ATTENTION_FORWARD):
            if probes[name].error is None:
                probes[name] = dataclasses.replace(
                    probes[name], error=f"{name}: torch {torch.__version__} is {build} build"
                )
    return probes


def clear_probe_cache() -> None:
    """Forget the probes (tests that change the installed modules call this)."""
    probe_implementations.cache_clear()


def _capability_reasons(name: str, platform: Platform) -> list[str]:
    """Why implementation `name` cannot run on `platform` (by compute capability)."""
    capability = platform.device_capability
    where = f"{platform.name} ({platform.arch})"
    if capability is None:
        return [f"{name}: {where} reports no NVIDIA compute capability"]
    if name == FLASH_ATTN_3 and capability != (9, 0):
        return [f"{name}: needs sm_90 (Hopper); {where} is not"]
    if name == FLASH_ATTN_2 and not ((8, 0) <= capability < (10, 0)):
        return [f"{name}: built for sm_80 .. sm_90; {where} is not"]
    if capability < (8, 0):
        return [f"{name}: needs sm_80 or newer; {where} is older"]
    return []


def prefill_candidates(
    platform: Platform, need_lse: bool, causal_unequal: bool = False
) -> tuple[list[str], dict[str, list[str]]]:
    """Implementations that can run prefill on `platform`, best first, and the reasons of the others.

    `causal_unequal`: a causal call whose query and key lengths may differ
    (needs a bottom-right aligned mask).
    """
    usable, reasons = [], {}
    probes = probe_implementations()
    for name in PREFILL_IMPLEMENTATIONS:
        probe = probes[name]
        why = [probe.error] if probe.error else _capability_reasons(name, platform)
        if not why and need_lse and name == FLASH_ATTN_3 and not probe.has(FA3_VARLEN.function, "return_attn_probs"):
            why = [f"{name} {probe.version or ''}: flash_attn_varlen_func returns no LSE".replace("  ", " ")]
        if not why and causal_unequal and name == TORCH_CUDNN_ATTENTION:
            why = [f"{name}: its causal mask is aligned top-left"]
        if why:
            reasons[name] = why
        else:
            usable.append(name)
    return usable, reasons


# --------------------------------------------------------------------------- prefill


def _pad_last(tensor: torch.Tensor, width: int) -> torch.Tensor:
    if tensor.shape[-1] == width:
        return tensor
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))


def _run_flash_attn_3(probe, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, need_lse):
    from flash_attn_interface import flash_attn_varlen_func

    keywords = {}
    if need_lse:
        keywords["return_attn_probs"] = True
    result = flash_attn_varlen_func(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=scale, causal=causal, **keywords,
    )
    if isinstance(result, (tuple, list)):
        return result[0], (result[1] if need_lse else None)
    return result, None


def _run_flash_attn_2(probe, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, need_lse):
    from flash_attn import flash_attn_varlen_func

    v_head_dim = v.shape[-1]
    result = flash_attn_varlen_func(
        q=q, k=k, v=_pad_last(v, q.shape[-1]), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
        max_seqlen_k=max_k, softmax_scale=scale, causal=causal, return_attn_probs=need_lse,
    )
    if need_lse:
        return result[0][..., :v_head_dim], result[1]
    return result[..., :v_head_dim], None


def _rows_without_keys(cu_q: torch.Tensor, cu_k: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] bool: query rows whose sequence has no keys, found on the device."""
    tokens = torch.arange(num_tokens, device=cu_q.device, dtype=cu_q.dtype)
    sequence = torch.searchsorted(cu_q[1:].contiguous(), tokens, right=True)
    key_lens = (cu_k[1:] - cu_k[:-1]).to(torch.int64)
    return key_lens.index_select(0, sequence.clamp_max(key_lens.numel() - 1)) == 0


def _run_torch_cudnn(probe, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, need_lse):
    num_tokens, num_heads = q.shape[0], q.shape[1]
    result = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, max_q, max_k, need_lse, 0.0, causal, False, scale=scale
    )
    out = result[0]
    empty = _rows_without_keys(cu_q, cu_k, num_tokens)
    out = torch.where(empty.view(-1, 1, 1), torch.zeros((), dtype=out.dtype, device=out.device), out)
    if not need_lse:
        return out, None
    lse = result[1].reshape(num_tokens, num_heads).transpose(0, 1).float()  # [T, N, 1] -> [N, T]
    lse = torch.where(empty.unsqueeze(0), torch.full((), float("-inf"), device=lse.device), lse)
    return out, lse


def _run_torch_varlen_attn(probe, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, need_lse):
    from torch.nn.attention import varlen

    v_head_dim = v.shape[-1]
    parameters = probe.parameters.get("varlen_attn", ())
    keywords: dict[str, Any] = {"scale": scale}
    if causal:
        # Newer torch spells causal as a (-1, 0) window; the first releases had is_causal.
        if "window_size" in parameters:
            keywords["window_size"] = (-1, 0)
        else:
            keywords["is_causal"] = True
    if need_lse:
        keywords["return_aux"] = varlen.AuxRequest(lse=True)
    result = varlen.varlen_attn(q, k, _pad_last(v, q.shape[-1]), cu_q, cu_k, max_q, max_k, **keywords)
    if need_lse:
        return result[0][..., :v_head_dim], result[1]
    return result[..., :v_head_dim], None


def _run_torch_flash_attention_forward(probe, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, need_lse):
    v_head_dim = v.shape[-1]
    output, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, _pad_last(v, q.shape[-1]), cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return output[..., :v_head_dim], (lse if need_lse else None)


_RUNNERS: dict[str, Callable] = {
    FLASH_ATTN_3: _run_flash_attn_3,
    FLASH_ATTN_2: _run_flash_attn_2,
    TORCH_CUDNN_ATTENTION: _run_torch_cudnn,
    TORCH_VARLEN_ATTN: _run_torch_varlen_attn,
    TORCH_FLASH_ATTENTION_FORWARD: _run_torch_flash_attention_forward,
}


class FlashAttnPrefillImpl(MLAPrefillImpl):
    """Varlen prefill through the best FlashAttention implementation present (see the module docstring)."""

    def implementation(self, need_lse: bool, causal_unequal: bool = False) -> str:
        """The implementation a call uses on the current platform (see `prefill_candidates`)."""
        usable, reasons = prefill_candidates(current_platform(), need_lse, causal_unequal)
        if not usable:
            raise RuntimeError("no FlashAttention implementation can run here: " + "; ".join(sum(reasons.values(), [])))
        return usable[0]

    def forward_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        return_softmax_lse: bool,
    ):
        """q [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv] float16 / bfloat16 on CUDA; cu_seqlens int32 [B + 1].

        Causal masks are aligned bottom-right. Returns out [Tq, N, Dv] and,
        with `return_softmax_lse`, lse [N, Tq] float32 (-inf for rows without keys).
        """
        # The same cu_seqlens object for q and k means equal lengths (new-token
        # prefill); comparing contents would read them back to the host.
        name = self.implementation(return_softmax_lse, causal and cu_seqlens_q is not cu_seqlens_k)
        probe = probe_implementations()[name]
        out, lse = _RUNNERS[name](
            probe, q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), self.scale, causal,
            return_softmax_lse,
        )
        if not return_softmax_lse:
            return out
        return out, prefill_lse_heads_tokens(lse, q.shape[1], q.shape[0], "flash attention", out)


class FlashAttnPrefillBackend(MLAPrefillBackend):
    """FlashAttention-3, FlashAttention-2 or PyTorch's flash kernels on NVIDIA GPUs."""

    name: ClassVar[str] = "CUDA_FLASH_ATTN"
    vendors = frozenset({"cuda"})
    supported_dtypes = (torch.float16, torch.bfloat16)

    @staticmethod
    def get_prefill_impl_cls():
        return FlashAttnPrefillImpl

    @classmethod
    def prefill_implementation(cls, platform: Platform | None = None, need_lse: bool = True) -> str | None:
        """The implementation prefill uses on `platform` (default: the current one), or None."""
        usable, _ = prefill_candidates(platform or current_platform(), need_lse)
        return usable[0] if usable else None

    @classmethod
    def availability_reasons(cls) -> list[str]:
        probes = probe_implementations()
        if all(p.error for p in probes.values()):
            return [p.error for p in probes.values()]
        return []

    @classmethod
    def validate_configuration(cls, platform: Platform, config: PrefillSelectorConfig) -> list[str]:
        """Reasons no FlashAttention implementation here can run `config` on `platform`."""
        reasons = cls.platform_reasons(platform)
        if reasons:
            return reasons
        if config.dtype not in cls.supported_dtypes:
            reasons.append(
                f"dtype {dtype_name(config.dtype)} is not supported; supported: "
                + ", ".join(dtype_name(d) for d in cls.supported_dtypes)
            )
        dims = config.dims
        for label, value in (("qk_head_dim", dims.qk_head_dim), ("v_head_dim", dims.v_head_dim)):
            if value > MAX_HEAD_DIM or value % 8:
                reasons.append(f"{label} {value} is not supported; accepted: a multiple of 8 up to {MAX_HEAD_DIM}")
        if dims.v_head_dim > dims.qk_head_dim:
            reasons.append(
                f"v_head_dim {dims.v_head_dim} over qk_head_dim {dims.qk_head_dim} is not supported (V is padded to the qk head dim)"
            )
        # Chunked context needs the LSE, so an implementation only counts when it returns one.
        usable, others = prefill_candidates(platform, need_lse=True)
        if not usable:
            reasons += [reason for name in PREFILL_IMPLEMENTATIONS for reason in others.get(name, [])]
        return reasons

    @classmethod
    def info(cls) -> dict[str, Any]:
        info = super().info()
        probes = probe_implementations()
        info.update(
            implementation=cls.prefill_implementation(),
            implementations={name: (p.error or f"available{' ' + p.version if p.version else ''}") for name, p in probes.items()},
        )
        return info


# --------------------------------------------------------------------------- decode


class FlashAttnMLADecodeImpl(MLADecodeImpl):
    """MLA decode through FlashAttention-3's `flash_attn_with_kvcache` with `qv`."""

    def forward_mqa(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        num_kv_splits: int | None = None,
        workspace_manager=None,
        max_seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope [B, (Q,) N, 512], q_pe [B, (Q,) N, 64] bfloat16 / float16; kv_cache
        [num_blocks, block_size, 576]; block_table [B, max_blocks] int32; seq_lens [B] int32.

        Returns out [B, (Q,) N, 512] and lse [B, (Q,) N] float32. Q query tokens
        per request are causal, aligned to the end of the sequence.
        `num_kv_splits=None` leaves the split count to FlashAttention-3 (0).
        """
        from flash_attn_interface import flash_attn_with_kvcache

        single_token = q_nope.dim() == 3
        if single_token:
            q_nope, q_pe = q_nope.unsqueeze(1), q_pe.unsqueeze(1)
        kv_lora_rank = q_nope.shape[-1]
        # Column views of the cache: the last dim stays contiguous, as FA3 needs.
        k_pe_cache = kv_cache[..., kv_lora_rank:].unsqueeze(2)
        kv_c_cache = kv_cache[..., :kv_lora_rank].unsqueeze(2)
        out, lse, *_ = flash_attn_with_kvcache(
            q=q_pe.contiguous(),
            k_cache=k_pe_cache,
            v_cache=kv_c_cache,
            qv=q_nope.contiguous(),
            cache_seqlens=seq_lens.to(torch.int32),
            page_table=block_table.to(torch.int32),
            softmax_scale=self.scale,
            causal=True,
            num_splits=0 if num_kv_splits is None else int(num_kv_splits),
            return_softmax_lse=True,
        )
        lse = lse.transpose(1, 2)  # [B, N, Q] -> [B, Q, N]
        empty = (seq_lens <= 0).view(-1, 1, 1)
        out = torch.where(empty.unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=out.device), out)
        lse = torch.where(empty | (lse == float("inf")), torch.full((), float("-inf"), device=lse.device), lse.float())
        if single_token:
            out, lse = out.squeeze(1), lse.squeeze(1)
        return out, lse


class FlashAttnMLADecodeBackend(MLADecodeBackend):
    """FlashAttention-3's MLA decode (`qv`) on Hopper."""

    name: ClassVar[str] = "CUDA_FLASH_ATTN"
    vendors = frozenset({"cuda"})
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = (torch.float16, torch.bfloat16)
    max_num_heads = 128
    max_query_len = 16
    supports_cuda_graphs = True

    @staticmethod
    def get_decode_impl_cls():
        return FlashAttnMLADecodeImpl

    @classmethod
    def availability_reasons(cls) -> list[str]:
        probe = probe_implementations()[FLASH_ATTN_3]
        if probe.error:
            return [f"decode needs FlashAttention-3's MLA path; {probe.error}"]
        missing = [k for k in FA3_KVCACHE.keywords if not probe.has(FA3_KVCACHE.function, k)]
        if missing:
            return [f"{FLASH_ATTN_3} {probe.version}: flash_attn_with_kvcache lacks {', '.join(missing)}"]
        return []

    @classmethod
    def validate_configuration(cls, platform: Platform, config: DecodeSelectorConfig) -> list[str]:
        """Reasons FlashAttention-3 cannot decode `config` on `platform` (empty when it can)."""
        reasons = super().validate_configuration(platform, config)
        if reasons and cls.availability_reasons():
            return reasons
        if not cls.platform_reasons(platform):
            reasons += [r for r in _capability_reasons(FLASH_ATTN_3, platform)]
        dims = config.dims
        if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (FA3_MLA_KV_LORA_RANK, FA3_MLA_QK_ROPE_HEAD_DIM):
            reasons.append(
                f"kv_lora_rank {dims.kv_lora_rank} / qk_rope_head_dim {dims.qk_rope_head_dim} are not supported; "
                f"FlashAttention-3's MLA path is built for {FA3_MLA_KV_LORA_RANK} / {FA3_MLA_QK_ROPE_HEAD_DIM}"
            )
        return reasons


__all__ = [
    "FLASH_ATTN_CALLS",
    "FlashAttnCall",
    "FlashAttnMLADecodeBackend",
    "FlashAttnMLADecodeImpl",
    "FlashAttnPrefillBackend",
    "FlashAttnPrefillImpl",
    "clear_probe_cache",
    "prefill_candidates",
    "probe_implementations",
]
