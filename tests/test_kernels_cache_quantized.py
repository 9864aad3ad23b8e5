"""The quantising cache writer (`kernels/cache_ops.concat_and_cache_quantized`), run by the Triton interpreter.

Every byte format of `mla_multi.cache_formats` (fp8_ds_mla 656, V4 584, V4.1 528, V4.1 FP4 288): the kernel's
bytes against the format's reference quantiser written at the same slots (`CacheFormat.quantize` and
`write_records`), over the whole cache, its block padding included (filled with 7 first: a byte the kernel
must not touch stays 7). Rows spread over six decades, a zero group, a row under the UE8M0 floor, a row of
+-3000; a skipped (negative) slot, a slot past the cache (not written, the SLOT bit set); bf16, fp16 and fp32
rows, rows that are slices of a wider buffer (as `MLAAttentionV4` passes them), blocks of 1, 4 and 5 tokens;
FlashMLA's golden V4 bytes (tests/data); every access inside its tensors (`interpreter.memcheck`); and
`mm.ops.concat_and_cache_mla_v4` routed to the kernel where Triton serves the tensors.
"""

import pytest
import torch

from interpreter import memcheck, print_results, run_interpreter_script

# (case, format, dtype, block_size, rows a slice of a wider buffer)
CASES = [
    ("fp8_ds_mla-bf16", "fp8_ds_mla", torch.bfloat16, 4, False),
    ("v4-bf16", "fp8_ds_mla_v4", torch.bfloat16, 4, False),
    ("v4-fp32-sliced", "fp8_ds_mla_v4", torch.float32, 5, True),
    ("v4-fp16-block1", "fp8_ds_mla_v4", torch.float16, 1, False),
    ("v41-bf16", "fp8_ds_mla_v41", torch.bfloat16, 4, False),
    ("v41-fp32-sliced", "fp8_ds_mla_v41", torch.float32, 4, True),
    ("fp4-bf16", "fp4_ds_mla_v41", torch.bfloat16, 4, False),
    ("fp4-fp32", "fp4_ds_mla_v41", torch.float32, 5, True),
]
FILL = 7


def _rows(generator, tokens, width, dtype):
    decades = torch.logspace(-3, 3, tokens).unsqueeze(1)
    rows = torch.randn(tokens, width, generator=generator) * decades
    rows[1, :64] = 0.0  # a zero group (every format's first group)
    rows[2] = rows[2] * 1e-9  # under the UE8M0 floor (amax / 448 < 1e-4)
    rows[3] = torch.where(torch.rand(width, generator=generator) < 0.5, -3000.0, 3000.0)
    return rows.to(dtype)


def _whole(fmt, cache):
    """The cache's bytes as [num_blocks, block stride] (the padding of every block included)."""
    stride = fmt.block_bytes(cache.shape[1])
    return torch.as_strided(cache, (cache.shape[0], stride), (stride, 1), cache.storage_offset())


def _case(case):
    from mla_multi import cache_formats as cf
    from mla_multi.kernels.cache_ops import concat_and_cache_quantized

    name, fmt_name, dtype, block_size, sliced = case
    fmt = cf.get_format(fmt_name)
    latent = fmt.width - fmt.rope_dims
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    tokens, num_blocks = 7, 3
    rows = _rows(generator, tokens, fmt.width, dtype)
    if sliced:  # rows of a wider buffer: the strides the layer's slices have
        wide = torch.full((tokens, fmt.width + 32), float("nan"), dtype=dtype)
        wide[:, :fmt.width] = rows
        kv_c, k_pe = wide[:, :latent], wide[:, latent:fmt.width]
    else:
        kv_c, k_pe = rows[:, :latent].contiguous(), rows[:, latent:].contiguous()
    num_slots = num_blocks * block_size
    slots = torch.tensor([num_slots - 1, -1, 0, 1, num_slots, 2 if num_slots > 3 else -3, -2][:tokens])
    cache = fmt.allocate(num_blocks, block_size, fill=FILL)
    want = fmt.allocate(num_blocks, block_size, fill=FILL)
    flag = torch.zeros(1, dtype=torch.int32)
    with memcheck() as violations:
        concat_and_cache_quantized(kv_c, k_pe, cache, slots, fmt_name, error_flag=flag)
    kept = (slots >= 0) & (slots < num_slots)
    fmt.write_records(want, slots[kept], fmt.quantize(rows[kept]))
    got, expected = _whole(fmt, cache), _whole(fmt, want)
    differ = (got != expected).nonzero()
    return {"violations": violations, "differ": differ.shape[0], "first": differ[:4].tolist(), "flag": int(flag),
            "written": int(kept.sum())}


