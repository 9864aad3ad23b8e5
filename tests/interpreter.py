"""Run a test module's Triton cases under the interpreter, in a child process.

TRITON_INTERPRET must be set before Triton is imported, so each kernel test
module re-runs itself as a script with it set and prints its results as one
JSON line after `RESULTS_JSON `.
"""

import contextlib
import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "RESULTS_JSON "


def print_results(results: dict) -> None:
    print(MARKER + json.dumps(results))


def run_interpreter_script(script: str, *args: str, timeout: float = 900) -> dict:
    """Run `script` with TRITON_INTERPRET=1 and return the results it printed."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(script), *args], env=env, capture_output=True, text=True,
        timeout=timeout, cwd=REPO_ROOT,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len(MARKER):])


@contextlib.contextmanager
def memcheck():
    """Record every load, store and atomic of an interpreted kernel outside the tensors it was given.

    The interpreter's memory operations are checked lane by lane (masked-off
    lanes excepted) against the byte span of each tensor argument of the
    launch, and the offending lanes are masked off so the process survives.
    Yields the list of violations, one dict per operation that had any:
    kernel, operation, lanes outside, first bad address.
    """
    import numpy as np
    from triton.runtime import interpreter

    violations: list[dict] = []
    state = {"spans": [], "kernel": None}
    original_init = interpreter.GridExecutor._init_args_hst
    builder = interpreter.InterpreterBuilder
    original = {name: getattr(builder, name) for name in ("create_masked_load", "create_masked_store", "create_atomic_rmw")}

    def span(tensor):
        if tensor.numel() == 0:
            return None
        low = high = 0
        for size, stride in zip(tensor.shape, tensor.stride()):
            low += min(0, (size - 1) * stride)
            high += max(0, (size - 1) * stride)
        size = tensor.element_size()
        return tensor.data_ptr() + low * size, tensor.data_ptr() + (high + 1) * size

    def collect(arg, spans):
        if isinstance(arg, (tuple, list)):
            for item in arg:
                collect(item, spans)
        elif hasattr(arg, "base") and hasattr(arg, "block_shape"):  # a tensor descriptor
            collect(arg.base, spans)
        elif hasattr(arg, "data_ptr") and hasattr(arg, "stride"):
            extent = span(arg)
            if extent is not None:
                spans.append(extent)

    def init(self, args_dev, kwargs):
        args_hst, kwargs_hst = original_init(self, args_dev, kwargs)
        spans: list = []
        collect(list(args_hst) + list(kwargs_hst.values()), spans)
        state["spans"], state["kernel"] = spans, getattr(self.fn, "__name__", str(self.fn))
        return args_hst, kwargs_hst

    def checked(operation, ptrs, mask):
        itemsize = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        addresses = np.asarray(ptrs.data).astype(np.uint64)
        active = np.broadcast_to(np.asarray(mask.data).astype(bool), addresses.shape)
        inside = np.zeros(addresses.shape, dtype=bool)
        for low, high in state["spans"]:
            inside |= (addresses >= low) & (addresses + itemsize <= high)
        outside = active & ~inside
        if outside.any():
            violations.append({"kernel": state["kernel"], "operation": operation, "lanes": int(outside.sum()),
                               "address": int(addresses[outside].flat[0])})
            return interpreter.TensorHandle(active & inside, mask.dtype)
        return mask

    # The builder's trailing arguments (cache and eviction policies, volatility) differ between Triton
    # releases; they pass through untouched.
    def masked_load(self, ptrs, mask, other, *policies):
        return original["create_masked_load"](self, ptrs, checked("load", ptrs, mask), other, *policies)

    def masked_store(self, ptrs, value, mask, *policies):
        return original["create_masked_store"](self, ptrs, value, checked("store", ptrs, mask), *policies)

    def atomic_rmw(self, rmw_op, ptr, val, mask, *ordering):
        return original["create_atomic_rmw"](self, rmw_op, ptr, val, checked("atomic", ptr, mask), *ordering)

    interpreter.GridExecutor._init_args_hst = init
    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    builder.create_atomic_rmw = atomic_rmw
    try:
        yield violations
    finally:
        interpreter.GridExecutor._init_args_hst = original_init
        for name, method in original.items():
            setattr(builder, name, method)
