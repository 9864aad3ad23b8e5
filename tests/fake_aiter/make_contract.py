"""Read the facts the ROCM_AITER adapter depends on out of an aiter source tree or wheel.

    python tests/fake_aiter/make_contract.py SOURCE [--commit SHA --tag TAG] [-o tests/fake_aiter/contract.json]

SOURCE is a directory holding aiter's repository files (aiter/mla.py,
aiter/ops/attention.py, aiter/ops/mha.py, aiter/jit/core.py, hsa/<arch>/mla/mla_asm.csv,
hsa/gfx950/mla_v4/mla_v4_asm.csv) or a wheel (the same files under aiter/ and aiter_meta/). Only facts are
written: parameter names and their defaults (as source text) of the functions in `FUNCTIONS`, for the V4
entry points (`BODY_FACTS`) what their bodies call and compare with, the V4.0 layout constants of
aiter/mla.py, whether aiter/jit/core.py reads AITER_ENABLE_EXPERIMENTAL, and the rows of the MLA kernel
tables (which configurations have an assembly kernel, whether it writes the LSE, whether it is persistent). The
source is parsed with `ast`; nothing of aiter is imported or copied.
`tests/test_backend_rocm_aiter_contract.py` reads the same facts from the
committed contract.json, from a wheel named by MLA_MULTI_AITER_WHEEL and from
a source tree named by MLA_MULTI_AITER_SOURCE, with these functions.
"""

from __future__ import annotations

import argparse
import ast
import csv
import io
import json
import pathlib
import sys
import zipfile

# (source file, function) of every aiter function the adapter calls or whose contract it relies on
FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("aiter/mla.py", "mla_decode_fwd"),
    ("aiter/mla.py", "mla_decode_fwd_ds32"),
    ("aiter/mla.py", "mla_prefill_ps_fwd"),
    ("aiter/mla.py", "mla_v40_decode_fwd"),
    ("aiter/mla.py", "mla_decode_fwd_v4_nm"),
    ("aiter/ops/attention.py", "get_mla_metadata_info_v1"),
    ("aiter/ops/attention.py", "get_mla_metadata_v1"),
    ("aiter/ops/attention.py", "mla_reduce_v1"),
    ("aiter/ops/attention.py", "mla_prefill_ps_asm_fwd"),
    ("aiter/ops/attention.py", "get_ps_metadata_info_v1"),
    ("aiter/ops/attention.py", "get_ps_metadata_v1"),
    ("aiter/ops/attention.py", "hk_mla_v40_decode_fwd"),
    ("aiter/ops/mha.py", "flash_attn_varlen_func"),
)
# functions whose body facts are recorded too (what they call, the int tuples and strings they compare with):
# the DeepSeek-V4 decode entry points ROCM_AITER declines, for the gates its reasons state
BODY_FACTS: tuple[str, ...] = ("mla_v40_decode_fwd", "mla_decode_fwd_v4_nm")
# module-level int constants of aiter/mla.py recorded (the V4.0 packed layout)
CONSTANT_PREFIX = "_V40_"
ARCHS: tuple[str, ...] = ("gfx942", "gfx950")
# architectures whose hsa/<arch>/mla_v4/mla_v4_asm.csv (the V4 "nm" decode kernels) is read
V4_ARCHS: tuple[str, ...] = ("gfx950",)
# Columns of hsa/<arch>/mla/mla_asm.csv kept per kernel (gfx942's table has no cprr column: 0)
KERNEL_COLUMNS: tuple[str, ...] = ("qType", "kvType", "Gqa", "ps", "qSeqLen", "prefill", "causal", "lse", "cprr")


