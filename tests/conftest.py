import os

# The suite always runs the data-reading input checks (indices inside the cache).
os.environ.setdefault("MLA_MULTI_CHECK_INPUTS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: no CUDA or ROCm device is visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
