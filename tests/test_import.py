"""`import mla_multi` creates no CUDA / HIP context.

The import-time platform probe asks NVML (or amdsmi) for the device's name, compute capability and SM / CU
count, and never torch's device properties (which create the context): an engine that imports the package in
a parent process and forks workers must leave the GPU to them. On the CPU, child interpreters with torch's
context-creating functions replaced by ones that raise (and a fake `pynvml` describing an H200) show that
the import path never calls them; on a GPU (marked ``gpu``) a real process shows `torch.cuda.is_initialized()`
False after the import and a forked child using CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# torch.cuda functions that initialise CUDA (or the driver) when called: replaced by ones that raise
_PRELUDE = textwrap.dedent('''
    import json, sys, types
    import torch

    CALLED = []

    def forbid(name):
        def raiser(*args, **kwargs):
            CALLED.append(name)
            raise RuntimeError(f"torch.cuda.{name} initialises CUDA; called during import")
        return raiser

    for name in ("_lazy_init", "init", "current_device", "get_device_properties", "get_device_capability",
                 "get_device_name", "is_available", "synchronize", "set_device", "mem_get_info", "current_stream"):
        setattr(torch.cuda, name, forbid(name))
    if hasattr(torch._C, "_cuda_getDeviceCount"):
        torch._C._cuda_getDeviceCount = forbid("_C._cuda_getDeviceCount")
    torch.cuda._is_compiled = lambda: True  # act as a CUDA build of torch
    torch.version.hip = None
    torch.cuda.device_count = lambda: 1  # torch's count asks NVML, not the runtime
    torch.cuda._parse_visible_devices = lambda: [3]  # CUDA_VISIBLE_DEVICES=3: NVML index 3 is torch's device 0

    class FakeNvml(types.ModuleType):
        """pynvml (nvidia-ml-py) describing an H200 at NVML index 3."""
        def __init__(self, works):
            super().__init__("pynvml")
            self.works = works
            self.handles = []
        def nvmlInit(self):
            if not self.works:
                raise OSError("libnvidia-ml.so.1: cannot open shared object file")
        def nvmlShutdown(self):
            pass
        def nvmlDeviceGetHandleByIndex(self, index):
            self.handles.append(index)
            return ("handle", index)
        def nvmlDeviceGetName(self, handle):
            assert handle == ("handle", 3), handle
            return b"NVIDIA H200"
        def nvmlDeviceGetCudaComputeCapability(self, handle):
            return (9, 0)
        def nvmlDeviceGetNumGpuCores(self, handle):
            return 16896  # 132 SMs x 128
''')


def run_child(body: str, nvml_works: bool = True) -> dict:
    script = _PRELUDE + f"\nsys.modules['pynvml'] = FakeNvml({nvml_works})\n" + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_import_probes_through_nvml_and_calls_nothing_that_initialises_cuda():
    result = run_child('''
        import mla_multi as mm
        from mla_multi import platforms
        called_at_import = list(CALLED)
        platform = mm.current_platform()
        print("RESULT " + json.dumps({"called": called_at_import, "selected_at_import": mm._SELECTED is not None,
                                      "platform": platform.describe(), "handles": sys.modules["pynvml"].handles,
                                      "selected": mm.selected_backends(), "called_after": list(CALLED),
                                      "error": platforms.detection_error()}))
    ''')
    assert result["called"] == [], f"the import called {result['called']}"
    assert result["called_after"] == []
    assert result["selected_at_import"]
    assert result["handles"] and set(result["handles"]) == {3}  # CUDA_VISIBLE_DEVICES honoured
    from mla_multi.platforms import SPECS

    expected = SPECS["H200"].describe()
    got = result["platform"]
    assert got["name"] == "NVIDIA H200"
    for field in ("vendor", "arch", "device_capability", "num_compute_units", "warp_size", "fp8_dtype",
                  "max_shared_memory_per_block", "num_xcds"):
        assert got[field] == expected[field], (field, got[field], expected[field])
    assert result["error"] is None
    assert set(result["selected"]) == {"prefill", "decode"}


def test_info_shows_the_selection_made_at_import():
    result = run_child('''
        import mla_multi as mm
        from mla_multi import cli
        info = cli.collect_info()
        print("RESULT " + json.dumps({"import": mm.selected_backends(), "platform": info["detected_platform"],
                                      "info": {p: info["phases"][p]["selected"] for p in ("prefill", "decode")},
                                      "called": list(CALLED)}))
    ''')
    assert result["platform"]["arch"] == "sm_90"
    assert result["info"] == result["import"]


def test_without_nvml_the_probe_waits_for_the_first_call():
    """No NVML: nothing is probed at import (the selection waits for `selected_backends()`); the first call
    then uses torch's properties (here: they raise, so it degrades to the CPU with the reason kept)."""
    result = run_child('''
        import mla_multi as mm
        from mla_multi import platforms
        called_at_import = list(CALLED)
        deferred = mm._SELECTED is None
        selected = mm.selected_backends()
        print("RESULT " + json.dumps({"called": called_at_import, "deferred": deferred, "selected": selected,
                                      "platform": mm.current_platform().describe(), "called_after": list(CALLED),
                                      "error": platforms.detection_error()}))
    ''', nvml_works=False)
    assert result["called"] == []
    assert result["deferred"]
    assert result["called_after"], "the first call must use the torch probe"
    assert result["platform"]["vendor"] == "cpu" and "initialises CUDA" in result["error"]