class SourceTree:
    """Files of an aiter checkout directory or wheel, by repository path."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self._zip = zipfile.ZipFile(self.path) if self.path.is_file() else None

    def read(self, name: str) -> str | None:
        candidates = [name]
        if name.startswith("hsa/"):
            candidates.append("aiter_meta/" + name)
        for candidate in candidates:
            if self._zip is not None:
                if candidate in self._zip.namelist():
                    return self._zip.read(candidate).decode("utf-8")
            elif (self.path / candidate).is_file():
                return (self.path / candidate).read_text()
        return None


def function_parameters(source: str, function: str) -> list[list] | None:
    """[[name, default source text or None (required)], ...] of the last top-level `function` in `source`."""
    tree = ast.parse(source)
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    if not found:
        return None
    args = found[-1].args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    rows = [[a.arg, d] for a, d in zip(positional, defaults)]
    rows += [[a.arg, None if d is None else ast.unparse(d)] for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return rows


def function_body_facts(source: str, function: str) -> dict | None:
    """What the last top-level `function` in `source` calls (names, sorted), the tuples of ints and the strings
    it compares with or tests membership in (sorted), and its keyword-only parameters without a default."""
    tree = ast.parse(source)
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    if not found:
        return None
    calls, tuples, strings = set(), set(), set()
    for node in ast.walk(found[-1]):
        if isinstance(node, ast.Call):
            target = node.func
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
            if name:
                calls.add(name)
        elif isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                if isinstance(operand, ast.Tuple) and all(isinstance(e, ast.Constant) and type(e.value) is int
                                                          for e in operand.elts):
                    tuples.add(tuple(e.value for e in operand.elts))
                elif isinstance(operand, ast.Constant) and isinstance(operand.value, str):
                    strings.add(operand.value)
    args = found[-1].args
    required_keywords = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    return {"calls": sorted(calls), "int_tuples": sorted(list(t) for t in tuples), "strings": sorted(strings),
            "required_keywords": required_keywords}


def module_int_constants(source: str, prefix: str) -> dict:
    """Top-level `NAME = <int>` assignments of `source` whose name starts with `prefix`."""
    constants = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and type(node.value.value) is int:
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.startswith(prefix):
                    constants[target.id] = node.value.value
    return constants


def kernel_table(text: str) -> list[dict]:
    rows = []
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))
    for row in csv.DictReader(io.StringIO(text)):
        entry = {"q": row["qType"], "kv": row["kvType"]}
        for column, key in (("Gqa", "gqa"), ("ps", "ps"), ("qSeqLen", "qlen"), ("prefill", "prefill"),
                            ("causal", "causal"), ("lse", "lse"), ("cprr", "cprr")):
            entry[key] = int(row.get(column) or 0)
        entry["kernel"] = row["co_name"].removesuffix(".co")
        rows.append(entry)
    return rows


def read_contract(path: pathlib.Path) -> dict:
    tree = SourceTree(path)
    functions = {}
    for source, function in FUNCTIONS:
        text = tree.read(source)
        functions[function] = {
            "source": source,
            "parameters": None if text is None else function_parameters(text, function),
        }
        if function in BODY_FACTS:
            functions[function]["body"] = None if text is None else function_body_facts(text, function)
    kernels = {}
    for arch in ARCHS:
        text = tree.read(f"hsa/{arch}/mla/mla_asm.csv")
        kernels[arch] = None if text is None else kernel_table(text)
    v4_kernels = {}
    for arch in V4_ARCHS:
        text = tree.read(f"hsa/{arch}/mla_v4/mla_v4_asm.csv")
        v4_kernels[arch] = None if text is None else kernel_table(text)
    mla = tree.read("aiter/mla.py")
    constants = None if mla is None else module_int_constants(mla, CONSTANT_PREFIX)
    experimental = tree.read("aiter/jit/core.py")
    return {"functions": functions, "mla_kernels": kernels, "mla_v4_kernels": v4_kernels,
            "mla_constants": constants,
            "experimental_switch": None if experimental is None else sorted(
                name for name in ("AITER_ENABLE_EXPERIMENTAL",) if f'"{name}"' in experimental)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=pathlib.Path)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--tag", default=None)
    parser.add_argument("-o", "--output", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    contract = {"aiter": {"repository": "https://github.com/ROCm/aiter", "tag": args.tag, "commit": args.commit}}
    contract.update(read_contract(args.source))
    text = json.dumps(contract, indent=1) + "\n"
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
