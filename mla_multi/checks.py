"""Input checks shared by the public ops and `MLAAttention.forward`.

Shape, dtype and device checks run on the host from tensor metadata and never
synchronise the device.  Checks that read tensor data (indices inside the
cache) run when `MLA_MULTI_CHECK_INPUTS=1` (the test suite sets it) and always
on CPU tensors, where reading them costs no device synchronisation.  Without
them the kernels stay inside their tensors and record bad indices on the device
(`mla_multi.errors`); a call that runs the data checks reports those first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from mla_multi import envs, errors
from mla_multi.kernels import capturing_on

_CHECK_INPUTS = envs.ENV_VARS["MLA_MULTI_CHECK_INPUTS"]  # read on every forward: its variable, looked up once

INDEX_DTYPES = (torch.int32, torch.int64)


def describe(value) -> str:
    if torch.is_tensor(value):
        return f"tensor(shape={tuple(value.shape)}, dtype={str(value.dtype).replace('torch.', '')}, device={value.device})"
    return repr(value)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    value,
    *,
    ndim: int | Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    shape_from: str | None = None,
) -> torch.Tensor:
    """Raise ValueError naming `name` unless `value` is a tensor of the given rank/dtype/shape/device.

    `shape` entries of None are free; the last dimension must be contiguous. `shape_from` says which other
    arguments the expected shape comes from ("q_nope's 512 + q_pe's 64 columns"), so that a shape error
    names them too: the mistake may be theirs.
    """
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}={describe(value)}; accepted: a torch.Tensor")
    # written for speed: every layer's forward runs these on every call
    value_shape = value.shape
    dim = len(value_shape)
    if ndim is not None and (dim != ndim if isinstance(ndim, int) else dim not in ndim):
        ranks = (ndim,) if isinstance(ndim, int) else ndim
        source = f" ({shape_from})" if shape_from else ""
        raise ValueError(f"{name} has {dim} dims {tuple(value_shape)}; accepted: {' or '.join(map(str, ranks))} dims"
                         f"{source}")
    if dtypes is not None and value.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {str(value.dtype).replace('torch.', '')}; accepted: {_names(dtypes)}")
    if shape is not None:
        mismatch = len(shape) != dim
        if not mismatch:
            for expected_size, size in zip(shape, value_shape):
                if expected_size is not None and expected_size != size:
                    mismatch = True
                    break
        if mismatch:
            expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            source = f" ({shape_from})" if shape_from else ""
            raise ValueError(f"{name} has shape {list(value_shape)}; accepted: {expected}{source}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device}; all tensors must be on {device}")
    if dim > 0 and value_shape[-1] > 1 and value.stride(-1) != 1:
        raise ValueError(f"{name} has last-dimension stride {value.stride(-1)}; accepted: a contiguous last dimension (stride 1)")
    return value


def matches(value, shape: tuple, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `value` is a plain tensor of `shape` (a leading None: any first size), `dtype` and `device` with
    a contiguous last dimension: what `check_tensor` asks, in a few comparisons, for the checks every layer's
    forward runs (where this is False, `check_tensor` says what is wrong, or accepts a tensor subclass)."""
    if type(value) is not torch.Tensor or value.dtype != dtype or value.device != device:
        return False
    size = value.shape
    if shape[0] is None:
        if len(size) != len(shape) or size[1:] != shape[1:]:
            return False
    elif size != shape:
        return False
    return size[-1] <= 1 or value.stride(-1) == 1


def expect_tensor(name: str, value, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """`check_tensor` of one rank, dtype and shape (a leading None: any first size) for the checks every
    layer's forward runs: `matches` first, the full check only where it fails (for the message)."""
    if not matches(value, shape, dtype, device):
        check_tensor(name, value, ndim=len(shape), dtypes=(dtype,), shape=shape, device=device)


def check_positive_int(name: str, value, allow_none: bool = False) -> None:
    """A ValueError naming `name` and `value` unless it is an int >= 1 (not a bool), or None with allow_none."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; accepted: a positive int{' or None' if allow_none else ''}")


def check_positive_float(name: str, value) -> float:
    """`value` as a float, or a ValueError naming `name` and `value` unless it is a finite real number > 0 (not a
    bool): a softmax or cache scale of inf or NaN has no meaning (inf * 0 is NaN), so it is refused on every call."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name}={value!r}; accepted: a finite positive float")
    return float(value)


_SCALE_ACCEPTED = "a finite positive float or a 1-element floating-point tensor holding one"


