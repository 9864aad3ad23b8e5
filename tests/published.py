"""Published third-party distributions for contract tests, downloaded once into pytest's cache.

The contract tests read a library's published source with `ast` and never
import it; an environment variable may point at a local copy for offline runs.
Without the network (and without that variable) they skip, naming the variable.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest


def published_distribution(pytestconfig, requirement: str, file_prefix: str, suffix: str, env_var: str,
                           pip_args: tuple[str, ...], pip_env: dict[str, str] | None = None) -> pathlib.Path:
    """The file of `requirement` ("name==version"): `env_var` if set, else pip-downloaded into the pytest cache."""
    given = os.environ.get(env_var)
    if given:
        path = pathlib.Path(given)
        assert path.is_file(), f"{env_var}={given!r} is not a file"
        return path
    cache = pytestconfig.cache.mkdir(f"published-{file_prefix}")
    version = requirement.partition("==")[2]
    found = sorted(cache.glob(f"{file_prefix}-{version}*{suffix}" if version else f"{file_prefix}-*{suffix}"))
    if not found:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", *pip_args, "-d", str(cache), requirement]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                                  env=dict(os.environ, **(pip_env or {})))
            failure = None if done.returncode == 0 else (
                [line for line in (done.stderr or done.stdout).splitlines() if line.strip()] or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            failure = "pip download timed out after 900 s"
        if failure is not None:
            # No network (or no index): the contract test cannot read the published source, so it skips
            # with the reason and the variable that supplies a local copy.
            pytest.skip(f"could not download {requirement} from the package index ({failure.strip()}); "
                        f"set {env_var} to a local copy of the {suffix} to run this contract test offline")
        found = sorted(cache.glob(f"{file_prefix}-*{suffix}"))
    assert found, f"no {file_prefix} distribution in {cache}"
    return found[-1]


def published_parameters(node: ast.FunctionDef) -> tuple[list[str], set[str]]:
    """(keyword-passable parameter names in declaration order, names that have no default)."""
    args = node.args
    positional = args.posonlyargs + args.args
    defaults_from = len(positional) - len(args.defaults)
    names = [a.arg for a in args.args + args.kwonlyargs]
    required = {a.arg for i, a in enumerate(positional) if i < defaults_from}
    required |= {a.arg for a, default in zip(args.kwonlyargs, args.kw_defaults) if default is None}
    return names, required


def adapter_keywords(adapter_source: pathlib.Path, function_name: str, callee: str) -> set[str]:
    """Keyword names the adapter passes to `callee` inside `function_name`, read from its source.

    Counts literal keywords of the call and the keys the function puts into a
    `keywords` dict that the call unpacks with `**keywords`.
    """
    tree = ast.parse(adapter_source.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function_name]
    assert functions, f"{adapter_source.name} has no {function_name}()"
    names: set[str] = set()
    calls = 0
    for node in ast.walk(functions[0]):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == callee:
                calls += 1
                names |= {k.arg for k in node.keywords if k.arg is not None}
            # keywords = dict(a=..., b=...) and keywords.update(c=...)
            if isinstance(func, ast.Name) and func.id == "dict":
                names |= {k.arg for k in node.keywords if k.arg is not None}
            if isinstance(func, ast.Attribute) and func.attr == "update" and getattr(func.value, "id", None) == "keywords":
                names |= {k.arg for k in node.keywords if k.arg is not None}
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "keywords" and isinstance(node.ctx, ast.Store):
            if isinstance(node.slice, ast.Constant):
                names.add(node.slice.value)
    assert calls == 1, f"{function_name}() calls {callee}() {calls} times; the contract test expects one call"
    return names
