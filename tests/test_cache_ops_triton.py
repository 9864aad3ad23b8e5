"""Triton cache ops (concat_and_cache_mla, gather_cache) against PyTorch.

The FP8 write must match PyTorch's own conversion of the saturated ``x / scale``
bit for bit; padding slots (negative) must leave the cache untouched; the
gather must return exactly the cached rows (times the scale for FP8).  CPU
cases run under the Triton interpreter in a subprocess; GPU cases are marked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0}
CASES = [
    # (id, cache dtype, source dtype, lora, rope, block size)
    ("fp16", "float16", "float16", 64, 16, 16),
    ("bf16-bs1", "bfloat16", "bfloat16", 64, 16, 1),
    ("fp8-e4m3fn", "float8_e4m3fn", "float32", 64, 16, 16),
    ("fp8-e4m3fnuz", "float8_e4m3fnuz", "bfloat16", 64, 16, 64),
    ("deepseek-fp8", "float8_e4m3fn", "bfloat16", 512, 64, 16),
]


def run_case(cache_name, source_name, lora, rope, block_size, device, seed=0):
    from mla_multi.kernels.cache_ops import concat_and_cache_mla, gather_cache

    cache_dtype, source_dtype = getattr(torch, cache_name), getattr(torch, source_name)
    generator = torch.Generator().manual_seed(seed)
    num_tokens = 37
    num_blocks = max(6, -(-64 // block_size))
    fp8 = cache_name in FP8_MAX
    scale = torch.tensor([0.02], device=device) if fp8 else None
    kv_c = (torch.randn(num_tokens, lora, generator=generator) * 3).to(source_dtype)
    k_pe = (torch.randn(num_tokens, rope, generator=generator) * 3).to(source_dtype)
    # saturation, tiny values (subnormals after scaling), zeros of both signs
    kv_c[0, :6] = torch.tensor([1e4, -1e4, 1e-5, -1e-5, 0.0, -0.0]).to(source_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].long()
    slots[[3, 11]] = -1
    cache = torch.zeros(num_blocks, block_size, lora + rope, dtype=cache_dtype)
    sentinel = torch.full_like(cache.view(torch.uint8) if fp8 else cache, 7)
    cache = sentinel.view(cache_dtype).clone() if fp8 else sentinel.clone()
    kv_c, k_pe, cache, slots = kv_c.to(device), k_pe.to(device), cache.to(device), slots.to(device)
    concat_and_cache_mla(kv_c, k_pe, cache, slots, scale)

    source = torch.cat([kv_c, k_pe], -1).float()
    if fp8:
        limit = FP8_MAX[cache_name]
        expected = (source / scale).clamp(-limit, limit).to(cache_dtype)
    else:
        expected = source.to(cache_dtype)
    flat = cache.view(-1, lora + rope)
    written = slots >= 0
    as_bytes = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
    write_exact = bool(torch.equal(as_bytes(flat[slots[written]]), as_bytes(expected[written])))
    untouched_rows = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
    untouched_rows[slots[written]] = False
    untouched = bool(torch.equal(as_bytes(flat[untouched_rows]), as_bytes(sentinel.view(-1, lora + rope).to(device)[untouched_rows])))

    batch = 3
    max_blocks = max(4, -(-64 // block_size))
    block_table = torch.randint(0, num_blocks, (batch, max_blocks), generator=generator, dtype=torch.int32).to(device)
    seq_starts = torch.tensor([0, 5, min(17, max_blocks * block_size - 30)], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([min(7, max_blocks * block_size), 0, min(30, max_blocks * block_size - int(seq_starts[2]))], dtype=torch.int32)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq_lens, 0)
    out = torch.full((int(cu[-1]), lora + rope), float("nan"), dtype=torch.float32, device=device)
    gather_cache(cache, block_table, cu.to(device), seq_starts, out, scale, kv_lora_rank=lora)
    pieces = []
    for i in range(batch):
        pos = torch.arange(int(seq_starts[i]), int(seq_starts[i]) + int(seq_lens[i]), device=device)
        rows = cache[block_table[i, pos // block_size].long(), pos % block_size].float()
        pieces.append(rows * (scale if fp8 else 1.0))
    gather_err = float((out - torch.cat(pieces)).abs().max()) if out.numel() else 0.0
    return {"write_exact": write_exact, "untouched": untouched, "gather_err": gather_err,
            "gather_nan": bool(torch.isnan(out).any())}


def _interpreter_main() -> None:
    results = {case[0]: run_case(*case[1:], device="cpu") for case in CASES}
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


def _check(result):
    assert result["write_exact"], result
    assert result["untouched"], result
    assert not result["gather_nan"], result
    assert result["gather_err"] == 0.0, result


@pytest.mark.parametrize("case_id", [case[0] for case in CASES])
def test_cache_ops_interpreter(interpreter_results, case_id):
    _check(interpreter_results[case_id])


def test_concat_and_cache_rejects_int32_slots():
    from mla_multi.kernels.cache_ops import concat_and_cache_mla

    cache = torch.zeros(2, 16, 80, dtype=torch.float16)
    with pytest.raises(ValueError, match="slot_mapping"):
        concat_and_cache_mla(torch.zeros(3, 64), torch.zeros(3, 16), cache, torch.zeros(3, dtype=torch.int32))


def test_fp8_cache_requires_scale():
    from mla_multi.kernels.cache_ops import concat_and_cache_mla

    cache = torch.zeros(2, 16, 80, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale"):
        concat_and_cache_mla(torch.zeros(3, 64), torch.zeros(3, 16), cache, torch.zeros(3, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_cache_ops_gpu(case):
    _check(run_case(*case[1:], device="cuda"))


if __name__ == "__main__":
    _interpreter_main()
