"""FLASHINFER: FlashInfer's MLA paged decode and ragged prefill on NVIDIA GPUs.

Decode runs `flashinfer.mla.BatchMLAPagedAttentionWrapper` over the package's
own cache layout: the `[num_blocks, block_size, 576]` cache is handed over as
one packed tensor, which FlashInfer views as its 512-wide ckv and 64-wide kpe
parts without a copy; the absorbed query goes in as the split pair
`(q_nope, q_pe)`. Prefill runs `flashinfer.BatchPrefillWithRaggedKVCacheWrapper`
with qk head dim 192 and v head dim 128.

FlashInfer splits host-side planning from the launch. Planning reads the
lengths on the host, so it is done once per batch (`plan_decode` /
`plan_prefill`, fed by `CommonAttentionMetadata`) and every layer of a model
only runs; the functional ops (`mm.ops.mla_decode` / `mla_prefill`) plan on
each call, reading the lengths from the device. A decode plan made with
`cuda_graph=True` copies its metadata into fixed buffers, so a graph captured
after it can be replayed after re-planning with new lengths.

Both wrappers return a base-2 LSE unless asked otherwise; this backend asks
for the natural log (`return_lse_base_on_e`, `lse_base="ln"`) and the
package's layouts (`[B, N]` for decode, `[N, T]` for prefill).

FlashInfer compiles its kernels with nvcc on first use unless prebuilt
kernels (`flashinfer-jit-cache`) are installed; the first call of each
configuration is timed and logged once at INFO, and `mla-multi warmup` builds
them ahead of serving.

`FLASHINFER_CALLS` records every call into FlashInfer with the keywords it
passes; the test suite checks them against FlashInfer's published source.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import threading
import time
import weakref
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
)
from mla_multi.kernels import capturing
from mla_multi.metadata import pinned, to_device
from mla_multi.platforms import Platform

logger = logging.getLogger("mla_multi")

# The oldest release whose MLA wrapper takes `metadata=MLAPlanMetadata` and the
# structural `query=` / `kv_cache=` run arguments used here.
MIN_FLASHINFER_VERSION = "0.7.2"
# FlashInfer's own recommendation for the float workspace of its wrappers.
FLOAT_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class FlashInferCall:
    """One FlashInfer function or method this backend calls: where it is published and the keywords passed.

    `source` is the file of the flashinfer-python wheel that defines
    `qualname` (``Class.method`` or a function name).
    """

    qualname: str
    source: str
    keywords: tuple[str, ...]


MLA_WRAPPER_INIT = FlashInferCall(
    "BatchMLAPagedAttentionWrapper.__init__",
    "flashinfer/mla/_batch_mla/_wrapper.py",
    ("float_workspace_buffer", "use_cuda_graph", "qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "backend"),
)
MLA_PLAN_METADATA_CSR = FlashInferCall(
    "MLAPlanMetadata.csr",
    "flashinfer/mla/_batch_mla/_contracts.py",
    ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"),
)
MLA_WRAPPER_PLAN = FlashInferCall(
    "BatchMLAPagedAttentionWrapper.plan",
    "flashinfer/mla/_batch_mla/_wrapper.py",
    (
        "metadata",
        "num_heads",
        "head_dim_ckv",
        "head_dim_kpe",
        "page_size",
        "causal",
        "sm_scale",
        "q_data_type",
        "kv_data_type",
        "query_layout",
        "kv_cache_layout",
        "lse_mode",
    ),
)
MLA_WRAPPER_RUN = FlashInferCall(
    "BatchMLAPagedAttentionWrapper.run",
    "flashinfer/mla/_batch_mla/_wrapper.py",
    ("query", "kv_cache", "return_lse", "return_lse_base_on_e", "ckv_scale", "kpe_scale"),
)
RAGGED_WRAPPER_INIT = FlashInferCall(
    "BatchPrefillWithRaggedKVCacheWrapper.__init__",
    "flashinfer/prefill.py",
    ("float_workspace_buffer", "kv_layout", "backend"),
)
RAGGED_WRAPPER_PLAN = FlashInferCall(
    "BatchPrefillWithRaggedKVCacheWrapper.plan",
    "flashinfer/prefill.py",
    (
        "qo_indptr",
        "kv_indptr",
        "num_qo_heads",
        "num_kv_heads",
        "head_dim_qk",
        "head_dim_vo",
        "causal",
        "sm_scale",
        "q_data_type",
        "kv_data_type",
    ),
)
RAGGED_WRAPPER_RUN = FlashInferCall(
    "BatchPrefillWithRaggedKVCacheWrapper.run",
    "flashinfer/prefill.py",
    ("q", "k", "v", "out", "return_lse", "lse_base", "lse_layout"),
)
FLASHINFER_CALLS: tuple[FlashInferCall, ...] = (
    MLA_WRAPPER_INIT,
    MLA_PLAN_METADATA_CSR,
    MLA_WRAPPER_PLAN,
    MLA_WRAPPER_RUN,
    RAGGED_WRAPPER_INIT,
    RAGGED_WRAPPER_PLAN,
    RAGGED_WRAPPER_RUN,
)

# What FlashInfer 0.7.2's FA2/FA3 MLA kernels accept
# (flashinfer/mla/_batch_mla/_backends/_fa_common.py, _validate_generated_fa_plan).
MLA_QUERY_DTYPES = (torch.float16, torch.bfloat16)
MLA_FP8_KV_DTYPE = torch.float8_e4m3fn
MLA_CKV_MULTIPLE = 128
MLA_KPE_MULTIPLE = 64
MLA_FA3_CKV = (128, 256, 512)
# The FP8 MLA kernel is Hopper-only, for a bf16 query and the 512 / 64 split.
MLA_FP8_CAPABILITY_MAJOR = 9
MLA_FP8_DIMS = (512, 64)
# Multi-token decode is causal; FlashInfer's scheduler cuts query rows in tiles
# of 64 or 128 (token, head) rows and rejects a tile that ends inside a
# token's heads at a KV-tile boundary, so the head count must divide 128.
MLA_MULTI_TOKEN_HEADS_DIVIDE = 128
# Ragged prefill: FA2 on sm_80+, FA3 on sm_90; qk / v head dims up to 256.
MAX_PREFILL_HEAD_DIM = 256


# --------------------------------------------------------------------------- probing


@dataclasses.dataclass(frozen=True)
class FlashInferProbe:
    """The installed FlashInfer: version and why it cannot be used (None when it can)."""

    version: str | None
    error: str | None
    kernels: str | None  # how kernels are obtained: "nvcc at <path>" or "flashinfer-jit-cache"


def _version_tuple(version: str) -> tuple:
    from packaging.version import InvalidVersion, Version

    try:
        return (Version(version),)
    except InvalidVersion:
        return ()


def _nvcc_path() -> str | None:
    """The nvcc FlashInfer's JIT would use: $CUDA_HOME / $CUDA_PATH, nvcc on PATH, /usr/local/cuda."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home:
            candidate = os.path.join(home, "bin", "nvcc")
            return candidate if os.path.exists(candidate) else None
    found = shutil.which("nvcc")
    if found:
        return found
    candidate = "/usr/local/cuda/bin/nvcc"
    return candidate if os.path.exists(candidate) else None


