"""Launching a compiled Triton (or Gluon) kernel without Triton's per-call Python work.

`kernel[grid](*args, **constexprs)` binds the arguments, computes their
specialisation (pointer alignment, integers equal to 1 or divisible by 16),
looks the compiled kernel up and only then launches: 20-40 µs of Python per
launch on a current host, more than a decode kernel of a small batch runs.
A `BoundLaunch` pays that once: its first call goes through Triton and keeps
the compiled kernel and its launcher; later calls hand the new runtime
arguments straight to the launcher.

That is only valid while the arguments keep the specialisation of the first
call, so a bound launch belongs to a plan whose key covers it: the shapes,
strides and dtypes of every tensor (hence every integer argument derived from
them) and the 16-byte alignment of every pointer (`alignment_key`).

The direct path relies on how `JITFunction.run` calls the launcher
(``kernel.run(grid_0, grid_1, grid_2, stream, kernel.function,
kernel.packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args)``),
which is the same from Triton 3.3 to 3.9. `direct_launch_reason()` checks that
contract in the installed Triton's own source once; where it does not hold,
or while a launch hook is installed (a profiler), every call goes through
Triton as before.

Where the launcher object only passes its arguments on to its C launch
(``self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
self.launch_pdl, global_scratch, profile_scratch, *args)``, Triton 3.3-3.6's
`CudaLauncher.__call__`) and the kernel takes no scratch memory, a bound launch
calls that C launch itself (`_launch_head`): the launcher's Python (two scratch
allocations of nothing and the call) is 1-3 µs of every launch on a current host.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["BoundLaunch", "alignment_key", "direct_launch_reason", "layout_key", "pdl_constexprs", "pdl_enter"]

_LAUNCH_CALL = (
    "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,"
)


@functools.lru_cache(maxsize=1)
def direct_launch_reason() -> str:
    """Why compiled kernels cannot be launched directly with this Triton ("" when they can)."""
    try:
        from triton.runtime import jit

        source = inspect.getsource(jit.JITFunction.run)
    except Exception as error:  # any failure means: go through Triton
        return f"the installed Triton's JITFunction.run cannot be read ({type(error).__name__}: {error})"
    if " ".join(_LAUNCH_CALL.split()) not in " ".join(source.split()):
        return "the installed Triton's JITFunction.run launches differently from Triton 3.3-3.9"
    return ""


_LAUNCHER_CALL = (
    "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,"
    " global_scratch, profile_scratch, *args)"
)


@functools.lru_cache(maxsize=8)
def _passes_arguments_on(launcher_type: type) -> bool:
    """Whether `launcher_type.__call__` hands its arguments to `self.launch` as Triton 3.3-3.6's CudaLauncher
    does, scratch memory aside (`_LAUNCHER_CALL`)."""
    try:
        source = inspect.getsource(launcher_type.__call__)
    except Exception:  # noqa: BLE001 - unreadable: call the launcher
        return False
    return " ".join(_LAUNCHER_CALL.split()) in " ".join(source.split())


def _launch_head(launcher, metadata) -> tuple:
    """(what to call, the arguments between the function and the kernel's own) of a compiled kernel's
    `launcher`: its C launch with the launch flags, no scratch and no hooks where the launcher only passes its
    arguments on (`_passes_arguments_on`) and the kernel takes no scratch memory; else the launcher with the
    kernel's metadata and no hooks."""
    launch = getattr(launcher, "launch", None)
    try:
        direct = (launch is not None and _passes_arguments_on(type(launcher))
                  and not launcher.global_scratch_size and not launcher.profile_scratch_size)
        if direct:
            return launch, (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, metadata, None, None,
                            None)
    except AttributeError:  # a launcher of another shape: call it
        pass
    return launcher, (metadata, None, None, None)


@functools.lru_cache(maxsize=1)
def _triton_has_gdc() -> bool:
    try:
        from triton.language.extra import cuda

        return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
    except Exception:  # noqa: BLE001 - no grid dependency control in this Triton
        return False


def pdl_constexprs(device: torch.device) -> dict[str, Any]:
    """The constexprs that launch a kernel taking `PDL` by programmatic dependent launch on `device`: NVIDIA
    sm_90 and later (not the interpreter), a Triton with grid dependency control, `MLA_MULTI_PDL` on. Such a
    kernel is let onto the device while the kernel before it on the stream finishes (its launch and prologue
    overlap that kernel's tail) and waits (`griddepcontrol.wait`, before it reads or writes any tensor) until
    that kernel has completed and its writes are visible; `{}` elsewhere (launched after the previous kernel
    ends, as any kernel)."""
    if device.type != "cuda" or not _triton_has_gdc():
        return {}
    from mla_multi import envs
    from mla_multi.kernels import interpreter_active
    from mla_multi.platforms import current_platform

    if interpreter_active() or not envs.MLA_MULTI_PDL:
        return {}
    platform = current_platform()
    if not (platform.is_cuda() and platform.has_device_capability(9, 0)):
        return {}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_enter():
    """A kernel launched by programmatic dependent launch (`pdl_constexprs`), first thing (``if PDL:
    pdl_enter()``): wait until the kernel before it has completed (its writes visible), then let the kernel
    after it onto the device."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=1)
def _runtime_knobs():
    from triton import knobs

    return knobs.runtime


def _hook_installed(hook) -> bool:
    # Triton >= 3.5 keeps hooks in a HookChain (its `calls` list is empty when nothing is installed)
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _hooks_installed(runtime) -> bool:
    return _hook_installed(runtime.launch_enter_hook) or _hook_installed(runtime.launch_exit_hook)


def launches_directly() -> bool:
    """Whether a bound `BoundLaunch` launches its kernel directly now (no Triton launch hook installed, as a
    profiler may install one): only then may it be given int addresses for pointer arguments."""
    return not _hooks_installed(_runtime_knobs())


def layout_key(tensor: torch.Tensor) -> tuple:
    """Shape, strides, dtype, device and 16-byte alignment of `tensor`: what a bound launch's validity and
    the checks made when it was planned depend on."""
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.data_ptr() % 16)


def alignment_key(*tensors: torch.Tensor | None) -> int:
    """One int whose bit i says whether tensor i's address is a multiple of 16 bytes (Triton's pointer
    specialisation); None counts as aligned."""
    bits = 0
    for i, tensor in enumerate(tensors):
        if tensor is not None and tensor.data_ptr() % 16:
            bits |= 1 << i
    return bits


class BoundLaunch:
    """One kernel, one grid and fixed constexprs, launched with new runtime arguments.

    The grid does not take part in the specialisation: an owner whose grid
    changes from call to call sets `grid` (three ints) before the call.

    `positional` runtime arguments fill the kernel's first parameters in
    order; `keyword_names` are further runtime parameters passed by name
    (e.g. TMA descriptors). The first `__call__` compiles (or finds) the
    kernel through Triton; later calls launch it directly on the current
    stream of `device`.
    """

    __slots__ = ("kernel", "grid", "constexprs", "keyword_names", "device_index", "_run", "_function",
                 "_head", "_tail", "_keyword_positions")

    def __init__(self, kernel, grid: tuple[int, ...], constexprs: dict[str, Any], device: torch.device,
                 keyword_names: tuple[str, ...] = ()) -> None:
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.constexprs = constexprs
        self.keyword_names = keyword_names
        self.device_index = device.index if device.type == "cuda" else None
        self._run = None

    def __call__(self, *args, **keywords) -> None:
        run = self._run
        runtime = _runtime_knobs() if run is not None else None
        if run is not None and not _hooks_installed(runtime):
            values = list(args)
            values += self._tail
            for name, position in self._keyword_positions:
                values[position] = keywords[name]
            stream = torch._C._cuda_getCurrentRawStream(self.device_index)
            g0, g1, g2 = self.grid
            # no hook installed: None for both, which the launcher skips (an empty HookChain is still called,
            # twice a launch)
            run(g0, g1, g2, stream, self._function, *self._head, *values)
            return
        compiled = self.kernel[self.grid](*args, **keywords, **self.constexprs)
        if run is None and self.device_index is not None and not direct_launch_reason():
            self._bind(compiled, args, keywords)

    @property
    def bound(self) -> bool:
        """Whether calls launch the kernel directly (made by the first call on a GPU), which takes an int
        address for a pointer argument as it is; Triton's own launch types an int as an integer."""
        return self._run is not None

    def _bind(self, compiled, args, keywords) -> None:
        try:
            device = self.device_index
            binder = self.kernel.device_caches[device][4]
            bound_args, _, _ = binder(*args, **keywords, **self.constexprs)
            names = list(bound_args)
            values = list(bound_args.values())
            if any(values[i] is not arg for i, arg in enumerate(args)):
                return
            tail = values[len(args):]
            positions = tuple((name, names.index(name)) for name in self.keyword_names)
            for name, position in positions:
                if position < len(args):
                    return
                tail[position - len(args)] = None
            run, head = _launch_head(compiled.run, compiled.packed_metadata)  # (`run` makes the launcher)
            self._function = compiled.function
            self._head = head
            self._tail = tail
            self._keyword_positions = positions
            self._run = run
        except Exception:  # noqa: BLE001 - keep launching through Triton
            self._run = None


# the bound launches of the kernels launched by layout outside an impl's plan (the sparse index lists, the
# V4 gathering): one bounded cache, keyed by kernel, grid and every layout and integer a launch depends on
_BY_LAYOUT: dict = {}
_BY_LAYOUT_MAX = 256


def bound_by_layout(kernel, grid: tuple[int, ...], constexprs: dict[str, Any], device: torch.device,
                    key: tuple, *, pdl: bool = True) -> BoundLaunch:
    """The `BoundLaunch` of `kernel` for `key` (every layout and integer its specialisation depends on), made
    once and kept in the bounded cache `_BY_LAYOUT`. A kernel launched so takes `PDL` (`pdl_enter`) unless
    `pdl` is False: made on a device that launches by programmatic dependent launch, it is launched so."""
    key = (kernel, grid) + key
    launch = _BY_LAYOUT.get(key)
    if launch is None:
        if len(_BY_LAYOUT) >= _BY_LAYOUT_MAX:
            _BY_LAYOUT.clear()
        if pdl:
            constexprs = {**constexprs, **pdl_constexprs(device)}
        launch = _BY_LAYOUT[key] = BoundLaunch(kernel, grid, constexprs, device)
    return launch
