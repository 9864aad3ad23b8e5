"""The ops registered in the ``mla_multi`` torch.library namespace, and `torch.compile` over them.

CPU only (the REFERENCE backend and the PyTorch cache ops run); Inductor
compiles the graphs around the ops with the host C++ compiler, so the shapes
are tiny.  Values are compared with the eager ops (float32 rounding) and with
float64 math; caches start as NaN so that a wrong slot shows.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import mla_multi as mm
from mla_multi import library
from mla_multi.dims import MLADims
from mla_multi.testing import PagedScenario

HEADS, LKV, ROPE, BLOCK = 2, 16, 8, 4
WIDTH = LKV + ROPE
NEG_INF = float("-inf")
FP8 = torch.float8_e4m3fn

# Every utility opcheck has. test_aot_dispatch_static is not among its defaults any more; it is asked for here.
ALL_TEST_UTILS = [
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_same(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """Compiled against eager: equal up to float32 rounding (NaN where the other is NaN)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * max(ref.double().nan_to_num().abs().max().item(), 1e-30),
                               equal_nan=True)


def naive_attention(q, k, v, scale, mask):
    """float64: q [lq, N, D], k [lk, N, D], v [lk, N, Dv], mask [lq, lk] -> out [lq, N, Dv], lse [N, lq]."""
    scores = torch.einsum("qnd,knd->nqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask.unsqueeze(0), NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.where(torch.isfinite(lse).unsqueeze(-1), torch.exp(scores - lse.nan_to_num(neginf=0).unsqueeze(-1)), 0.0)
    return torch.einsum("nqk,knd->qnd", probs, v.double()), lse


# --------------------------------------------------------------------------- inputs


def scenario(seed=0, num_blocks=20):
    dims = MLADims(HEADS, kv_lora_rank=LKV, qk_nope_head_dim=8, qk_rope_head_dim=ROPE, v_head_dim=8)
    return PagedScenario(dims, BLOCK, num_blocks, torch.device("cpu"), torch.float32, seed=seed)


def filled_cache(scene, requests, cache_dtype=torch.float32, max_blocks=7):
    """A NaN-poisoned cache holding `requests`' histories (written eagerly); returns (kv_cache, metadata)."""
    metadata, _, kv_c, k_pe = scene.step(requests, max_blocks=max_blocks)
    kv_cache = torch.full((scene.num_blocks, BLOCK, WIDTH), float("nan")).to(cache_dtype)
    mm.ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, metadata.slot_mapping, scale=1.0 if cache_dtype == FP8 else None)
    return kv_cache, metadata


def decode_reference(scene, requests, q_nope, q_pe, scale):
    """float64 out [B, N, Lkv], lse [B, N] of one decode token per request over its whole history."""
    outs, lses = [], []
    for b, (request, _) in enumerate(requests):
        rows = torch.cat([scene.latent[request], scene.k_pe[request]], dim=-1)  # [S, Lkv + R]
        keys = rows.unsqueeze(1).expand(-1, HEADS, -1)
        query = torch.cat([q_nope[b], q_pe[b]], dim=-1).unsqueeze(0)  # [1, N, Lkv + R]
        out, lse = naive_attention(query, keys, keys[..., :LKV], scale, torch.ones(1, rows.shape[0], dtype=torch.bool))
        outs.append(out[0])
        lses.append(lse[:, 0])
    return torch.stack(outs), torch.stack(lses)


def decode_inputs(batch, seed=0):
    """(scene, decode requests, NaN-poisoned cache holding histories of 3, 8, 13, ... tokens, block_table, seq_lens).

    The block table is 7 wide whatever the batch: sizes that happen to be equal get "duck sized"
    into one symbol by Dynamo, and a batch where they differ would recompile.
    """
    scene = scenario(seed)
    kv_cache, metadata = filled_cache(scene, [(r, 3 + 5 * r) for r in range(batch)])
    return scene, [(r, 1) for r in range(batch)], kv_cache, metadata.block_table, metadata.seq_lens


