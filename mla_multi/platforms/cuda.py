"""NVIDIA detection: through NVML without a CUDA context (`probe_nvml`, what the import uses), or through
torch's CUDA runtime, which creates the context (`detect_cuda`, where NVML cannot describe the device)."""

from __future__ import annotations

import ctypes

import torch

from mla_multi.platforms.base import Platform

# CUDA cores per streaming multiprocessor by compute capability major (and the minor where it differs):
# NVML reports cores, not SMs.
_CORES_PER_SM = {(7, None): 64, (8, 0): 64, (8, None): 128, (9, None): 128, (10, None): 128, (11, None): 128,
                 (12, None): 128}
# the opt-in shared memory per block by capability, where torch's properties are not read
_SHARED_MEMORY = {(7, 0): 96 * 1024, (7, 2): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 7): 163 * 1024,
                  (8, 6): 99 * 1024, (8, 9): 99 * 1024, (12, 0): 99 * 1024, (12, 1): 99 * 1024}


def _shared_memory_per_block(props, capability: tuple[int, int]) -> int:
    # torch exposes the opt-in limit on recent releases; fall back to the
    # documented per-architecture values.
    value = getattr(props, "shared_memory_per_block_optin", None)
    if value:
        return int(value)
    return _SHARED_MEMORY.get(capability, 227 * 1024)


def cores_per_sm(capability: tuple[int, int]) -> int | None:
    major, minor = capability
    return _CORES_PER_SM.get((major, minor), _CORES_PER_SM.get((major, None)))


def cuda_platform(name: str, capability: tuple[int, int], num_sms: int, device_index: int,
                  shared_memory: int | None = None) -> Platform:
    """The `Platform` of an NVIDIA device from what NVML or torch's properties tell of it."""
    return Platform(
        name=name,
        vendor="cuda",
        arch=f"sm_{capability[0]}{capability[1]}",
        num_compute_units=int(num_sms),
        warp_size=32,
        fp8_dtype=torch.float8_e4m3fn if capability >= (8, 9) else None,
        max_shared_memory_per_block=shared_memory or _SHARED_MEMORY.get(capability, 227 * 1024),
        device_capability=capability,
        device_index=device_index,
    )


def _nvml_device_pynvml(pynvml, token) -> dict:
    pynvml.nvmlInit()
    try:
        if isinstance(token, int):
            handle = pynvml.nvmlDeviceGetHandleByIndex(token)
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(token)
        name = pynvml.nvmlDeviceGetName(handle)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        cores = int(pynvml.nvmlDeviceGetNumGpuCores(handle))
    finally:
        pynvml.nvmlShutdown()
    return {"name": name.decode() if isinstance(name, bytes) else str(name), "capability": (int(major), int(minor)),
            "cores": cores}


def _nvml_device_ctypes(token) -> dict:
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    if lib.nvmlInit_v2() != 0:
        raise RuntimeError("nvmlInit_v2 failed")
    try:
        handle = ctypes.c_void_p()
        if isinstance(token, int):
            status = lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(token), ctypes.byref(handle))
        else:
            status = lib.nvmlDeviceGetHandleByUUID(ctypes.c_char_p(str(token).encode()), ctypes.byref(handle))
        if status != 0:
            raise RuntimeError(f"NVML has no device {token!r} (status {status})")
        name = ctypes.create_string_buffer(96)
        major, minor, cores = ctypes.c_int(), ctypes.c_int(), ctypes.c_uint()
        if (lib.nvmlDeviceGetName(handle, name, ctypes.c_uint(96)) != 0
                or lib.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0
                or lib.nvmlDeviceGetNumGpuCores(handle, ctypes.byref(cores)) != 0):
            raise RuntimeError("NVML did not describe the device")
    finally:
        lib.nvmlShutdown()
    return {"name": name.value.decode(), "capability": (major.value, minor.value), "cores": int(cores.value)}


def probe_nvml(token: int | str = 0) -> Platform | None:
    """Describe torch's CUDA device 0 (`token`: its NVML index, or its UUID, from CUDA_VISIBLE_DEVICES) through
    NVML (the `pynvml` module of nvidia-ml-py where installed, else libnvidia-ml through ctypes) without
    creating a CUDA context; None where NVML cannot say the name, capability and SM count."""
    try:
        try:
            import pynvml
        except Exception:
            pynvml = None
        device = _nvml_device_pynvml(pynvml, token) if pynvml is not None else _nvml_device_ctypes(token)
    except Exception:
        return None
    per_sm = cores_per_sm(device["capability"])
    if not per_sm or device["cores"] <= 0 or device["cores"] % per_sm:
        return None
    return cuda_platform(device["name"], device["capability"], device["cores"] // per_sm, 0)


def detect_cuda(device_index: int = 0) -> Platform:
    """Describe the CUDA device `device_index`. Creates the CUDA context (unavoidable for properties)."""
    props = torch.cuda.get_device_properties(device_index)
    capability = (int(props.major), int(props.minor))
    return cuda_platform(str(props.name), capability, int(props.multi_processor_count), device_index,
                         shared_memory=_shared_memory_per_block(props, capability))