def check_scale(name: str, scale, required: bool, *, refuse_unused: bool = False,
                scaled: str = "an fp8 kv_cache") -> None:
    """A ValueError naming `name` unless `scale` is None (where not `required`), a finite positive float, or a
    1-element floating-point tensor whose value (read where the data checks run, see `data_checks_enabled`) is
    finite and positive. `required`: the cache is FP8 and needs it. `refuse_unused`: a scale given for a cache
    that is not FP8 (which no backend would apply) is refused rather than ignored. `scaled`: what the scale
    belongs to, for the message of a missing one."""
    if scale is None:
        if required:
            raise ValueError(f"{name}=None with {scaled}; accepted: {_SCALE_ACCEPTED}")
        return
    if refuse_unused and not required:
        raise ValueError(f"{name}={describe(scale)} with a kv_cache that is not FP8 (its values are not scaled); "
                         "accepted: None (a scale applies to float8_e4m3fn / float8_e4m3fnuz caches only)")
    if torch.is_tensor(scale):
        if scale.numel() != 1 or not scale.dtype.is_floating_point:
            raise ValueError(f"{name}={describe(scale)}; accepted: {_SCALE_ACCEPTED}")
        if data_checks_enabled(scale.device):
            value = float(scale.detach().cpu().reshape(()))
            if not 0 < value < math.inf:
                raise ValueError(f"{name}=tensor([{value!r}]); accepted: {_SCALE_ACCEPTED}")
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < scale < math.inf:
        raise ValueError(f"{name}={scale!r}; accepted: {_SCALE_ACCEPTED}")


def data_checks_enabled(device: torch.device | str | None = None) -> bool:
    """Whether the checks that read tensor data run for tensors on `device`.

    Always on the CPU (no device to synchronise); elsewhere when
    MLA_MULTI_CHECK_INPUTS=1, except while a CUDA graph is being captured on
    the device's current stream.  When they run, the errors the kernels
    recorded on that device since the last report are raised first.
    """
    if _CHECK_INPUTS.read():
        # a CUDA graph being captured cannot read tensors on the host: there the kernels' own masking stands
        # (bad indices give NaN rows and the error flag, reported by the next call that checks)
        if device is not None and torch.cuda.is_initialized() and capturing_on(torch.device(device)):
            return False
        return True
    if device is None:
        return False
    return (device if isinstance(device, torch.device) else torch.device(device)).type == "cpu"


def planned_checks_run(planned: bool, device) -> bool:
    """Whether a plan's data checks run for this call: the plan was made with them on (`data_checks_enabled`
    read once then), and they still run now (not while a CUDA graph is being captured, which cannot read
    tensors on the host)."""
    return planned and data_checks_enabled(device)


def report_pending_errors(device: torch.device) -> None:
    """When the data checks run for `device`, raise what the kernels recorded there since the last report.

    Nothing is allocated: a device whose flag does not exist has nothing pending.
    """
    if data_checks_enabled(device) and errors.has_flag(device):
        errors.raise_pending_errors(device)


def check_non_negative_data(name: str, values: torch.Tensor) -> None:
    """With the data checks on (see `data_checks_enabled`): no negative entry."""
    if data_checks_enabled(values.device) and bool((values.detach().cpu() < 0).any()):
        raise ValueError(f"{name}={values.tolist()}; accepted: non-negative values")


def check_block_table_data(
    block_table: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int, name: str = "seq_lens"
) -> None:
    """With the data checks on: every block a sequence uses lies in [0, num_blocks), seq_lens fit the table."""
    if not data_checks_enabled(block_table.device):
        return
    lens = seq_lens.detach().to("cpu", torch.int64)
    table = block_table.detach().cpu()
    capacity = table.shape[1] * block_size
    if bool((lens < 0).any()) or bool((lens > capacity).any()):
        raise ValueError(f"{name}={lens.tolist()}; accepted: values in [0, {capacity}] (max_blocks * block_size)")
    for row, length in enumerate(lens.tolist()):
        used = table[row, : -(-length // block_size)]
        if used.numel() and (bool((used < 0).any()) or bool((used >= num_blocks).any())):
            raise ValueError(
                f"block_table[{row}] uses blocks {used.tolist()} for seq_len {length}; accepted: indices in [0, {num_blocks})"
            )


def check_slot_data(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """With the data checks on: every non-negative slot lies inside the cache."""
    if not data_checks_enabled(slot_mapping.device):
        return
    slots = slot_mapping.detach().cpu()
    bad = slots[slots >= num_slots]
    if bad.numel():
        raise ValueError(f"slot_mapping holds slots {bad[:8].tolist()}; accepted: negative (skip) or in [0, {num_slots})")


def as_int32(values: torch.Tensor) -> torch.Tensor:
    """Lengths or offsets (int32 or int64, both accepted by the ops) as the int32 the kernels read."""
    return values if values.dtype == torch.int32 else values.to(torch.int32)