# --------------------------------------------------------------------------- opcheck


def opcheck_cases():
    gen = torch.Generator().manual_seed(7)
    randn = lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    _, _, kv_cache, table, seq_lens = decode_inputs(3)
    seq_lens[1] = 0
    cases = []
    for dtype in (torch.float32, torch.float16):
        for return_lse in (True, False):
            cases.append(("mla_decode", (randn(3, HEADS, LKV, dtype=dtype), randn(3, HEADS, ROPE, dtype=dtype),
                                         kv_cache.to(dtype), table, seq_lens, 0.3), dict(return_lse=return_lse)))
    cases.append(("mla_decode", (randn(3, 2, HEADS, LKV), randn(3, 2, HEADS, ROPE), kv_cache.to(FP8), table, seq_lens, 0.3),
                  dict(k_scale=torch.tensor([0.5]), return_lse=True, backend="REFERENCE")))
    cu_q, cu_k = torch.tensor([0, 4, 4, 9], dtype=torch.int32), torch.tensor([0, 5, 7, 13], dtype=torch.int32)
    for return_lse, causal in ((True, True), (False, False)):
        cases.append(("mla_prefill", (randn(9, HEADS, 24), randn(13, HEADS, 24), randn(13, HEADS, 16), cu_q, cu_k, 5, 6, 0.2),
                      dict(return_lse=return_lse, causal=causal)))
    lse = randn(HEADS, 5)
    lse[0, 1] = NEG_INF
    cases.append(("merge_attn_states", (randn(5, HEADS, 16), lse, randn(5, HEADS, 16), randn(HEADS, 5)), {}))
    cases.append(("merge_attn_states", (randn(5, HEADS, 16, dtype=torch.float16), randn(HEADS, 5),
                                        randn(5, HEADS, 16, dtype=torch.float16), randn(HEADS, 5)), {}))
    slots = torch.tensor([0, 5, -1, 17, 30])
    cases.append(("concat_and_cache_mla", (randn(5, LKV), randn(5, ROPE), torch.full((8, BLOCK, WIDTH), float("nan")), slots), {}))
    cases.append(("concat_and_cache_mla", (randn(5, LKV), randn(5, ROPE), torch.zeros(8, BLOCK, WIDTH).to(FP8), slots),
                  dict(scale=torch.tensor([0.25]))))
    starts, lens = torch.tensor([0, 0, 2], dtype=torch.int32), torch.tensor([2, 0, 7], dtype=torch.int32)
    cases.append(("gather_cache", (kv_cache, table, starts, lens), {}))
    cases.append(("gather_cache", (kv_cache, table, starts, lens), dict(num_tokens=9, out_dtype=torch.float64)))
    cases.append(("gather_cache", (kv_cache.to(FP8), table, starts, lens), dict(scale=torch.tensor([2.0]))))
    return cases


def opcheck_utils(args, kwargs, name):
    """Every opcheck utility but those that cannot run on the case, each dropped for its reason.

    test_schema runs the op under SchemaCheckMode, which compares inputs before and after with a
    multiplication that the CPU does not implement for float8 ("mul_cpu_reduced_float"): it is
    dropped for the fp8-cache cases; the float32 cases of the same op and schema run it.
    test_aot_dispatch_static traces without a ShapeEnv, where no output can have a size that
    depends on data: it is dropped for gather_cache without num_tokens (torch.compile always has a
    ShapeEnv; test_aot_dispatch_dynamic and the compiled tests below cover that case).
    The inputs do not require grad, so test_autograd_registration checks that the op has no wrong
    autograd registration (the ops have no backward).
    """
    utils = list(ALL_TEST_UTILS)
    if any(torch.is_tensor(a) and a.dtype == FP8 for a in args):
        utils.remove("test_schema")
    if name == "gather_cache" and kwargs.get("num_tokens") is None:
        utils.remove("test_aot_dispatch_static")
    return utils