@functools.lru_cache(maxsize=1)
def probe_flashinfer() -> FlashInferProbe:
    """Probe the installed FlashInfer once. Never raises."""
    try:
        version = importlib.metadata.version("flashinfer-python")
    except Exception:
        version = None
    try:
        module = importlib.import_module("flashinfer")
        importlib.import_module("flashinfer.mla")
    except Exception as error:  # a wheel built for another torch may raise anything
        if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "flashinfer":
            return FlashInferProbe(version, "flashinfer is not installed (pip install 'mla-multi[flashinfer]')", None)
        return FlashInferProbe(version, f"import flashinfer failed: {type(error).__name__}: {error}", None)
    version = version or getattr(module, "__version__", None)
    if version is None or _version_tuple(version) < _version_tuple(MIN_FLASHINFER_VERSION):
        return FlashInferProbe(
            version, f"flashinfer {version} is older than {MIN_FLASHINFER_VERSION}, the oldest release with this MLA API", None
        )
    for attribute in ("BatchPrefillWithRaggedKVCacheWrapper",):
        if not hasattr(module, attribute):
            return FlashInferProbe(version, f"flashinfer {version} has no {attribute}", None)
    mla = importlib.import_module("flashinfer.mla")
    for attribute in ("BatchMLAPagedAttentionWrapper", "MLAPlanMetadata"):
        if not hasattr(mla, attribute):
            return FlashInferProbe(version, f"flashinfer {version} has no flashinfer.mla.{attribute}", None)
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        kernels = "flashinfer-jit-cache (prebuilt)"
    else:
        nvcc = _nvcc_path()
        if nvcc is None:
            return FlashInferProbe(
                version,
                f"flashinfer {version} builds its kernels with nvcc at first use, and neither nvcc "
                "($CUDA_HOME, $CUDA_PATH, PATH, /usr/local/cuda) nor prebuilt kernels (flashinfer-jit-cache) are installed",
                None,
            )
        kernels = f"nvcc at {nvcc} (built at first use)"
    return FlashInferProbe(version, None, kernels)


