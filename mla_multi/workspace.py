"""One reusable device buffer for the scratch tensors of attention, shared by every layer of a device.

`get_simultaneous((shape, dtype), ...)` hands out views of a single byte
buffer, laid out one after the other; they are valid until the next call.
`reserve(...)` sizes the buffer for the worst case ahead of time (vLLM's Triton
MLA builder reserves ``(max_num_seqs, num_heads, max_num_kv_splits,
kv_lora_rank + 1)`` float32 for split-KV logits) and `lock()` forbids growth,
so a forward captured in a CUDA graph never allocates: a request that would
grow a locked workspace raises `WorkspaceLockedError` naming the sizes.

Layers run one after another on a stream, so the scratch of 61 layers is the
scratch of one: `current_workspace_manager(device)` is the one manager of a
device (after vLLM's ``current_workspace_manager()``), created on first use,
which every `MLAAttention` and every functional op of that device reserves
into and slices; `set_workspace_manager` installs one of the user's (for
example one per stream, for layers that run concurrently on several streams).
Reservations grow the buffer to the largest of them, never to their sum, and
each is kept under its purpose so that `describe()` can say what the buffer
holds and why.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from mla_multi.errors import canonical_device
from mla_multi.kernels import capturing_on

_ALIGNMENT = 256  # bytes; keeps every view aligned for vector loads

TensorSpec = tuple[Sequence[int], torch.dtype]


class WorkspaceLockedError(RuntimeError):
    """A locked workspace was asked for more bytes than it holds."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def _spec_bytes(spec: TensorSpec) -> int:
    shape, dtype = spec
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"workspace spec dtype={dtype!r}; accepted: a torch.dtype")
    if any((not isinstance(d, int)) or d < 0 for d in shape):
        raise ValueError(f"workspace spec shape={tuple(shape)!r}; accepted: non-negative ints")
    return math.prod(shape) * dtype.itemsize


class WorkspaceManager:
    """A growable, lockable scratch buffer on one device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._locked = False
        # purpose -> (bytes, what): the largest reservation made for each purpose
        self.reservations: dict[str, tuple[int, str]] = {}
        # specs -> the views `get_simultaneous` made of the current buffer (dropped when it is replaced)
        self._views: dict[tuple, tuple[torch.Tensor, ...]] = {}
        # buffers kept beside the scratch for as long as the manager lives, shared in stream order by the layers
        # that share it, each while one launch writes it and the next reads it (`kernels.absorb.absorbed_queries`)
        self.side: dict = {}

    @property
    def size_bytes(self) -> int:
        return self._buffer.numel()

    @property
    def is_locked(self) -> bool:
        return self._locked

    @staticmethod
    def required_bytes(*specs: TensorSpec) -> int:
        """Bytes that `get_simultaneous(*specs)` needs, alignment included."""
        return sum(_aligned(_spec_bytes(spec)) for spec in specs)

    def reserve(self, *specs: TensorSpec, purpose: str | None = None, what: str = "") -> None:
        """Grow (never shrink) so that `get_simultaneous(*specs)` fits; raises when locked and too small.

        `purpose` names the reservation for `describe()` (e.g. "decode: TRITON
        split-KV partials, output, LSE"); `what` says how it was sized.
        """
        nbytes = self.required_bytes(*specs)
        self._ensure(nbytes)
        if purpose is not None and nbytes >= self.reservations.get(purpose, (0, ""))[0]:
            self.reservations[purpose] = (nbytes, what)

    def describe(self) -> list[tuple[str, int, str]]:
        """(purpose, bytes, how it was sized) of every reservation, largest first; the buffer holds the largest."""
        return sorted(((p, b, w) for p, (b, w) in self.reservations.items()), key=lambda row: -row[1])

    def get_simultaneous(self, *specs: TensorSpec) -> list[torch.Tensor]:
        """Views [shape] of `dtype`, one per spec, that do not overlap each other.

        Their contents are undefined; they alias the views of any earlier call (the same specs get the same
        view objects back until the buffer is replaced: a call in a hot path makes no tensors).
        """
        key = tuple((tuple(shape), dtype) for shape, dtype in specs)
        views = self._views.get(key)
        if views is not None:
            return list(views)
        self._ensure(self.required_bytes(*specs))
        views = []
        offset = 0
        for shape, dtype in specs:
            nbytes = _spec_bytes((shape, dtype))
            views.append(self._buffer[offset : offset + nbytes].view(dtype).view(tuple(shape)))
            offset += _aligned(nbytes)
        if len(self._views) >= 256:
            self._views.clear()
        self._views[key] = tuple(views)
        return views

    def lock(self) -> None:
        """Forbid growth from now on (before capturing CUDA graphs)."""
        self._locked = True

    def unlock(self) -> None:
        self._locked = False

    def _ensure(self, nbytes: int) -> None:
        if nbytes <= self._buffer.numel():
            return
        if capturing_on(self.device):
            # growing inside a capture would allocate in the graph's pool and leave earlier views dangling
            raise WorkspaceLockedError(
                f"the workspace of {self.device} holds {self._buffer.numel()} bytes and {nbytes} bytes were "
                "requested while a CUDA graph is being captured; reserve() the worst case (and lock()) before capturing"
            )
        if self._locked:
            raise WorkspaceLockedError(
                f"the workspace is locked at {self._buffer.numel()} bytes and {nbytes} bytes were "
                "requested; reserve() the worst case before lock()"
            )
        self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._views.clear()


_MANAGERS: dict[torch.device, WorkspaceManager] = {}
_MANAGERS_LOCK = threading.Lock()


def current_workspace_manager(device: torch.device | str | None = None) -> WorkspaceManager:
    """The workspace every layer and functional op on `device` shares (created, empty, on first use).

    `device` None means the current CUDA device where there is one, else the CPU.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    key = canonical_device(device)
    manager = _MANAGERS.get(key)
    if manager is None:
        with _MANAGERS_LOCK:
            manager = _MANAGERS.get(key)
            if manager is None:
                manager = _MANAGERS[key] = WorkspaceManager(key)
    return manager


def still_shared(manager: WorkspaceManager | None, buffer: torch.Tensor | None, key: torch.device) -> bool:
    """Whether views that `manager`, the shared workspace of device `key` (`canonical_device`) when they were
    taken, made of `buffer` are still views of the device's shared workspace: it is still `manager` and holds
    `buffer` still (no growth since). One dictionary lookup, for callers that keep such views across calls (by
    weak reference: a None, from a reference that died, is never still shared)."""
    return manager is not None and _MANAGERS.get(key) is manager and manager._buffer is buffer


def set_workspace_manager(manager: WorkspaceManager | None, device: torch.device | str | None = None) -> None:
    """Make `manager` the shared workspace of its device (or of `device`); None forgets the device's one.

    Layers built afterwards reserve into it; layers built before keep the
    manager they were given.
    """
    if manager is not None and not isinstance(manager, WorkspaceManager):
        raise ValueError(f"manager={manager!r}; accepted: a WorkspaceManager or None")
    if device is None:
        if manager is None:
            raise ValueError("set_workspace_manager(None) needs the device whose workspace to forget")
        device = manager.device
    key = canonical_device(device)
    with _MANAGERS_LOCK:
        if manager is None:
            _MANAGERS.pop(key, None)
        else:
            _MANAGERS[key] = manager
