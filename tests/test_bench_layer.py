"""`mla-multi bench layer` on the CPU: the steps it parses, the inputs of its DeepSeek-V3 and DeepSeek-V4 cases
(every slot of the V4 caches written by the formats' writer, each token's top-k its own request's compressed
rows) and one
call of each case's step through the REFERENCE backends against float64 attention written here; the argument
errors before any device is needed. The timing itself runs on a GPU only."""

from __future__ import annotations

import pytest
import torch

from mla_multi import cache_formats
from mla_multi.benchmarks import layer as bench_layer

CPU = torch.device("cpu")


def test_steps_parse_and_bad_ones_name_the_syntax():
    assert bench_layer.parse_step("decode:2x300") == ("decode", [1, 1], [300, 300])
    assert bench_layer.parse_step("mixed:1x70+2x5+10") == ("mixed", [1, 5, 5], [70, 15, 15])
    for text in ("decode:2", "prefill:x", "other:1x2", "decode:"):
        with pytest.raises(ValueError, match="accepted: decode:BxS"):
            bench_layer.parse_step(text)


@pytest.mark.parametrize("name", ["fp8_ds_mla_v4", "fp8_ds_mla_v41", "fp4_ds_mla_v41"])
def test_fill_cache_writes_every_slot_as_the_formats_writer_does(name):
    """Every slot holds a quantised random row (the format's own reader finds each row's values in the
    quantiser's range), written in chunks that do not divide the slots."""
    fmt = cache_formats.get_format(name)
    cache = fmt.allocate(3, 64, CPU, fill=0xFF)  # poisoned: an unwritten slot reads NaN
    torch.manual_seed(0)
    bench_layer.fill_cache(cache, name, torch.float32, chunk=50)
    rows = fmt.read_rows(cache, torch.float64)
    assert rows.shape == (3 * 64, 512) and bool(torch.isfinite(rows).all())
    assert bool((rows.abs().amax(dim=1) > 1).all()) and float(rows.abs().amax()) < 10  # N(0, 1) rows, quantised


def _attention(q, rows, scale, sink=None):
    """float64 attention of q [N, D] over rows [K, D]; with the sink, the output scaled by exp(lse) / (exp(lse) +
    exp(sink))."""
    scores = q.double() @ rows.double().T * scale
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.softmax(scores, dim=-1) @ rows.double()
    return out if sink is None else out * torch.sigmoid(lse - sink.double().unsqueeze(1))


@pytest.mark.parametrize("formats", sorted(bench_layer.V4_FORMATS))
def test_a_v4_decode_case_attends_to_its_requests_rows(formats):
    """The V4 case's step on the CPU: every token's top-k are distinct compressed rows of its own request
    (`topk_length` of them, -1 after), the step's output is float64 V4 attention over the dequantised caches
    (the top-k rows and the token's last `window` positions, the window written by the step)."""
    torch.manual_seed(0)
    topk, window, heads = 16, 8, 2
    layer, metadata, step, tensors = bench_layer.v4_case("decode:2x100", heads, formats, None, None, CPU,
                                                         dtype=torch.float32, topk=topk, window=window)
    assert layer.backends() == {"sparse_decode_v4": "REFERENCE", "sparse_prefill_v4": "REFERENCE"}
    md = metadata()
    layer.plan(md)
    step(md)  # writes the window rows; then the sink set to the first token's LSE, where it halves the output
    indices, lengths, q, kv = (tensors[k] for k in ("topk_indices", "topk_length", "q", "kv"))
    kv_cache, window_cache, table = tensors["kv_cache"], tensors["window_cache"], tensors["block_table"]
    main_fmt = cache_formats.get_format(layer.kv_format)
    window_fmt = cache_formats.get_format(layer.window_kv_format)
    per_request = kv_cache.shape[0] // 2 * kv_cache.shape[1]
    compressed = 100 // bench_layer.V4_RATIO
    rows_of = {}
    assert lengths.tolist() == [min(topk, compressed)] * 2
    for t in range(2):
        picked = indices[t, : lengths[t]].long()
        assert bool((indices[t, lengths[t]:] == -1).all())
        assert picked.unique().numel() == picked.numel()
        assert bool(((picked >= t * per_request) & (picked < t * per_request + compressed)).all())
        slots = torch.tensor([int(table[t, p // bench_layer.BLOCK_SIZE]) * bench_layer.BLOCK_SIZE
                              + p % bench_layer.BLOCK_SIZE for p in range(100 - window, 100)])
        window_rows = window_fmt.read_rows(window_cache, torch.float64, slots)
        # the step wrote the token's own row (position 99) into the window cache, quantised
        written = window_fmt.allocate(1, 64, CPU)
        window_fmt.write_rows(written, torch.tensor([0]), kv[t: t + 1])
        assert torch.equal(window_rows[-1], window_fmt.read_rows(written, torch.float64, torch.tensor([0]))[0])
        rows_of[t] = torch.cat([main_fmt.read_rows(kv_cache, torch.float64, picked), window_rows])
    lse = torch.logsumexp(q[0].double() @ rows_of[0].T * layer.scale, dim=-1)
    layer.attn_sink.data.copy_(lse)
    out = step(md).view(2, heads, 512)
    for t in range(2):
        expected = _attention(q[t], rows_of[t], layer.scale, layer.attn_sink.detach())
        error = float((out[t].double() - expected).norm() / expected.norm())
        assert error < 1e-4, (t, error)


def test_a_v3_case_runs_its_step_on_the_cpu():
    torch.manual_seed(0)
    layer, metadata, step, _ = bench_layer.v3_case("mixed:1x70+1x5+10", 2, None, None, CPU, dtype=torch.float32)
    md = metadata()
    layer.plan(md)
    out = step(md)
    assert out.shape == (6, 2 * 128) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("argv, message", [
    (["--v4", "600"], "argument --v4: invalid choice: '600'"),
    (["--steps", "decode:3"], "step 'decode:3'; accepted: decode:BxS"),
])
def test_bad_arguments_stop_before_any_device(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench_layer.main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