def _golden_case():
    """FlashMLA's golden V4 rows (tests/data/fp8_ds_mla_v4.pt) through the kernel: its cache bytes."""
    import pathlib

    from mla_multi import cache_formats as cf
    from mla_multi.kernels.cache_ops import concat_and_cache_quantized

    golden = torch.load(pathlib.Path(__file__).parent / "data" / "fp8_ds_mla_v4.pt", weights_only=True)
    fmt = cf.FP8_DS_MLA_V4
    blocks, block_size = golden["num_blocks"], golden["block_size"]
    cache = fmt.allocate(blocks, block_size, fill=0)
    rows = golden["input_bf16"].reshape(-1, fmt.width)
    with memcheck() as violations:
        concat_and_cache_quantized(rows[:, :448].contiguous(), rows[:, 448:].contiguous(), cache,
                                   torch.arange(blocks * block_size), "fp8_ds_mla_v4",
                                   error_flag=torch.zeros(1, dtype=torch.int32))
    expected = golden["cache_bytes"]
    differ = (_whole(fmt, cache).reshape(expected.shape) != expected).nonzero()
    return {"violations": violations, "differ": differ.shape[0], "first": differ[:4].tolist()}


def _ops_case():
    """`mm.ops.concat_and_cache_mla_v4` under the interpreter takes the kernel (its bound launch is made)."""
    import mla_multi as mm
    from mla_multi import cache_formats as cf
    from mla_multi.kernels import cache_ops

    cache_ops._QUANTIZED_LAUNCHES.clear()
    fmt = cf.FP8_DS_MLA_V4
    rows = torch.randn(3, 512, dtype=torch.bfloat16)
    cache = fmt.allocate(2, 4)
    mm.ops.concat_and_cache_mla_v4(rows[:, :448], rows[:, 448:], cache, torch.tensor([6, 0, 3]))
    want = fmt.allocate(2, 4)
    fmt.write_records(want, torch.tensor([6, 0, 3]), fmt.quantize(rows))
    return {"launches": len(cache_ops._QUANTIZED_LAUNCHES), "equal": torch.equal(_whole(fmt, cache), _whole(fmt, want))}


def _interpreter_main() -> None:
    results = {case[0]: _case(case) for case in CASES}
    results["golden-v4"] = _golden_case()
    results["ops"] = _ops_case()
    print_results(results)


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_script(__file__)


@pytest.mark.parametrize("case", [case[0] for case in CASES])
def test_the_kernel_writes_the_reference_quantisers_bytes(interpreter_results, case):
    from mla_multi import errors

    result = interpreter_results[case]
    assert result["violations"] == [], result
    assert result["differ"] == 0, result
    assert result["flag"] == errors.SLOT, result  # the slot past the cache
    assert result["written"] >= 3


def test_the_kernel_writes_flashmlas_golden_v4_bytes(interpreter_results):
    result = interpreter_results["golden-v4"]
    assert result["violations"] == [] and result["differ"] == 0, result


def test_the_v4_writer_op_takes_the_kernel_where_triton_serves_the_tensors(interpreter_results):
    result = interpreter_results["ops"]
    assert result == {"launches": 1, "equal": True}, result


if __name__ == "__main__":
    _interpreter_main()