def clear_probe_cache() -> None:
    """Forget the probe (tests that change the installed modules call this)."""
    probe_flashinfer.cache_clear()


def _capability_reasons(platform: Platform) -> list[str]:
    capability = platform.device_capability
    if capability is None:
        return [f"{platform.name} ({platform.arch}) reports no NVIDIA compute capability"]
    if capability < (8, 0):
        return [f"FlashInfer's MLA and ragged prefill kernels need sm_80 or newer; {platform.name} is {platform.arch}"]
    return []


class _FlashInferRequirements:
    """What both FlashInfer backends need: the library, a way to get kernels, an NVIDIA GPU of sm_80+."""

    vendors = frozenset({"cuda"})
    supported_dtypes = MLA_QUERY_DTYPES

    @classmethod
    def availability_reasons(cls) -> list[str]:
        probe = probe_flashinfer()
        return [probe.error] if probe.error else []

    @classmethod
    def platform_reasons(cls, platform: Platform) -> list[str]:
        return super().platform_reasons(platform) or _capability_reasons(platform)

    @classmethod
    def info(cls) -> dict[str, Any]:
        info = super().info()
        probe = probe_flashinfer()
        info.update(flashinfer=probe.version, kernels=probe.kernels)
        return info


# --------------------------------------------------------------------------- shared state

_decode_wrappers: dict[tuple, tuple] = {}
_own_float_workspaces: dict[torch.device, torch.Tensor] = {}  # only where a locked shared workspace is too small
_built: set[tuple] = set()
_lock = threading.Lock()

FLOAT_WORKSPACE_PURPOSE = "FlashInfer: float workspace of its wrappers"
_FLOAT_WORKSPACE_SPEC = ((FLOAT_WORKSPACE_BYTES,), torch.uint8)


def reserve_float_workspace(workspace_manager) -> None:
    """Reserve FlashInfer's float workspace in `workspace_manager` (the device's shared workspace): its kernels'
    split partials and temporaries live there only while a FlashInfer call runs, and nothing of the package's
    stays in the shared workspace across such a call, so the two share the bytes."""
    workspace_manager.reserve(
        _FLOAT_WORKSPACE_SPEC, purpose=FLOAT_WORKSPACE_PURPOSE,
        what="FlashInfer's recommended size, shared by every wrapper (decode and prefill) on the device",
    )


def float_workspace(device: torch.device, workspace_manager=None) -> torch.Tensor:
    """The float workspace of every FlashInfer wrapper on `device`: the first bytes of `workspace_manager`
    (default: the device's shared workspace), reserved there first. A wrapper keeps the view it was built
    with, so wrappers are rebuilt when the workspace's buffer is replaced (`_workspace_key`)."""
    from mla_multi.errors import canonical_device
    from mla_multi.workspace import WorkspaceLockedError, current_workspace_manager

    if workspace_manager is None:  # a functional call: the device's shared workspace
        device = canonical_device(device)
        workspace_manager = current_workspace_manager(device)
        try:
            reserve_float_workspace(workspace_manager)
        except WorkspaceLockedError:  # locked smaller by layers that never reserved it: a buffer of its own
            with _lock:
                return _own_float_workspaces.setdefault(
                    device, torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device))
    else:
        reserve_float_workspace(workspace_manager)
    (buffer,) = workspace_manager.get_simultaneous(_FLOAT_WORKSPACE_SPEC)
    return buffer


def _workspace_key(buffer: torch.Tensor) -> int:
    """What identifies the workspace buffer a wrapper was built with."""
    return buffer.untyped_storage().data_ptr()


def _timed_first_use(key: tuple, what: str, function, *args, **kwargs):
    """Run `function`; the first time `key` is seen, log how long it took (FlashInfer builds kernels then)."""
    if key in _built:
        return function(*args, **kwargs)
    start = time.perf_counter()
    result = function(*args, **kwargs)
    with _lock:
        first = key not in _built
        _built.add(key)
    if first:
        logger.info(
            "FLASHINFER %s: first plan took %.1f s (kernels built or loaded; `mla-multi warmup` does this ahead)",
            what, time.perf_counter() - start,
        )
    return result