def test_nvml_core_counts_give_the_sm_counts():
    from mla_multi.platforms.cuda import cores_per_sm

    # A100 6912 cores / 108 SMs, H100 SXM 16896 / 132, L40S (sm_89) 18176 / 142, B200 18944 / 148
    for capability, cores, sms in (((8, 0), 6912, 108), ((9, 0), 16896, 132), ((8, 9), 18176, 142),
                                   ((10, 0), 18944, 148)):
        assert cores // cores_per_sm(capability) == sms
    assert cores_per_sm((6, 1)) is None  # unknown: the probe gives up rather than guess


# --------------------------------------------------------------------------- on the GPU


def _gpu_child(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO_ROOT)


@pytest.mark.gpu
def test_gpu_import_leaves_cuda_uninitialised():
    proc = _gpu_child('''
        import mla_multi, torch
        assert not torch.cuda.is_initialized(), "import mla_multi initialised CUDA"
        mla_multi.selected_backends(), mla_multi.current_platform()
        assert not torch.cuda.is_initialized(), "the platform probe initialised CUDA"
        print("OK", mla_multi.current_platform().describe(), mla_multi.selected_backends())
    ''')
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.gpu
def test_gpu_forked_child_uses_cuda_after_import():
    proc = _gpu_child('''
        import os, sys
        import mla_multi, torch
        mla_multi.selected_backends()
        pid = os.fork()
        if pid == 0:
            try:
                value = float(torch.ones(4, device="cuda").sum().item())
                os._exit(0 if value == 4.0 else 3)
            except BaseException as error:
                print("child:", type(error).__name__, error, file=sys.stderr, flush=True)
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, f"forked child failed ({status})"
        print("OK")
    ''')
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.gpu
def test_gpu_probe_without_context_matches_torch_properties():
    """The NVML description equals the one from torch's properties (what the context-creating probe gives)."""
    proc = _gpu_child('''
        import json
        import torch
        from mla_multi import platforms
        found = platforms.probe_without_context()
        assert not torch.cuda.is_initialized()
        assert found is not None, "NVML / amdsmi could not describe the device"
        legacy, _ = platforms.detect_platform()
        print("RESULT " + json.dumps([found[0].describe(), legacy.describe()]))
    ''')
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    nvml, props = json.loads(lines[-1][len("RESULT "):])
    for field in ("vendor", "arch", "device_capability", "num_compute_units", "warp_size", "fp8_dtype",
                  "max_shared_memory_per_block", "num_xcds"):
        assert nvml[field] == props[field], (field, nvml[field], props[field])
