import os

# The suite always runs the data-reading input checks (indices inside the cache).
os.environ.setdefault("MLA_MULTI_CHECK_INPUTS", "1")
# MKL's CPU matmuls may take a different code path for differently aligned operands, so a float64 result
# could change with where the allocator put a tensor (a float64 layer step against its float64 reference
# differed by 2e-10 in about 1 process in 50); its conditional numerical reproducibility mode makes the float64
# comparisons independent of addresses. Read when MKL starts, so set before torch computes anything.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: no CUDA or ROCm device is visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_cache_handed_back(request):
    """Under pytest-xdist (workers sharing one device), a GPU test's cached device memory handed back when it
    ends: what one worker's allocator keeps cached after its largest test (18-33 GiB each, measured) is memory
    another worker's float64 reference cannot get."""
    yield
    if os.environ.get("PYTEST_XDIST_WORKER") and "gpu" in request.keywords and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture
def fake_flash_mla(monkeypatch):
    """tests/fake_flash_mla (FlashMLA's interface in PyTorch) imported as flash_mla, forgotten afterwards."""
    import pathlib
    import sys

    from mla_multi import registry
    from mla_multi.backends import flashmla

    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "flash_mla"}
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent / "fake_flash_mla"))
    flashmla.clear_caches()
    registry.default_registry.clear_cache()
    import flash_mla

    flash_mla.CALLS.clear()
    yield flash_mla
    for name in [n for n in sys.modules if n.split(".")[0] == "flash_mla"]:
        del sys.modules[name]
    sys.modules.update(saved)
    flashmla.clear_caches()
    registry.default_registry.clear_cache()


@pytest.fixture
def fresh_compile_state():
    """torch.compile's caches and counters empty, and no current step on the CPU, before and after a test
    (the layer's compile tests count the graphs they make)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from mla_multi import library

    cpu = torch.device("cpu")
    torch._dynamo.reset()
    counters.clear()
    library.set_current_metadata(cpu, None)
    yield
    torch._dynamo.reset()
    library.set_current_metadata(cpu, None)