def _host_int32(values: torch.Tensor) -> torch.Tensor:
    return values.to(device="cpu", dtype=torch.int32)


# --------------------------------------------------------------------------- decode


@dataclasses.dataclass
class FlashInferDecodePlan:
    """A planned decode batch: the wrapper to run and what the plan was made for.

    `empty_rows` [B] bool on the device marks requests with no token (their
    output is set to 0 and LSE to -inf, whatever the kernel wrote); None when
    the plan saw none and needs no fix-up.
    """

    wrapper: Any
    batch: int
    query_len: int
    seq_lens: torch.Tensor
    empty_rows: torch.Tensor | None
    k_scale: float | None
    cuda_graph: bool


def _seen(tensors) -> tuple:
    """What a plan made from `tensors` (None entries skipped) remembers of them: the objects, weakly, and
    their version counters."""
    return tuple((weakref.ref(t), t._version) for t in tensors if torch.is_tensor(t))


def _unchanged(seen: tuple | None, tensors) -> bool:
    """Whether `tensors` are the same objects, still alive and not modified in place since `_seen` saw them:
    the plan of a functional call is reused then (lengths written behind PyTorch's back, by a kernel through
    a raw pointer, are not seen: pass new tensors, or plan through MLAAttention.plan)."""
    tensors = [t for t in tensors if torch.is_tensor(t)]
    return (seen is not None and len(seen) == len(tensors)
            and all(ref() is t and version == t._version for (ref, version), t in zip(seen, tensors)))


