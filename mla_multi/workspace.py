"""One reusable device buffer for the scratch tensors of attention.

`get_simultaneous((shape, dtype), ...)` hands out views of a single byte
buffer, laid out one after the other; they are valid until the next call.
`reserve(...)` sizes the buffer for the worst case ahead of time (vLLM's Triton
MLA builder reserves ``(max_num_seqs, num_heads, max_num_kv_splits,
kv_lora_rank + 1)`` float32 for split-KV logits) and `lock()` forbids growth,
so a forward captured in a CUDA graph never allocates: a request that would
grow a locked workspace raises `WorkspaceLockedError` naming the sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

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
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class WorkspaceManager:
    """A growable, lockable scratch buffer on one device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._locked = False

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

    def reserve(self, *specs: TensorSpec) -> None:
        """Grow (never shrink) so that `get_simultaneous(*specs)` fits; raises when locked and too small."""
        self._ensure(self.required_bytes(*specs))

    def get_simultaneous(self, *specs: TensorSpec) -> list[torch.Tensor]:
        """Views [shape] of `dtype`, one per spec, that do not overlap each other.

        Their contents are undefined; they alias the views of any earlier call.
        """
        self._ensure(self.required_bytes(*specs))
        views = []
        offset = 0
        for shape, dtype in specs:
            nbytes = _spec_bytes((shape, dtype))
            views.append(self._buffer[offset : offset + nbytes].view(dtype).view(tuple(shape)))
            offset += _aligned(nbytes)
        return views

    def lock(self) -> None:
        """Forbid growth from now on (before capturing CUDA graphs)."""
        self._locked = True

    def unlock(self) -> None:
        self._locked = False

    def _ensure(self, nbytes: int) -> None:
        if nbytes <= self._buffer.numel():
            return
        if self._locked:
            raise WorkspaceLockedError(
                f"the workspace is locked at {self._buffer.numel()} bytes and {nbytes} bytes were "
                "requested; reserve() the worst case before lock()"
            )
        self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
