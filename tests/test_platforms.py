"""Platforms: the ready specs, impersonation with `override`, and detection from faked torch probes."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from triton.backends.compiler import GPUTarget

import mla_multi as mm
import mla_multi.platforms as platforms
from mla_multi.platforms import SPECS, Platform, current_platform, override
from mla_multi.platforms.rocm import parse_gcn_arch_name, xcds_for

KIB = 1024
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz

# name: (vendor, arch, device_capability, compute units, warp size, fp8 dtype, shared memory per block)
EXPECTED_SPECS = {
    "MI300X": ("rocm", "gfx942", None, 304, 64, FNUZ, 64 * KIB),
    "MI325X": ("rocm", "gfx942", None, 304, 64, FNUZ, 64 * KIB),
    "MI355X": ("rocm", "gfx950", None, 256, 64, FN, 160 * KIB),
    "MI250X": ("rocm", "gfx90a", None, 110, 64, None, 64 * KIB),
    "RX7900XTX": ("rocm", "gfx1100", None, 96, 32, None, 64 * KIB),
    "A100": ("cuda", "sm_80", (8, 0), 108, 32, None, 166912),
    "H100": ("cuda", "sm_90", (9, 0), 132, 32, FN, 232448),
    "H200": ("cuda", "sm_90", (9, 0), 132, 32, FN, 232448),
    "B200": ("cuda", "sm_100", (10, 0), 148, 32, FN, 232448),
    "CPU": ("cpu", "cpu", None, None, None, None, None),
}

EXPECTED_TARGETS = {
    "MI300X": GPUTarget("hip", "gfx942", 64),
    "MI325X": GPUTarget("hip", "gfx942", 64),
    "MI355X": GPUTarget("hip", "gfx950", 64),
    "MI250X": GPUTarget("hip", "gfx90a", 64),
    "RX7900XTX": GPUTarget("hip", "gfx1100", 32),
    "A100": GPUTarget("cuda", 80, 32),
    "H100": GPUTarget("cuda", 90, 32),
    "H200": GPUTarget("cuda", 90, 32),
    "B200": GPUTarget("cuda", 100, 32),
    "CPU": None,
}


# --------------------------------------------------------------------------- ready specs


def test_specs_hold_exactly_the_documented_devices():
    assert set(SPECS) == set(EXPECTED_SPECS)
    for name, spec in SPECS.items():
        assert spec.name == name


@pytest.mark.parametrize("name", list(EXPECTED_SPECS))
def test_spec_values(name):
    vendor, arch, capability, compute_units, warp_size, fp8, shared = EXPECTED_SPECS[name]
    spec = SPECS[name]
    assert spec.vendor == vendor
    assert spec.arch == arch
    assert spec.device_capability == capability
    assert spec.fp8_dtype == fp8
    if compute_units is not None:
        assert spec.num_compute_units == compute_units
        assert spec.warp_size == warp_size
        assert spec.max_shared_memory_per_block == shared
    assert spec.device_index is None
    # the spec's XCDs are what detection finds for its arch and compute units
    expected_xcds = xcds_for(arch, compute_units) if vendor == "rocm" else 1
    assert spec.num_xcds == expected_xcds == (8 if name in ("MI300X", "MI325X", "MI355X") else 1)
    # Exactly one vendor predicate holds, and it is the declared vendor's.
    predicates = {"cuda": spec.is_cuda(), "rocm": spec.is_rocm(), "cpu": spec.is_cpu()}
    assert [v for v, held in predicates.items() if held] == [vendor]
    assert spec.is_gpu() == (vendor != "cpu")


@pytest.mark.parametrize("name", list(EXPECTED_TARGETS))
def test_triton_target(name):
    assert SPECS[name].triton_target() == EXPECTED_TARGETS[name]


@pytest.mark.parametrize(
    "name, at_least_sm90, cdna3",
    [("MI300X", False, True), ("MI355X", False, True), ("MI250X", False, False), ("RX7900XTX", False, False),
     ("A100", False, False), ("H100", True, False), ("B200", True, False), ("CPU", False, False)],
)
def test_capability_predicates_never_pass_on_rocm(name, at_least_sm90, cdna3):
    # gfx942 would report (9, 4) through torch and pass `>= (9, 0)` by accident.
    spec = SPECS[name]
    assert spec.has_device_capability(9, 0) is at_least_sm90
    assert spec.is_cdna3_or_newer() is cdna3


@pytest.mark.parametrize("name", list(EXPECTED_SPECS))
def test_describe_is_json_friendly(name):
    spec = SPECS[name]
    described = json.loads(json.dumps(spec.describe()))
    assert described["name"] == name
    assert described["vendor"] == spec.vendor
    assert described["arch"] == spec.arch
    assert described["num_compute_units"] == spec.num_compute_units
    expected_fp8 = None if spec.fp8_dtype is None else str(spec.fp8_dtype).removeprefix("torch.")
    assert described["fp8_dtype"] == expected_fp8
    expected_capability = None if spec.device_capability is None else list(spec.device_capability)
    assert described["device_capability"] == expected_capability


def test_platform_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SPECS["MI300X"].arch = "gfx950"  # type: ignore[misc]


def test_platform_rejects_capability_on_rocm():
    with pytest.raises(ValueError, match="device_capability") as info:
        Platform("MI300X", "rocm", "gfx942", 304, 64, FNUZ, 64 * KIB, (9, 4))
    assert "rocm" in str(info.value)


def test_platform_rejects_capability_on_cpu():
    with pytest.raises(ValueError, match="device_capability"):
        Platform("CPU", "cpu", "cpu", 1, 1, None, 0, (9, 0))


def test_platform_rejects_unknown_vendor():
    with pytest.raises(ValueError, match="vendor") as info:
        Platform("X", "intel", "xe", 1, 32, None, 0)
    message = str(info.value)
    assert "'intel'" in message and "'cuda'" in message and "'rocm'" in message and "'cpu'" in message


def test_torch_device_of_platforms():
    assert SPECS["CPU"].torch_device == torch.device("cpu")
    # ROCm PyTorch exposes HIP devices as "cuda".
    assert SPECS["MI300X"].torch_device == torch.device("cuda", 0)
    assert dataclasses.replace(SPECS["H100"], device_index=3).torch_device == torch.device("cuda", 3)


# --------------------------------------------------------------------------- override


def test_override_nests_and_restores():
    before = current_platform()
    with override("MI300X") as outer:
        assert outer is SPECS["MI300X"]
        assert current_platform() is SPECS["MI300X"]
        assert mm.current_platform() is SPECS["MI300X"]
        with override(SPECS["H100"]) as inner:
            assert inner is SPECS["H100"]
            assert current_platform() is SPECS["H100"]
            with override("cpu"):
                assert current_platform() is SPECS["CPU"]
            assert current_platform() is SPECS["H100"]
        assert current_platform() is SPECS["MI300X"]
    assert current_platform() is before


def test_override_restores_after_an_exception():
    before = current_platform()
    with pytest.raises(KeyError):
        with override("B200"):
            with override("MI355X"):
                raise KeyError("boom")
    assert current_platform() is before


def test_override_accepts_a_custom_platform():
    custom = Platform("MI308X", "rocm", "gfx942", 80, 64, FNUZ, 64 * KIB)
    with override(custom):
        assert current_platform() is custom


@pytest.mark.parametrize("spelling, name", [("mi300x", "MI300X"), ("Mi355X", "MI355X"), ("rx7900xtx", "RX7900XTX"),
                                            ("h100", "H100"), ("b200", "B200"), ("a100", "A100"), ("cpu", "CPU")])
def test_override_by_name_is_case_insensitive(spelling, name):
    with override(spelling) as spec:
        assert spec is SPECS[name]
        assert current_platform() is SPECS[name]


def test_override_unknown_name_lists_names():
    before = current_platform()
    with pytest.raises(ValueError) as info:
        with override("MI999X"):
            pass
    message = str(info.value)
    assert "MI999X" in message
    for name in SPECS:
        assert name in message
    assert current_platform() is before


def test_override_rejects_other_objects():
    with pytest.raises(ValueError, match="override"):
        with override(42):  # type: ignore[arg-type]
            pass


# --------------------------------------------------------------------------- detection from faked probes


@pytest.fixture
def fresh_detection(monkeypatch):
    """Forget the cached detection (restored afterwards) and clear any override in force."""
    monkeypatch.setattr(platforms, "_detected", None)
    monkeypatch.setattr(platforms, "_detection_error", None)
    monkeypatch.setattr(platforms, "_override_stack", [])
    # the faked torch probes below, not a real NVML / amdsmi that may be on the machine
    monkeypatch.setattr(platforms, "probe_without_context", lambda: None)
    return monkeypatch


def fake_device(monkeypatch, props, *, hip: str | None):
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def get_device_properties(index=0):
        if isinstance(props, Exception):
            raise props
        assert index == 0
        return props

    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)


def rocm_props(gcn_arch_name, **extra):
    fields = dict(name="AMD Instinct MI300X", gcnArchName=gcn_arch_name, major=9, minor=4,
                  multi_processor_count=304, warp_size=64)
    fields.update(extra)
    return types.SimpleNamespace(**fields)


def test_rocm_detection_uses_gcn_arch_name_not_capability(fresh_detection):
    fake_device(fresh_detection, rocm_props("gfx942:sramecc+:xnack-"), hip="6.2.41133")
    platform = current_platform()
    assert platform.vendor == "rocm"
    assert platform.arch == "gfx942"
    # The fake props say major=9 minor=4: it must not leak into the platform.
    assert platform.device_capability is None
    assert not platform.has_device_capability(9, 0)
    assert platform.num_compute_units == 304
    assert platform.warp_size == 64
    assert platform.fp8_dtype == FNUZ
    assert platform.max_shared_memory_per_block == 64 * KIB
    assert platform.device_index == 0
    assert platform.num_xcds == 8
    assert platform.triton_target() == GPUTarget("hip", "gfx942", 64)
    assert platforms.detection_error() is None
    # Detection is cached: a second call returns the same object.
    assert current_platform() is platform


@pytest.mark.parametrize(
    "gcn, warp_in_props, arch, warp, fp8, lds",
    [
        ("gfx950:sramecc+:xnack-", 64, "gfx950", 64, FN, 160 * KIB),
        ("gfx90a:sramecc+:xnack-", 64, "gfx90a", 64, None, 64 * KIB),
        # Without a warp size in the props, RDNA defaults to wave32 and CDNA to wave64.
        ("gfx1100", 0, "gfx1100", 32, None, 64 * KIB),
        ("gfx942", 0, "gfx942", 64, FNUZ, 64 * KIB),
    ],
)
def test_rocm_detection_per_arch(fresh_detection, gcn, warp_in_props, arch, warp, fp8, lds):
    fake_device(fresh_detection, rocm_props(gcn, warp_size=warp_in_props, multi_processor_count=77), hip="6.3")
    platform = current_platform()
    assert (platform.vendor, platform.arch, platform.device_capability) == ("rocm", arch, None)
    assert platform.warp_size == warp
    assert platform.fp8_dtype == fp8
    assert platform.max_shared_memory_per_block == lds
    assert platform.num_compute_units == 77


@pytest.mark.parametrize("gcn, compute_units, xcds", [
    ("gfx942", 304, 8),  # MI300X, MI325X
    ("gfx942", 228, 6),  # MI300A
    ("gfx942", 80, 4),  # MI308X
    ("gfx942", 152, 4), ("gfx942", 38, 1),  # MI300X in DPX and CPX compute partitions
    ("gfx950", 256, 8), ("gfx950", 64, 2),  # MI355X, and in a partition of two XCDs
    ("gfx942", 77, 1), ("gfx90a", 110, 1), ("gfx1100", 96, 1),  # unknown counts, one-die parts
])
def test_rocm_detection_counts_the_xcds(fresh_detection, gcn, compute_units, xcds):
    fake_device(fresh_detection, rocm_props(gcn, multi_processor_count=compute_units), hip="6.3")
    assert current_platform().num_xcds == xcds


@pytest.mark.parametrize("value", [0, -8, 2.0, True, None])
def test_platform_rejects_a_bad_xcd_count(value):
    with pytest.raises(ValueError, match=f"num_xcds={value!r}; accepted: a positive int"):
        Platform("MI300X", "rocm", "gfx942", 304, 64, FNUZ, 64 * KIB, num_xcds=value)


def test_override_beats_detection(fresh_detection):
    fake_device(fresh_detection, rocm_props("gfx942:sramecc+:xnack-"), hip="6.2")
    assert current_platform().arch == "gfx942"
    with override("H100"):
        assert current_platform() is SPECS["H100"]
    assert current_platform().arch == "gfx942"


@pytest.mark.parametrize(
    "major, minor, optin, sms, arch, fp8, shared",
    [
        (9, 0, 232448, 132, "sm_90", FN, 232448),
        (10, 0, 232448, 148, "sm_100", FN, 232448),
        (8, 9, 101376, 128, "sm_89", FN, 101376),
        # Without the opt-in attribute the documented per-architecture value is used.
        (8, 0, None, 108, "sm_80", None, 166912),
    ],
)
def test_cuda_detection(fresh_detection, major, minor, optin, sms, arch, fp8, shared):
    fields = dict(name="NVIDIA Test GPU", major=major, minor=minor, multi_processor_count=sms, warp_size=32)
    if optin is not None:
        fields["shared_memory_per_block_optin"] = optin
    fake_device(fresh_detection, types.SimpleNamespace(**fields), hip=None)
    platform = current_platform()
    assert platform.vendor == "cuda"
    assert platform.name == "NVIDIA Test GPU"
    assert platform.arch == arch
    assert platform.device_capability == (major, minor)
    assert platform.num_compute_units == sms
    assert platform.warp_size == 32
    assert platform.fp8_dtype == fp8
    assert platform.max_shared_memory_per_block == shared
    assert platform.triton_target() == GPUTarget("cuda", major * 10 + minor, 32)
    assert platforms.detection_error() is None


def test_failing_probe_degrades_to_cpu(fresh_detection):
    fake_device(fresh_detection, RuntimeError("HIP driver is broken"), hip="6.2")
    platform = current_platform()
    assert platform.is_cpu()
    error = platforms.detection_error()
    assert error is not None and "RuntimeError" in error and "HIP driver is broken" in error


def test_unparsable_gcn_arch_name_degrades_to_cpu(fresh_detection):
    fake_device(fresh_detection, rocm_props(""), hip="6.2")
    assert current_platform().is_cpu()
    assert "gcnArchName" in platforms.detection_error()


def test_raising_is_available_degrades_to_cpu(fresh_detection):
    def broken():
        raise OSError("libcuda.so: cannot open shared object file")

    fresh_detection.setattr(torch.cuda, "is_available", broken)
    assert current_platform().is_cpu()
    assert "libcuda.so" in platforms.detection_error()


def test_no_device_gives_cpu_without_error(fresh_detection):
    fresh_detection.setattr(torch.cuda, "is_available", lambda: False)
    platform = current_platform()
    assert platform.is_cpu() and platform.arch == "cpu" and platform.device_capability is None
    assert platform.triton_target() is None
    assert platforms.detection_error() is None


def test_visible_runtime_without_devices_gives_cpu(fresh_detection):
    fresh_detection.setattr(torch.cuda, "is_available", lambda: True)
    fresh_detection.setattr(torch.cuda, "device_count", lambda: 0)
    assert current_platform().is_cpu()
    assert platforms.detection_error() is None


@pytest.mark.parametrize("raw, arch", [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx950", "gfx950"),
                                       ("gfx90a:sramecc-:xnack+", "gfx90a"), (" gfx1100 ", "gfx1100")])
def test_parse_gcn_arch_name(raw, arch):
    assert parse_gcn_arch_name(raw) == arch


@pytest.mark.parametrize("raw", ["", "sm_90", ":gfx942"])
def test_parse_gcn_arch_name_rejects_non_gfx(raw):
    with pytest.raises(ValueError, match="gcnArchName"):
        parse_gcn_arch_name(raw)
