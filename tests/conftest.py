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
