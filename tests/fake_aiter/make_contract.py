"""Read the facts the ROCM_AITER adapter depends on out of an aiter source tree or wheel.

    python tests/fake_aiter/make_contract.py SOURCE [--commit SHA --tag TAG] [-o tests/fake_aiter/contract.json]

SOURCE is a directory holding aiter's repository files (aiter/mla.py,
aiter/ops/attention.py, aiter/ops/mha.py, hsa/<arch>/mla/mla_asm.csv) or a
wheel (the same files under aiter/ and aiter_meta/). Only facts are written:
parameter names and their defaults (as source text) of the functions in
`FUNCTIONS`, and the rows of the MLA kernel tables (which configurations have
an assembly kernel, whether it writes the LSE, whether it is persistent). The
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
    ("aiter/ops/attention.py", "get_mla_metadata_info_v1"),
    ("aiter/ops/attention.py", "get_mla_metadata_v1"),
    ("aiter/ops/attention.py", "mla_reduce_v1"),
    ("aiter/ops/attention.py", "mla_prefill_ps_asm_fwd"),
    ("aiter/ops/attention.py", "get_ps_metadata_info_v1"),
    ("aiter/ops/attention.py", "get_ps_metadata_v1"),
    ("aiter/ops/mha.py", "flash_attn_varlen_func"),
)
ARCHS: tuple[str, ...] = ("gfx942", "gfx950")
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


def kernel_table(text: str) -> list[dict]:
    rows = []
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
    kernels = {}
    for arch in ARCHS:
        text = tree.read(f"hsa/{arch}/mla/mla_asm.csv")
        kernels[arch] = None if text is None else kernel_table(text)
    return {"functions": functions, "mla_kernels": kernels}


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