class FlashInferDecodeImpl(MLADecodeImpl):
    """MLA decode through `BatchMLAPagedAttentionWrapper` (plan once per batch, run per layer)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_blocks: int | None = None
        self.workspace_manager = None  # the layer's (reserve_workspace); None: the device's shared workspace

    def plan_key(self) -> tuple:
        """Layers with equal keys share plans and wrappers."""
        return ("FLASHINFER", "decode", self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim,
                self.kv_cache_dtype, self.block_size, self.scale)

    def reserve_workspace(self, workspace_manager, max_num_seqs: int, max_model_len: int, max_query_len: int = 1,
                          dtype: torch.dtype | None = None) -> None:
        """Remember the worst case (CUDA-graph plans size their fixed page-index buffer from it) and reserve
        FlashInfer's float workspace in `workspace_manager`, which the wrappers then use."""
        self.max_blocks = -(-max_model_len // self.block_size)
        self.workspace_manager = workspace_manager  # None: the device's shared one, when a wrapper is made
        if workspace_manager is not None:
            reserve_float_workspace(workspace_manager)

    def _wrapper(self, device: torch.device, batch: int, query_len: int, cuda_graph: bool, num_pages: int, slot: int):
        """(wrapper, fixed empty-row buffer or None, page capacity), shared by every layer of this configuration.

        One eager wrapper, re-planned per batch; one CUDA-graph wrapper per
        (batch, query_len), whose metadata buffers stay where a captured graph
        reads them.
        """
        import flashinfer.mla

        buffer = float_workspace(device, self.workspace_manager)
        workspace = _workspace_key(buffer)
        key = (device, self.plan_key(), (batch, query_len) if cuda_graph else None, slot, workspace)
        with _lock:
            found = _decode_wrappers.get(key)
            if found is None:  # a replaced workspace: wrappers of the old one go, and their hold on its bytes
                for stale in [k for k in _decode_wrappers if k[0] == device and k[-1] != workspace]:
                    del _decode_wrappers[stale]
        if found is not None and found[2] >= num_pages:
            return found
        if not cuda_graph:
            wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                float_workspace_buffer=buffer, use_cuda_graph=False,
                qo_indptr=None, kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto",
            )
            found = (wrapper, None, float("inf"))
        else:
            if found is not None:
                raise ValueError(
                    f"the CUDA-graph plan for {batch} requests holds {found[2]} pages; "
                    f"this batch needs {num_pages} (reserve the workspace for a larger max_model_len)"
                )
            capacity = max(num_pages, batch * (self.max_blocks or 0), 1)
            wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                float_workspace_buffer=buffer,
                use_cuda_graph=True,
                qo_indptr=torch.empty(batch + 1, dtype=torch.int32, device=device),
                kv_indptr=torch.empty(batch + 1, dtype=torch.int32, device=device),
                kv_indices=torch.empty(capacity, dtype=torch.int32, device=device),
                kv_len_arr=torch.empty(batch, dtype=torch.int32, device=device),
                backend="auto",
            )
            found = (wrapper, torch.zeros(batch, dtype=torch.bool, device=device), capacity)
        with _lock:
            _decode_wrappers[key] = found
        return found

    def plan(
        self,
        seq_lens_cpu: torch.Tensor,
        block_table: torch.Tensor,
        query_len: int = 1,
        *,
        k_scale=None,
        cuda_graph: bool = False,
        slot: int = 0,
    ) -> FlashInferDecodePlan:
        """Plan one decode batch on the host.

        seq_lens_cpu [B] int (host copy of the lengths, new tokens included);
        block_table [B, max_blocks] int32 on the device; query_len tokens per
        request. `cuda_graph=True` plans into fixed buffers of this batch
        size, so that a graph captured after the plan replays correctly after
        re-planning with new lengths and block tables. Plans of the same
        configuration share a wrapper per `slot`: plans that must stay valid
        at the same time (several captured graphs of one batch size) take
        different slots.
        """
        import flashinfer.mla

        device = block_table.device
        seq_lens_cpu = _host_int32(seq_lens_cpu)
        batch = seq_lens_cpu.numel()
        if batch == 0:
            raise ValueError("FLASHINFER decode cannot plan an empty batch; accepted: at least one request")
        pages = (seq_lens_cpu.long() + self.block_size - 1) // self.block_size
        if int(pages.max()) > block_table.shape[1]:
            raise ValueError(
                f"seq_lens need up to {int(pages.max())} blocks; block_table has {block_table.shape[1]} per row"
            )
        kv_indptr = torch.zeros(batch + 1, dtype=torch.int32)
        kv_indptr[1:] = pages.cumsum(0).to(torch.int32)
        num_pages = int(kv_indptr[-1])
        # The live pages of every row, gathered on the device with host-built
        # indices: no device-to-host copy of the block table.
        rows = torch.repeat_interleave(torch.arange(batch), pages)
        columns = torch.arange(num_pages) - kv_indptr[:-1].long()[rows]
        kv_indices = block_table[to_device(rows, device), to_device(columns, device)]
        if kv_indices.dtype != torch.int32:
            kv_indices = kv_indices.to(torch.int32)
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * query_len
        wrapper, empty_buffer, _ = self._wrapper(device, batch, query_len, cuda_graph, num_pages, slot)
        q_dtype = self._query_dtype
        metadata = flashinfer.mla.MLAPlanMetadata.csr(
            qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=seq_lens_cpu
        )
        _timed_first_use(
            self.plan_key() + (q_dtype,), f"decode {self.num_heads} heads {dtype_name(self.kv_cache_dtype)} cache",
            wrapper.plan,
            metadata=metadata,
            num_heads=self.num_heads,
            head_dim_ckv=self.kv_lora_rank,
            head_dim_kpe=self.qk_rope_head_dim,
            page_size=self.block_size,
            causal=query_len > 1,
            sm_scale=self.scale,
            q_data_type=q_dtype,
            kv_data_type=self.kv_cache_dtype,
            query_layout="split",
            kv_cache_layout="packed",
            lse_mode="basee",
        )
        empty = seq_lens_cpu == 0
        if empty_buffer is not None:
            empty_rows = empty_buffer.copy_(pinned(empty), non_blocking=True)
        else:
            empty_rows = to_device(empty, device) if bool(empty.any()) else None
        scale = None
        if k_scale is not None:
            scale = float(k_scale.item() if torch.is_tensor(k_scale) else k_scale)
        return FlashInferDecodePlan(wrapper, batch, query_len, seq_lens_cpu, empty_rows, scale, cuda_graph)

    @property
    def _query_dtype(self) -> torch.dtype:
        # The query dtype is the model's; an FP8 cache is paired with bf16 queries.
        if self.kv_cache_dtype in MLA_QUERY_DTYPES:
            return self.kv_cache_dtype
        return torch.bfloat16

    def forward_mqa(self, q_nope, q_pe, kv_cache, block_table, seq_lens, *, k_scale=None, num_kv_splits=None,
                    workspace_manager=None, max_seq_len: int | None = None, plan: FlashInferDecodePlan | None = None):
        """Decode through a plan (made here from the device lengths when none is given).

        q_nope [B, (Q,) N, Lkv], q_pe [B, (Q,) N, R]; kv_cache [num_blocks,
        block_size, Lkv + R]; returns out with q_nope's shape and lse [B, (Q,) N]
        float32 (natural log). num_kv_splits is FlashInfer's to choose and is ignored.
        """
        batch = q_nope.shape[0]
        query_len = q_nope.shape[1] if q_nope.dim() == 4 else 1
        if q_nope.dtype != self._query_dtype:
            raise ValueError(
                f"q_nope has dtype {dtype_name(q_nope.dtype)}; FLASHINFER with a {dtype_name(self.kv_cache_dtype)} "
                f"cache takes {dtype_name(self._query_dtype)} queries"
            )
        if plan is None:
            # a functional call: the last plan while the same length tensors come back unchanged
            last = getattr(self, "_planned_for", None)
            if last is not None and last[1] == query_len and _unchanged(last[0], (seq_lens, block_table, k_scale)):
                plan = last[2]
            else:
                if capturing(q_nope):
                    raise RuntimeError(
                        "FLASHINFER decode needs a plan made before CUDA-graph capture "
                        "(MLAAttention.plan(metadata, cuda_graph=True))"
                    )
                plan = self.plan(seq_lens.cpu(), block_table, query_len, k_scale=k_scale)
                self._planned_for = (_seen((seq_lens, block_table, k_scale)), query_len, plan)
        if (plan.batch, plan.query_len) != (batch, query_len):
            raise ValueError(
                f"the FLASHINFER plan is for {plan.batch} requests of {plan.query_len} tokens; "
                f"q_nope has {batch} of {query_len}"
            )
        # [B, N, D] queries are FlashInfer's [tokens, N, D] as they are (its outputs too)
        single = q_nope.dim() == 3
        if single:
            query = (q_nope, q_pe)
        else:
            tokens = batch * query_len
            query = (q_nope.reshape(tokens, self.num_heads, -1), q_pe.reshape(tokens, self.num_heads, -1))
        scales = {}
        if self.kv_cache_dtype == MLA_FP8_KV_DTYPE:
            scale = plan.k_scale if plan.k_scale is not None else float(k_scale)
            scales = {"ckv_scale": scale, "kpe_scale": scale}
        out, lse = plan.wrapper.run(
            query=query, kv_cache=kv_cache, return_lse=True, return_lse_base_on_e=True, **scales
        )
        if not single:
            out = out.view(q_nope.shape)
            lse = lse.view(q_nope.shape[:-1])
        if plan.empty_rows is not None:
            empty = plan.empty_rows.view(batch, *([1] * (lse.dim() - 1)))
            out = out.masked_fill(empty.unsqueeze(-1), 0)
            lse = lse.masked_fill(empty, float("-inf"))
        return out, lse