@pytest.mark.parametrize("case", opcheck_cases(), ids=lambda case: case[0])
def test_opcheck(case):
    name, args, kwargs = case
    op = getattr(torch.ops.mla_multi, name).default
    torch.library.opcheck(op, args, kwargs, test_utils=opcheck_utils(args, kwargs, name))


def test_registered_op_values_match_eager_op():
    _, _, kv_cache, table, seq_lens = decode_inputs(3)
    gen = torch.Generator().manual_seed(1)
    q_nope, q_pe = torch.randn(3, HEADS, LKV, generator=gen), torch.randn(3, HEADS, ROPE, generator=gen)
    out, lse = mm.ops.mla_decode(q_nope, q_pe, kv_cache, table, seq_lens, 0.3, return_lse=True)
    op_out, op_lse = torch.ops.mla_multi.mla_decode(q_nope, q_pe, kv_cache, table, seq_lens, 0.3, return_lse=True)
    assert torch.equal(op_out, out) and torch.equal(op_lse, lse)
    op_out, no_lse = torch.ops.mla_multi.mla_decode(q_nope, q_pe, kv_cache, table, seq_lens, 0.3)
    assert torch.equal(op_out, out) and no_lse.shape == (0,) and no_lse.dtype == torch.float32
    # The fakes promise contiguous outputs; the PyTorch merge lays its output out [N, T, D].
    merge_args = (torch.randn(5, HEADS, 8), torch.randn(HEADS, 5), torch.randn(5, HEADS, 8), torch.randn(HEADS, 5))
    eager_out, eager_lse = mm.ops.merge_attn_states(*merge_args)
    op_out, op_lse = torch.ops.mla_multi.merge_attn_states(*merge_args)
    assert op_out.is_contiguous() and op_lse.is_contiguous()
    assert torch.equal(op_out, eager_out) and torch.equal(op_lse, eager_lse)
    # A kernel run with real tensors inside a compile session calls the eager body, not itself.
    with torch.compiler._compile_session_context():
        assert torch.compiler.is_compiling()
        again, _ = torch.ops.mla_multi.mla_decode(q_nope, q_pe, kv_cache, table, seq_lens, 0.3)
        assert torch.compiler.is_compiling()
    assert torch.equal(again, out)


def test_gather_cache_num_tokens_must_match_the_rows():
    _, _, kv_cache, table, seq_lens = decode_inputs(2)
    starts = torch.zeros(2, dtype=torch.int32)
    rows = int(seq_lens.sum())
    assert torch.ops.mla_multi.gather_cache(kv_cache, table, starts, seq_lens, num_tokens=rows).shape == (rows, WIDTH)
    with pytest.raises(ValueError, match="num_tokens"):
        torch.ops.mla_multi.gather_cache(kv_cache, table, starts, seq_lens, num_tokens=rows + 1)


# --------------------------------------------------------------------------- torch.compile


