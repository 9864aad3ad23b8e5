"""Every registered backend declares what the layer and the ops ask of it (on the base classes of
`mla_multi.backends.base`), and the layer reads those declarations without naming a backend."""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib

import pytest

import mla_multi
from mla_multi.backends.base import (
    DecodeLaunch,
    MLADecodeBackend,
    MLADecodeImpl,
    MLAPrefillBackend,
    MLAPrefillImpl,
    MLASparseBackend,
    MLASparseImpl,
)
from mla_multi.registry import PHASES, default_registry

BASES = {
    "prefill": (MLAPrefillBackend, MLAPrefillImpl, "get_prefill_impl_cls"),
    "decode": (MLADecodeBackend, MLADecodeImpl, "get_decode_impl_cls"),
    "sparse_decode": (MLASparseBackend, MLASparseImpl, "get_impl_cls"),
    "sparse_prefill": (MLASparseBackend, MLASparseImpl, "get_impl_cls"),
}
# what `MLAAttention` reads of a prefill impl, and what a decode step asks of a decode impl
PREFILL_FLAGS = ("takes_split_key", "takes_out", "merges_chunks")
REGISTERED = [(phase, name) for phase in PHASES for name in default_registry.names(phase)]


def _declared_flag(impl_cls: type, name: str) -> bool:
    """A class-level bool, or a property computing one per instance (declared on the base class too)."""
    value = inspect.getattr_static(impl_cls, name)
    return isinstance(value, bool) or isinstance(value, (property, functools.cached_property))


@pytest.mark.parametrize("phase,name", REGISTERED, ids=[f"{p}-{n}" for p, n in REGISTERED])
def test_every_registered_backend_declares_its_capabilities(phase, name):
    backend = default_registry.load(phase, name)  # every backend module imports without its library
    backend_base, impl_base, getter = BASES[phase]
    assert issubclass(backend, backend_base), backend
    assert backend.name == name
    for declaration in ("vendors", "supported_dtypes", "requires_plan"):
        assert hasattr(backend_base, declaration) and hasattr(backend, declaration), declaration
    impl_cls = getattr(backend, getter)()
    assert issubclass(impl_cls, impl_base), impl_cls
    if phase == "prefill":
        for flag in PREFILL_FLAGS:
            assert _declared_flag(MLAPrefillImpl, flag) and _declared_flag(impl_cls, flag), (name, flag)
        assert callable(impl_cls.serves_short_prefills)
    elif phase == "decode":
        assert isinstance(impl_cls.chooses_num_kv_splits, bool)
        if impl_cls.chooses_num_kv_splits:  # it must then choose, not inherit the pass-through
            assert impl_cls.choose_num_kv_splits is not MLADecodeImpl.choose_num_kv_splits, name
        # the one way into the kernels: the base's bind (a launch through forward_mqa) or the backend's own
        assert callable(impl_cls.bind) and callable(impl_cls.forward_mqa)
        assert backend.max_query_len >= 1 and isinstance(backend.supports_cuda_graphs, bool)
    else:
        assert backend.max_topk >= 1 and backend.max_query_len >= 1
        assert _declared_flag(MLASparseImpl, "v4_takes_out") and _declared_flag(impl_cls, "v4_takes_out"), name


def test_the_default_bind_is_a_launch_through_forward_mqa():
    """A backend that binds nothing of its own gets a launch that calls `forward_mqa` with what it was bound
    with, writing given outputs."""
    import torch

    calls = []

    class Impl(MLADecodeImpl):
        def forward_mqa(self, q_nope, q_pe, kv_cache, block_table, seq_lens, **keywords):
            calls.append((self.scale, keywords))
            return q_nope * 2, q_nope.new_zeros(q_nope.shape[:-1])

    impl = Impl(4, 1.0, 8, 2, torch.float32, 16)
    q = torch.ones(2, 4, 8)
    launch = impl.bind(q, q[..., :2], None, None, None, num_kv_splits=3, max_seq_len=40, plan="p")
    assert isinstance(launch, DecodeLaunch) and launch.num_kv_splits == 3 and launch.new_partials() is None
    out = torch.empty(2, 4, 8)
    result, lse = launch(q, q[..., :2], None, None, None, 0.5, out=out)
    assert result is out and torch.equal(out, q * 2) and lse.shape == (2, 4)
    assert calls == [(0.5, {"k_scale": None, "num_kv_splits": 3, "workspace_manager": None, "max_seq_len": 40,
                            "plan": "p"})]


def _code_strings_and_calls(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """The string constants of a module's code (docstrings left out) and the names of the functions it calls."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
        and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    strings = {node.value for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}
    calls = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    return strings, calls


def test_the_layer_names_no_backend_and_reads_declarations_only():
    """`attention.py` chooses nothing by a backend's name and probes no impl with getattr / hasattr: what it
    needs is declared on the base classes (the test above)."""
    path = pathlib.Path(mla_multi.__file__).parent / "attention.py"
    strings, calls = _code_strings_and_calls(path)
    names = {name for _, name in REGISTERED}
    assert not strings & names, sorted(strings & names)
    assert not calls & {"getattr", "hasattr"}, sorted(calls & {"getattr", "hasattr"})


def test_ops_import_no_backend_and_no_backend_calls_back_into_ops():
    """The functional ops reach a backend through the registry and `bind` only; no backend module imports
    `mla_multi.ops` (a call goes down the floors and back, never up and down again)."""
    package = pathlib.Path(mla_multi.__file__).parent
    ops_tree = ast.parse((package / "ops.py").read_text())
    imported = {node.module for node in ast.walk(ops_tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {m for m in imported if m.startswith("mla_multi.backends.") and m != "mla_multi.backends.base"}
    for path in sorted((package / "backends").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                assert "mla_multi.ops" not in targets, path.name


def _module_imports() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports (at the top or inside a function)."""
    package = pathlib.Path(mla_multi.__file__).parent
    modules = {}
    for path in package.rglob("*.py"):
        name = ".".join(("mla_multi",) + path.relative_to(package).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    edges = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        base_parts = name.split(".") if is_package else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    module = ".".join(base_parts[: len(base_parts) - node.level + 1] + ([module] if module else []))
                targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # a package's __init__ only gathers names: importing it is no edge into its modules
                if target and target != name and modules[target].name != "__init__.py":
                    found.add(target)
        edges[name] = found
    return edges


def test_no_import_circle():
    """No two modules of the package import each other, directly or through others (a package's __init__,
    which gathers the public names, aside)."""
    edges = _module_imports()
    assert "mla_multi.ops" in edges and edges["mla_multi.ops"]  # the walk sees the package
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert not circles, circles


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's map names every module of the package by its path inside it."""
    package = pathlib.Path(mla_multi.__file__).parent
    page = (package.parent / "docs" / "architecture.md").read_text()
    missing = [str(path.relative_to(package)) for path in sorted(package.rglob("*.py"))
               if path.relative_to(package).as_posix() not in page and path.relative_to(package) != pathlib.Path("__init__.py")]
    assert not missing, missing