class FlashInferDecodeBackend(_FlashInferRequirements, MLADecodeBackend):
    """FlashInfer's MLA paged decode (FA3 on sm_90, FA2 on sm_80+)."""

    name: ClassVar[str] = "FLASHINFER"
    supported_kv_cache_dtypes = (torch.float16, torch.bfloat16, MLA_FP8_KV_DTYPE)
    max_num_heads = 128
    max_query_len = 8
    supports_cuda_graphs = True
    requires_plan: ClassVar[bool] = True

    @staticmethod
    def get_decode_impl_cls():
        return FlashInferDecodeImpl

    @classmethod
    def validate_configuration(cls, platform: Platform, config: DecodeSelectorConfig) -> list[str]:
        """Reasons FlashInfer's MLA decode cannot run `config` on `platform` (from its 0.7.2 source)."""
        reasons = super().validate_configuration(platform, config)
        dims = config.dims
        ckv, kpe = dims.kv_lora_rank, dims.qk_rope_head_dim
        if ckv % MLA_CKV_MULTIPLE or kpe % MLA_KPE_MULTIPLE:
            reasons.append(
                f"kv_lora_rank {ckv} / qk_rope_head_dim {kpe}; FlashInfer needs multiples of "
                f"{MLA_CKV_MULTIPLE} / {MLA_KPE_MULTIPLE}"
            )
        elif platform.device_capability == (9, 0) and ckv not in MLA_FA3_CKV:
            reasons.append(f"kv_lora_rank {ckv}; FlashInfer's sm_90 MLA kernel takes {', '.join(map(str, MLA_FA3_CKV))}")
        kv = config.kv_cache_dtype
        if kv == MLA_FP8_KV_DTYPE:
            capability = platform.device_capability
            if capability is not None and capability[0] != MLA_FP8_CAPABILITY_MAJOR:
                reasons.append(f"an FP8 cache needs FlashInfer's sm_90 MLA kernel; {platform.name} is {platform.arch}")
            if config.dtype != torch.bfloat16:
                reasons.append(f"an FP8 cache needs bfloat16 queries; got {dtype_name(config.dtype)}")
            if (ckv, kpe) != MLA_FP8_DIMS:
                reasons.append(f"an FP8 cache needs kv_lora_rank / qk_rope_head_dim {MLA_FP8_DIMS[0]} / {MLA_FP8_DIMS[1]}")
        elif kv in cls.supported_kv_cache_dtypes and kv != config.dtype:
            reasons.append(
                f"kv_cache_dtype {dtype_name(kv)} differs from the query dtype {dtype_name(config.dtype)}; "
                "FlashInfer takes equal dtypes (or an FP8 cache)"
            )
        if config.max_query_len > 1 and MLA_MULTI_TOKEN_HEADS_DIVIDE % dims.num_heads:
            reasons.append(
                f"multi-token decode with {dims.num_heads} heads: FlashInfer's causal tiles need a head count "
                f"dividing {MLA_MULTI_TOKEN_HEADS_DIVIDE}"
            )
        return reasons