class RecordingBackend:
    """A torch.compile backend that keeps the FX graphs Dynamo hands it and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [node.target for gm in self.graphs for node in gm.graph.nodes if node.op == "call_function"]


def test_graph_holds_the_ops_as_single_nodes():
    """Dynamo records torch.ops.mla_multi.* and none of the eager bodies (no checks, no reference math)."""
    scene, requests, kv_cache, table, seq_lens = decode_inputs(2)
    gen = torch.Generator().manual_seed(2)
    q_nope, q_pe = torch.randn(2, HEADS, LKV, generator=gen), torch.randn(2, HEADS, ROPE, generator=gen)
    kv_c, k_pe, slots = torch.randn(3, LKV, generator=gen), torch.randn(3, ROPE, generator=gen), torch.tensor([40, 41, -1])

    def fn(q_nope, q_pe, kv_cache, table, seq_lens):
        mm.ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slots)
        out, lse = mm.ops.mla_decode(q_nope, q_pe, kv_cache, table, seq_lens, 0.3, return_lse=True)
        out, lse = out.transpose(0, 1), lse.transpose(0, 1).contiguous()  # [N, B, Lkv], [N, B]: B tokens
        return mm.ops.merge_attn_states(out, lse, out, lse)

    backend = RecordingBackend()
    torch.compile(fn, backend=backend, fullgraph=True)(q_nope, q_pe, kv_cache.clone(), table, seq_lens)
    targets = set(backend.targets())
    ours = {torch.ops.mla_multi.concat_and_cache_mla.default, torch.ops.mla_multi.mla_decode.default,
            torch.ops.mla_multi.merge_attn_states.default}
    packets = {torch.ops.mla_multi.concat_and_cache_mla, torch.ops.mla_multi.mla_decode, torch.ops.mla_multi.merge_attn_states}
    assert len(targets & (ours | packets)) == 3, targets
    # Besides our ops, only the glue of fn: the checks and the reference math stay out of the graph.
    others = {getattr(t, "__name__", str(t)) for t in targets - ours - packets}
    assert others <= {"getitem", "transpose", "contiguous"}, others


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_compiled_decode_matches_eager_and_float64_and_compiles_once_for_two_batch_sizes(mode):
    torch.manual_seed(0)
    lin_q = torch.nn.Linear(12, HEADS * WIDTH)
    lin_o = torch.nn.Linear(HEADS * LKV, 6)
    scale = WIDTH**-0.5

    def fn(x, kv_cache, table, seq_lens):
        q = lin_q(x).view(x.shape[0], HEADS, WIDTH)
        out, lse = mm.ops.mla_decode(q[..., :LKV], q[..., LKV:], kv_cache, table, seq_lens, scale, return_lse=True)
        return lin_o(out.reshape(x.shape[0], HEADS * LKV)), lse

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        for batch in (3, 5):
            scene, requests, kv_cache, table, seq_lens = decode_inputs(batch, seed=batch)
            x = torch.randn(batch, 12)
            y, lse = compiled(x, kv_cache, table, seq_lens)
            y_eager, lse_eager = fn(x, kv_cache, table, seq_lens)
            assert_same(y, y_eager)
            assert_same(lse, lse_eager)
            q = lin_q(x).double().view(batch, HEADS, WIDTH)
            out64, lse64 = decode_reference(scene, requests, q[..., :LKV], q[..., LKV:], scale)
            y64 = torch.nn.functional.linear(out64.reshape(batch, -1), lin_o.weight.double(), lin_o.bias.double())
            assert rel_err(y, y64) < 1e-5
            assert rel_err(lse, lse64) < 1e-5
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compiled_decode_runs_the_data_checks():
    """A bad block-table entry raises ValueError from inside the compiled call, as eagerly."""
    _, _, kv_cache, table, seq_lens = decode_inputs(2)

    def fn(q_nope, q_pe, table):
        return mm.ops.mla_decode(q_nope * 2, q_pe, kv_cache, table, seq_lens, 0.3)

    compiled = torch.compile(fn, fullgraph=True)
    q_nope, q_pe = torch.randn(2, HEADS, LKV), torch.randn(2, HEADS, ROPE)
    assert_same(compiled(q_nope, q_pe, table), fn(q_nope, q_pe, table))
    bad = table.clone()
    bad[1, 0] = kv_cache.shape[0] + 3
    with pytest.raises(ValueError, match=r"block_table\[1\]"):
        compiled(q_nope, q_pe, bad)
    assert counters["stats"]["unique_graphs"] == 1


def varlen_reference(q, k, v, cu_q, cu_k, scale):
    out = torch.zeros(q.shape[0], HEADS, v.shape[-1], dtype=torch.float64)
    lse = torch.full((HEADS, q.shape[0]), NEG_INF, dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        lq, lk = q1 - q0, k1 - k0
        mask = torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + (lk - lq)
        out[q0:q1], lse[:, q0:q1] = naive_attention(q[q0:q1], k[k0:k1], v[k0:k1], scale, mask)
    return out, lse


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_compiled_prefill_matches_eager_and_float64(mode):
    torch.manual_seed(1)
    lin_q, lin_kv = torch.nn.Linear(10, HEADS * 24), torch.nn.Linear(10, HEADS * 40)
    lin_o = torch.nn.Linear(HEADS * 16, 5)
    lens_q, lens_k = [3, 0, 5], [3, 4, 9]
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 7, 16], dtype=torch.int32)
    scale = 24**-0.5

    def fn(xq, xk):
        q = lin_q(xq).view(-1, HEADS, 24)
        k, v = lin_kv(xk).view(-1, HEADS, 40).split([24, 16], dim=-1)
        out, lse = mm.ops.mla_prefill(q, k, v.contiguous(), cu_q, cu_k, max(lens_q), max(lens_k), scale, return_lse=True)
        return lin_o(out.reshape(-1, HEADS * 16)), lse

    xq, xk = torch.randn(8, 10), torch.randn(16, 10)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        y, lse = torch.compile(fn, fullgraph=True)(xq, xk)
        y_eager, lse_eager = fn(xq, xk)
        q = lin_q(xq).double().view(-1, HEADS, 24)
        k, v = lin_kv(xk).double().view(-1, HEADS, 40).split([24, 16], dim=-1)
        out64, lse64 = varlen_reference(q, k, v, cu_q.tolist(), cu_k.tolist(), scale)
        y64 = torch.nn.functional.linear(out64.reshape(-1, HEADS * 16), lin_o.weight.double(), lin_o.bias.double())
    assert_same(y, y_eager)
    assert_same(lse, lse_eager)
    assert rel_err(y, y64) < 1e-5
    assert rel_err(lse, lse64) < 1e-5


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_compiled_cache_write_and_gather_match_eager(mode):
    """concat_and_cache_mla mutates the caches (fp8 with a float scale too); gather_cache sizes its output from data."""
    torch.manual_seed(2)
    lin_c, lin_o = torch.nn.Linear(7, WIDTH), torch.nn.Linear(WIDTH, 3)
    table = torch.tensor([[5, 2, 0], [7, 1, 3]], dtype=torch.int32)
    # Block 5 positions 1-3 and all of block 7 (so every gathered row is written or was there), one row
    # of block 1 written over, one token skipped.
    slots = torch.tensor([21, 22, -1, 23, 28, 29, 30, 31, 6], dtype=torch.int64)
    starts, lens = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([3, 7], dtype=torch.int32)

    def fn(x, kv_cache, fp8_cache):
        rows = lin_c(x)
        mm.ops.concat_and_cache_mla(rows[:, :LKV], rows[:, LKV:], kv_cache, slots)
        mm.ops.concat_and_cache_mla(rows[:, :LKV], rows[:, LKV:], fp8_cache, slots, scale=0.5)
        gathered = mm.ops.gather_cache(kv_cache, table, starts, lens)  # rows known only at run time
        dequantised = mm.ops.gather_cache(fp8_cache, table, starts, lens, scale=0.5, out_dtype=torch.float32, num_tokens=10)
        return lin_o(gathered), dequantised

    def caches():
        kv_cache = torch.full((8, BLOCK, WIDTH), float("nan"))
        kv_cache[[2, 1, 3]] = torch.randn(3, BLOCK, WIDTH, generator=torch.Generator().manual_seed(5))  # written earlier
        return kv_cache, kv_cache.nan_to_num(0.0).to(FP8)

    x = torch.randn(9, 7)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        kv_cache, fp8_cache = caches()
        y, dequantised = torch.compile(fn, fullgraph=True)(x, kv_cache, fp8_cache)
        kv_eager, fp8_eager = caches()
        y_eager, dequantised_eager = fn(x, kv_eager, fp8_eager)
        rows = lin_c(x).double()
    torch.testing.assert_close(kv_cache, kv_eager, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert torch.equal(fp8_cache.view(torch.uint8), fp8_eager.view(torch.uint8))
    assert_same(y, y_eager)
    assert_same(dequantised, dequantised_eager)
    # The written rows, in float64: slot s of the cache holds rows[token of s].
    flat = kv_cache.view(-1, WIDTH)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert rel_err(flat[slot], rows[token]) < 1e-6
    expected = torch.cat([flat[21:24], flat[28:32], flat[4:7]])  # request 0: block 5 from 1; request 1: blocks 7, 1
    y64 = torch.nn.functional.linear(expected.double(), lin_o.weight.double(), lin_o.bias.double())
    assert rel_err(y, y64) < 1e-5


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_compiled_merge_matches_eager_and_float64(mode):
    """In grad mode too (parameters requiring grad): the forward runs; no gradient flows through the op."""
    torch.manual_seed(3)
    lin_a, lin_b, lin_o = torch.nn.Linear(6, HEADS * 8), torch.nn.Linear(6, HEADS * 8), torch.nn.Linear(HEADS * 8, 4)
    lse_a, lse_b = torch.randn(HEADS, 5), torch.randn(HEADS, 5)
    lse_b[1, 2] = NEG_INF

    def fn(x):
        a, b = lin_a(x).view(-1, HEADS, 8), lin_b(x).view(-1, HEADS, 8)
        out, lse = mm.ops.merge_attn_states(a, lse_a, b, lse_b)
        return lin_o(out.reshape(-1, HEADS * 8)), lse

    x = torch.randn(5, 6)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": contextlib.nullcontext}[mode]
    with context():
        y, lse = torch.compile(fn, fullgraph=True)(x)
        y_eager, lse_eager = fn(x)
        a, b = lin_a(x).double().view(-1, HEADS, 8), lin_b(x).double().view(-1, HEADS, 8)
    lse64 = torch.logaddexp(lse_a.double(), lse_b.double())
    wa, wb = (lse_a.double() - lse64).exp().T.unsqueeze(-1), (lse_b.double() - lse64).exp().T.unsqueeze(-1)
    y64 = torch.nn.functional.linear((wa * a + wb * b).reshape(-1, HEADS * 8), lin_o.weight.double(), lin_o.bias.double())
    assert_same(y, y_eager)
    assert_same(lse, lse_eager)
    assert rel_err(y, y64) < 1e-5
    assert rel_err(lse, lse64) < 1e-6


def test_schemas_declare_the_mutation_and_the_scale_tensors():
    schema = torch.ops.mla_multi.concat_and_cache_mla.default._schema
    kv_cache = next(a for a in schema.arguments if a.name == "kv_cache")
    assert kv_cache.alias_info is not None and kv_cache.alias_info.is_write
    assert not any(a.alias_info is not None for a in schema.arguments if a.name != "kv_cache")
    assert schema.returns == []
    for name, arg_name in (("mla_decode", "k_scale"), ("concat_and_cache_mla", "scale"), ("gather_cache", "scale")):
        arg = next(a for a in getattr(torch.ops.mla_multi, name).default._schema.arguments if a.name == arg_name)
        assert str(arg.type) == "Optional[Tensor]", (name, arg_name, arg.type)
    assert set(library.SCHEMAS) == {"mla_decode", "mla_prefill", "merge_attn_states", "concat_and_cache_mla", "gather_cache",
                                    "mla_sparse_decode", "mla_sparse_prefill", "mla_sparse_decode_v4",
                                    "mla_sparse_prefill_v4", "concat_and_cache_mla_v4"}
    schema = torch.ops.mla_multi.concat_and_cache_mla_v4.default._schema
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == ["kv_cache"]