# --------------------------------------------------------------------------- prefill


@dataclasses.dataclass
class FlashInferPrefillPlan:
    """Ragged-prefill wrappers planned for one batch: the new tokens (causal) and each context chunk."""

    new_tokens: Any
    context_chunks: list[Any]


class FlashInferPrefillImpl(MLAPrefillImpl):
    """Varlen prefill through `BatchPrefillWithRaggedKVCacheWrapper` (qk 192 / v 128)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pool: list[Any] = []
        self._pool_workspace: int | None = None  # the workspace buffer the pool's wrappers were built with
        self.workspace_manager = None  # the layer's (reserve_workspace); None: the device's shared workspace

    def reserve_workspace(self, workspace_manager) -> None:
        """Reserve FlashInfer's float workspace in `workspace_manager`, which the wrappers then use."""
        self.workspace_manager = workspace_manager  # None: the device's shared one, when a wrapper is made
        if workspace_manager is not None:
            reserve_float_workspace(workspace_manager)

    def plan_key(self) -> tuple:
        return ("FLASHINFER", "prefill", self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim,
                self.v_head_dim, self.scale)

    def _wrappers(self, count: int, device: torch.device) -> list[Any]:
        import flashinfer

        buffer = float_workspace(device, self.workspace_manager)
        if self._pool_workspace != _workspace_key(buffer):  # a replaced workspace: new wrappers over it
            self._pool, self._pool_workspace = [], _workspace_key(buffer)
        while len(self._pool) < count:
            self._pool.append(
                flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                    float_workspace_buffer=buffer, kv_layout="NHD", backend="auto"
                )
            )
        return self._pool[:count]

    def _plan_one(self, wrapper, cu_q_cpu: torch.Tensor, cu_k_cpu: torch.Tensor, causal: bool, dtype: torch.dtype):
        head_dim_qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        _timed_first_use(
            self.plan_key() + (dtype, causal), f"prefill {self.num_heads} heads",
            wrapper.plan,
            qo_indptr=_host_int32(cu_q_cpu),
            kv_indptr=_host_int32(cu_k_cpu),
            num_qo_heads=self.num_heads,
            num_kv_heads=self.num_heads,
            head_dim_qk=head_dim_qk,
            head_dim_vo=self.v_head_dim,
            causal=causal,
            sm_scale=self.scale,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        return wrapper

    def plan(self, prefill_metadata, dtype: torch.dtype) -> FlashInferPrefillPlan:
        """Plan the new tokens and every context chunk of `prefill_metadata` (host copies only)."""
        cu_q = prefill_metadata.query_start_loc_cpu
        if cu_q is None:  # metadata built by hand (a copy to the host: it waits for the device)
            cu_q = prefill_metadata.query_start_loc.cpu()
        chunked = prefill_metadata.chunked_context
        num_chunks = chunked.num_chunks if chunked is not None else 0
        device = prefill_metadata.query_start_loc.device
        # chunks of the same lengths share one plan: FlashInfer's plan is host work in proportion to heads x
        # query tiles (about 1 ms at 128 heads x 8192 rows on an H200), and full chunks repeat their lengths
        chunk_lengths = [tuple(row) for row in chunked.seq_lens_cpu.tolist()] if num_chunks else []
        distinct: dict[tuple[int, ...], int] = {}
        for lengths in chunk_lengths:
            distinct.setdefault(lengths, len(distinct))
        wrappers = self._wrappers(1 + len(distinct), device)
        new_tokens = self._plan_one(wrappers[0], cu_q, cu_q, True, dtype)
        planned = []
        for lengths in distinct:
            cu_k = torch.zeros(len(lengths) + 1, dtype=torch.int64)
            cu_k[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
            planned.append(self._plan_one(wrappers[1 + len(planned)], cu_q, cu_k, False, dtype))
        chunks = [planned[distinct[lengths]] for lengths in chunk_lengths]
        return FlashInferPrefillPlan(new_tokens, chunks)

    takes_out = True  # the new tokens' result written into a given buffer (FlashInfer's `out=`)

    @staticmethod
    def _run(wrapper, q, k, v, return_lse: bool, out=None):
        if not return_lse:
            return wrapper.run(q=q, k=k, v=v, out=out, return_lse=False, lse_base="ln", lse_layout="HN")
        out, lse = wrapper.run(q=q, k=k, v=v, out=out, return_lse=True, lse_base="ln", lse_layout="HN")
        return out, _normalise_lse(lse)

    def forward_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, return_softmax_lse,
                       out=None):
        (wrapper,) = self._wrappers(1, q.device)
        # a loop of calls over one batch plans once (`_unchanged`)
        last = getattr(self, "_planned_for", None)
        planned = (q.shape[0], k.shape[0], bool(causal), q.dtype, self.scale)
        if last is None or last[1] != planned or not _unchanged(last[0], (cu_seqlens_q, cu_seqlens_k)):
            self._plan_one(wrapper, cu_seqlens_q.cpu(), cu_seqlens_k.cpu(), causal, q.dtype)
            self._planned_for = (_seen((cu_seqlens_q, cu_seqlens_k)), planned)
        return self._run(wrapper, q, k, v.contiguous(), return_softmax_lse, out)

    def _planned(self, prefill_metadata, dtype: torch.dtype) -> FlashInferPrefillPlan | None:
        return getattr(prefill_metadata, "backend_plans", {}).get(self.plan_key() + (dtype,))

    def run_prefill_new_tokens(self, prefill_metadata, q, k, v, return_softmax_lse: bool, out=None):
        plan = self._planned(prefill_metadata, q.dtype)
        if plan is None:
            return super().run_prefill_new_tokens(prefill_metadata, q, k, v, return_softmax_lse, out=out)
        return self._run(plan.new_tokens, q, k, v, return_softmax_lse, out)

    def run_prefill_context_chunk(self, prefill_metadata, chunk_idx: int, q, k, v):
        plan = self._planned(prefill_metadata, q.dtype)
        if plan is None:
            return super().run_prefill_context_chunk(prefill_metadata, chunk_idx, q, k, v)
        return self._run(plan.context_chunks[chunk_idx], q, k, v, True)


def _normalise_lse(lse: torch.Tensor) -> torch.Tensor:
    """[N, T] float32 natural-log LSE; rows with no key (+inf or NaN in some kernels) become -inf."""
    lse = lse.float()
    return torch.where(torch.isfinite(lse) | (lse == float("-inf")), lse, torch.full((), float("-inf"), device=lse.device))


class FlashInferPrefillBackend(_FlashInferRequirements, MLAPrefillBackend):
    """FlashInfer's ragged prefill (FA3 on sm_90, FA2 on sm_80+) with qk 192 / v 128 and LSE."""

    name: ClassVar[str] = "FLASHINFER"
    requires_plan: ClassVar[bool] = True

    @staticmethod
    def get_prefill_impl_cls():
        return FlashInferPrefillImpl

    @classmethod
    def validate_configuration(cls, platform: Platform, config: PrefillSelectorConfig) -> list[str]:
        reasons = super().validate_configuration(platform, config)
        dims = config.dims
        if dims.qk_head_dim > MAX_PREFILL_HEAD_DIM or dims.v_head_dim > MAX_PREFILL_HEAD_DIM:
            reasons.append(
                f"head dims qk {dims.qk_head_dim} / v {dims.v_head_dim}; FlashInfer's ragged prefill takes up to "
                f"{MAX_PREFILL_HEAD_DIM}"
            )
        return reasons


__all__ = [
    "FLASHINFER_CALLS",
    "FlashInferCall",
    "FlashInferDecodeBackend",
    "FlashInferDecodeImpl",
    "FlashInferDecodePlan",
    "FlashInferPrefillBackend",
    "FlashInferPrefillImpl",
    "FlashInferPrefillPlan",
    "clear_probe_cache",
    "probe_flashinfer",
]
