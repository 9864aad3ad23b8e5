"""The public functional ops: argument checks, data checks, and values against float64 math."""

from __future__ import annotations

import random
import re

import pytest
import torch

import mla_multi as mm
from mla_multi import checks
from mla_multi.registry import UnknownBackendError

NEG_INF = float("-inf")
KV_LORA_RANK, ROPE, HEADS, BLOCK_SIZE = 32, 8, 4, 16
WIDTH = KV_LORA_RANK + ROPE


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def naive_attention(q, k, v, scale, mask=None):
    """float64: q [lq, N, D], k [lk, N, D], v [lk, N, Dv], mask [lq, lk] -> out [lq, N, Dv], lse [N, lq]."""
    scores = torch.einsum("qnd,knd->nqk", q.double(), k.double()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(0), NEG_INF)
    if scores.shape[-1] == 0:
        return torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64), torch.full(scores.shape[:2], NEG_INF, dtype=torch.float64)
    row_max = scores.amax(dim=-1, keepdim=True)
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - shift)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("nqk,knd->qnd", weights / torch.where(total > 0, total, torch.ones_like(total)), v.double())
    lse = torch.where(total > 0, shift + torch.log(total), torch.full_like(total, NEG_INF)).squeeze(-1)
    return out, lse


def cu(lengths) -> torch.Tensor:
    values = [0]
    for length in lengths:
        values.append(values[-1] + length)
    return torch.tensor(values, dtype=torch.int32)


# --------------------------------------------------------------------------- valid inputs


def paged(seq_lens, dtype=torch.float32, seed=0, k_scale=1.0):
    """Cache [num_blocks, BLOCK_SIZE, WIDTH] with shuffled blocks; rows[b] float64 as stored (dequantised)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(needed) + 2
    order = list(range(num_blocks))
    rng.shuffle(order)
    kv_cache = torch.full((num_blocks, BLOCK_SIZE, WIDTH), float("nan")).to(dtype)
    table = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int32)
    rows = []
    for b, (length, count) in enumerate(zip(seq_lens, needed)):
        blocks = [order.pop() for _ in range(count)]
        table[b, :count] = torch.tensor(blocks, dtype=torch.int32)
        stored = (torch.randn(length, WIDTH, generator=gen, dtype=torch.float64) / k_scale).to(dtype)
        for position in range(length):
            kv_cache[blocks[position // BLOCK_SIZE], position % BLOCK_SIZE] = stored[position]
        rows.append(stored.double() * k_scale)
    return kv_cache, table, rows


def decode_args(dtype=torch.float32, kv_dtype=None, q_len=None, seed=0):
    seq_lens = [5, 20, 0, 33]
    k_scale = 0.05 if kv_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else 1.0
    kv_cache, table, rows = paged(seq_lens, kv_dtype or dtype, seed, k_scale)
    gen = torch.Generator().manual_seed(seed + 1)
    lead = (len(seq_lens),) if q_len is None else (len(seq_lens), q_len)
    args = dict(
        q_nope=torch.randn(*lead, HEADS, KV_LORA_RANK, generator=gen).to(dtype),
        q_pe=torch.randn(*lead, HEADS, ROPE, generator=gen).to(dtype),
        kv_cache=kv_cache,
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        scale=WIDTH**-0.5,
    )
    if k_scale != 1.0:
        args["k_scale"] = k_scale
    return args, rows


def decode_expected(args, rows):
    q_nope, q_pe, scale = args["q_nope"], args["q_pe"], args["scale"]
    single = q_nope.dim() == 3
    if single:
        q_nope, q_pe = q_nope.unsqueeze(1), q_pe.unsqueeze(1)
    batch, q_len = q_nope.shape[:2]
    out = torch.zeros(batch, q_len, HEADS, KV_LORA_RANK, dtype=torch.float64)
    lse = torch.full((batch, q_len, HEADS), NEG_INF, dtype=torch.float64)
    query = torch.cat([q_nope, q_pe], dim=-1)
    for b, seq_rows in enumerate(rows):
        length = seq_rows.shape[0]
        if length == 0:
            continue
        mask = torch.arange(length).unsqueeze(0) < (length - q_len + 1 + torch.arange(q_len)).unsqueeze(1)
        keys = seq_rows.unsqueeze(1).expand(length, HEADS, WIDTH)
        o, l = naive_attention(query[b], keys, keys[..., :KV_LORA_RANK], scale, mask)
        out[b], lse[b] = o, l.transpose(0, 1)
    return (out.squeeze(1), lse.squeeze(1)) if single else (out, lse)


PREFILL_Q, PREFILL_K = [3, 0, 6, 2], [3, 2, 10, 7]


def prefill_args(dtype=torch.float32, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(sum(PREFILL_Q), HEADS, 24, generator=gen).to(dtype),
        k=torch.randn(sum(PREFILL_K), HEADS, 24, generator=gen).to(dtype),
        v=torch.randn(sum(PREFILL_K), HEADS, 16, generator=gen).to(dtype),
        cu_seqlens_q=cu(PREFILL_Q),
        cu_seqlens_k=cu(PREFILL_K),
        max_seqlen_q=max(PREFILL_Q),
        max_seqlen_k=max(PREFILL_K),
        scale=24**-0.5,
    )


def merge_args(dtype=torch.float32, seed=3):
    gen = torch.Generator().manual_seed(seed)
    tokens = 5
    return dict(
        prefix_output=torch.randn(tokens, HEADS, 16, generator=gen).to(dtype),
        prefix_lse=torch.randn(HEADS, tokens, generator=gen),
        suffix_output=torch.randn(tokens, HEADS, 16, generator=gen).to(dtype),
        suffix_lse=torch.randn(HEADS, tokens, generator=gen),
    )


def concat_args(cache_dtype=torch.float32, seed=4):
    gen = torch.Generator().manual_seed(seed)
    tokens = 6
    args = dict(
        kv_c=torch.randn(tokens, KV_LORA_RANK, generator=gen),
        k_pe=torch.randn(tokens, ROPE, generator=gen),
        kv_cache=torch.full((4, BLOCK_SIZE, WIDTH), float("nan")).to(cache_dtype),
        slot_mapping=torch.tensor([5, -1, 17, 63, 0, 40], dtype=torch.int64),
    )
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        args["scale"] = 0.1
    return args


def gather_args(cache_dtype=torch.float32, seed=5):
    k_scale = 0.05 if cache_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else 1.0
    kv_cache, table, rows = paged([20, 40, 3], cache_dtype, seed, k_scale)
    args = dict(kv_cache=kv_cache, block_table=table, seq_starts=torch.tensor([4, 16, 0]), seq_lens=torch.tensor([16, 24, 3]))
    if k_scale != 1.0:
        args["scale"] = k_scale
    return args, rows


def run_op(op: str, args: dict):
    return getattr(mm.ops, op)(**args)


def valid_args(op: str) -> dict:
    return {
        "mla_decode": lambda: decode_args()[0],
        "mla_prefill": prefill_args,
        "merge_attn_states": merge_args,
        "concat_and_cache_mla": concat_args,
        "gather_cache": lambda: gather_args()[0],
    }[op]()


# --------------------------------------------------------------------------- argument checks


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    view = wide[..., ::2]
    view.copy_(t)
    assert view.stride(-1) == 2
    return view


def to_meta(t):
    return t.to("meta")


def with_dtype(dtype):
    return lambda t: t.to(dtype)


def drop_last(dim):
    return lambda t: t.narrow(dim, 0, t.shape[dim] - 1).contiguous()


def unsqueeze(t):
    return t.unsqueeze(0)


def first(t):
    return t[0]


def const(value):
    return lambda _: value


# (op, argument, kind of mistake, mutation of that argument) -> ValueError naming the argument
ARGUMENT_CASES = [
    # mla_decode
    ("mla_decode", "q_nope", "rank", lambda t: t.unsqueeze(0).unsqueeze(0)),
    ("mla_decode", "q_nope", "rank", first),
    ("mla_decode", "q_nope", "dtype", with_dtype(torch.int32)),
    ("mla_decode", "q_nope", "noncontiguous", noncontiguous),
    ("mla_decode", "q_pe", "rank", first),
    ("mla_decode", "q_pe", "dtype", with_dtype(torch.float64)),
    ("mla_decode", "q_pe", "shape", drop_last(0)),
    ("mla_decode", "q_pe", "shape", drop_last(1)),
    ("mla_decode", "q_pe", "device", to_meta),
    ("mla_decode", "q_pe", "noncontiguous", noncontiguous),
    ("mla_decode", "kv_cache", "rank", first),
    ("mla_decode", "kv_cache", "dtype", with_dtype(torch.int8)),
    ("mla_decode", "kv_cache", "shape", drop_last(2)),
    ("mla_decode", "kv_cache", "device", to_meta),
    ("mla_decode", "kv_cache", "noncontiguous", noncontiguous),
    ("mla_decode", "block_table", "index dtype", with_dtype(torch.int64)),
    ("mla_decode", "block_table", "dtype", with_dtype(torch.float32)),
    ("mla_decode", "block_table", "rank", first),
    ("mla_decode", "block_table", "shape", drop_last(0)),
    ("mla_decode", "block_table", "device", to_meta),
    ("mla_decode", "block_table", "noncontiguous", noncontiguous),
    ("mla_decode", "seq_lens", "index dtype", with_dtype(torch.float32)),
    ("mla_decode", "seq_lens", "index dtype", with_dtype(torch.int16)),
    ("mla_decode", "seq_lens", "rank", unsqueeze),
    ("mla_decode", "seq_lens", "shape", drop_last(0)),
    ("mla_decode", "seq_lens", "device", to_meta),
    ("mla_decode", "seq_lens", "noncontiguous", noncontiguous),
    ("mla_decode", "scale", "value", const(0.0)),
    ("mla_decode", "scale", "value", const(-1.0)),
    ("mla_decode", "scale", "value", const("0.1")),
    ("mla_decode", "scale", "value", const(True)),
    ("mla_decode", "scale", "value", const(None)),
    ("mla_decode", "k_scale", "value", const(torch.tensor([0.1, 0.2]))),
    ("mla_decode", "k_scale", "value", const(torch.tensor([1], dtype=torch.int32))),
    ("mla_decode", "k_scale", "value", const(-0.5)),
    ("mla_decode", "num_kv_splits", "value", const(0)),
    ("mla_decode", "num_kv_splits", "value", const(2.5)),
    ("mla_decode", "num_kv_splits", "value", const(True)),
    # mla_prefill
    ("mla_prefill", "q", "rank", first),
    ("mla_prefill", "q", "dtype", with_dtype(torch.int32)),
    ("mla_prefill", "q", "noncontiguous", noncontiguous),
    ("mla_prefill", "k", "rank", first),
    ("mla_prefill", "k", "dtype", with_dtype(torch.float64)),
    ("mla_prefill", "k", "shape", drop_last(2)),
    ("mla_prefill", "k", "shape", drop_last(1)),
    ("mla_prefill", "k", "device", to_meta),
    ("mla_prefill", "k", "noncontiguous", noncontiguous),
    ("mla_prefill", "v", "dtype", with_dtype(torch.float16)),
    ("mla_prefill", "v", "shape", drop_last(0)),
    ("mla_prefill", "v", "shape", drop_last(1)),
    ("mla_prefill", "v", "device", to_meta),
    ("mla_prefill", "v", "noncontiguous", noncontiguous),
    ("mla_prefill", "cu_seqlens_q", "index dtype", with_dtype(torch.int16)),
    ("mla_prefill", "cu_seqlens_q", "index dtype", with_dtype(torch.float32)),
    ("mla_prefill", "cu_seqlens_q", "rank", unsqueeze),
    ("mla_prefill", "cu_seqlens_q", "device", to_meta),
    ("mla_prefill", "cu_seqlens_q", "noncontiguous", noncontiguous),
    ("mla_prefill", "cu_seqlens_k", "index dtype", with_dtype(torch.int16)),
    ("mla_prefill", "cu_seqlens_k", "shape", drop_last(0)),
    ("mla_prefill", "cu_seqlens_k", "device", to_meta),
    ("mla_prefill", "max_seqlen_q", "value", const(-1)),
    ("mla_prefill", "max_seqlen_q", "value", const(2.5)),
    ("mla_prefill", "max_seqlen_k", "value", const(-3)),
    ("mla_prefill", "scale", "value", const(0)),
    # merge_attn_states
    ("merge_attn_states", "prefix_output", "rank", first),
    ("merge_attn_states", "prefix_output", "dtype", with_dtype(torch.int32)),
    ("merge_attn_states", "prefix_output", "noncontiguous", noncontiguous),
    ("merge_attn_states", "suffix_output", "dtype", with_dtype(torch.float64)),
    ("merge_attn_states", "suffix_output", "shape", drop_last(0)),
    ("merge_attn_states", "suffix_output", "shape", drop_last(2)),
    ("merge_attn_states", "suffix_output", "device", to_meta),
    ("merge_attn_states", "suffix_output", "noncontiguous", noncontiguous),
    ("merge_attn_states", "prefix_lse", "dtype", with_dtype(torch.float16)),
    ("merge_attn_states", "prefix_lse", "shape", lambda t: t.t().contiguous()),
    ("merge_attn_states", "prefix_lse", "rank", first),
    ("merge_attn_states", "prefix_lse", "device", to_meta),
    ("merge_attn_states", "suffix_lse", "dtype", with_dtype(torch.float64)),
    ("merge_attn_states", "suffix_lse", "shape", drop_last(1)),
    ("merge_attn_states", "suffix_lse", "device", to_meta),
    ("merge_attn_states", "suffix_lse", "noncontiguous", noncontiguous),
    # concat_and_cache_mla
    ("concat_and_cache_mla", "kv_c", "rank", unsqueeze),
    ("concat_and_cache_mla", "kv_c", "dtype", with_dtype(torch.int32)),
    ("concat_and_cache_mla", "kv_c", "noncontiguous", noncontiguous),
    ("concat_and_cache_mla", "k_pe", "dtype", with_dtype(torch.bfloat16)),
    ("concat_and_cache_mla", "k_pe", "shape", drop_last(0)),
    ("concat_and_cache_mla", "k_pe", "device", to_meta),
    ("concat_and_cache_mla", "k_pe", "noncontiguous", noncontiguous),
    ("concat_and_cache_mla", "kv_cache", "rank", first),
    ("concat_and_cache_mla", "kv_cache", "dtype", with_dtype(torch.int16)),
    ("concat_and_cache_mla", "kv_cache", "shape", drop_last(2)),
    ("concat_and_cache_mla", "kv_cache", "device", to_meta),
    ("concat_and_cache_mla", "kv_cache", "noncontiguous", noncontiguous),
    ("concat_and_cache_mla", "kv_cache", "not contiguous", lambda t: torch.cat([t, t])[::2]),
    ("concat_and_cache_mla", "slot_mapping", "index dtype", with_dtype(torch.float32)),
    ("concat_and_cache_mla", "slot_mapping", "index dtype", with_dtype(torch.int16)),
    ("concat_and_cache_mla", "slot_mapping", "rank", unsqueeze),
    ("concat_and_cache_mla", "slot_mapping", "shape", drop_last(0)),
    ("concat_and_cache_mla", "slot_mapping", "device", to_meta),
    ("concat_and_cache_mla", "slot_mapping", "noncontiguous", noncontiguous),
    ("concat_and_cache_mla", "scale", "value", const("1")),
    # gather_cache
    ("gather_cache", "kv_cache", "rank", first),
    ("gather_cache", "kv_cache", "dtype", with_dtype(torch.int32)),
    ("gather_cache", "kv_cache", "noncontiguous", noncontiguous),
    ("gather_cache", "block_table", "index dtype", with_dtype(torch.int64)),
    ("gather_cache", "block_table", "rank", first),
    ("gather_cache", "block_table", "device", to_meta),
    ("gather_cache", "block_table", "noncontiguous", noncontiguous),
    ("gather_cache", "seq_starts", "index dtype", with_dtype(torch.float32)),
    ("gather_cache", "seq_starts", "shape", drop_last(0)),
    ("gather_cache", "seq_starts", "device", to_meta),
    ("gather_cache", "seq_lens", "index dtype", with_dtype(torch.float64)),
    ("gather_cache", "seq_lens", "shape", drop_last(0)),
    ("gather_cache", "seq_lens", "rank", unsqueeze),
    ("gather_cache", "seq_lens", "device", to_meta),
    ("gather_cache", "out_dtype", "value", const(torch.int32)),
]


def case_id(case):
    op, argument, kind, _ = case
    return f"{op}-{argument}-{kind.replace(' ', '_')}"


def assert_names_argument(error: ValueError, argument: str) -> None:
    message = str(error)
    assert re.match(rf"{re.escape(argument)}[ =\[]", message), message
    assert "accepted" in message or "must be" in message, message


@pytest.mark.parametrize("op", ["mla_decode", "mla_prefill", "merge_attn_states", "concat_and_cache_mla", "gather_cache"])
def test_valid_arguments_pass(op):
    # The control of ARGUMENT_CASES: without the mutation each op runs.
    run_op(op, valid_args(op))


@pytest.mark.parametrize("case", ARGUMENT_CASES, ids=[case_id(c) for c in ARGUMENT_CASES])
def test_bad_argument_raises_naming_it(case):
    op, argument, _, mutate = case
    args = valid_args(op)
    args[argument] = mutate(args.get(argument))
    before = args["kv_cache"].clone() if op == "concat_and_cache_mla" and args["kv_cache"].device.type == "cpu" else None
    with pytest.raises(ValueError) as info:
        run_op(op, args)
    assert_names_argument(info.value, argument)
    if before is not None:
        assert torch.equal(args["kv_cache"].contiguous().view(torch.uint8), before.contiguous().view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=str)
def test_fp8_cache_without_scale(fp8_dtype):
    args, _ = decode_args(kv_dtype=fp8_dtype)
    del args["k_scale"]
    with pytest.raises(ValueError) as info:
        mm.ops.mla_decode(**args)
    assert_names_argument(info.value, "k_scale")
    assert "fp8" in str(info.value)
    args = concat_args(fp8_dtype)
    del args["scale"]
    before = args["kv_cache"].clone()
    with pytest.raises(ValueError) as info:
        mm.ops.concat_and_cache_mla(**args)
    assert_names_argument(info.value, "scale")
    assert torch.equal(args["kv_cache"].view(torch.uint8), before.view(torch.uint8))
    args, _ = gather_args(fp8_dtype)
    del args["scale"]
    with pytest.raises(ValueError) as info:
        mm.ops.gather_cache(**args)
    assert_names_argument(info.value, "scale")


def test_non_tensor_arguments():
    args = decode_args()[0]
    args["block_table"] = args["block_table"].tolist()
    with pytest.raises(ValueError) as info:
        mm.ops.mla_decode(**args)
    assert_names_argument(info.value, "block_table")


# --------------------------------------------------------------------------- data checks


@pytest.fixture
def data_checks(monkeypatch):
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "1")


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda a: a["block_table"].__setitem__((1, 0), a["kv_cache"].shape[0]), "block_table[1]"),
        (lambda a: a["block_table"].__setitem__((3, 2), -1), "block_table[3]"),
        (lambda a: a["seq_lens"].__setitem__(0, a["block_table"].shape[1] * BLOCK_SIZE + 1), "seq_lens="),
        (lambda a: a["seq_lens"].__setitem__(2, -1), "seq_lens="),
    ],
    ids=["block_past_cache", "negative_block", "seq_len_past_table", "negative_seq_len"],
)
def test_decode_data_checks(data_checks, mutate, fragment):
    args, _ = decode_args()
    mutate(args)
    with pytest.raises(ValueError) as info:
        mm.ops.mla_decode(**args)
    assert str(info.value).startswith(fragment)
    assert "accepted" in str(info.value)


def test_decode_unused_table_entries_may_hold_anything(data_checks):
    args, rows = decode_args()
    # Entries past each sequence's blocks are padding and are not checked or read.
    args["block_table"][0, 1:] = -7
    args["block_table"][2, :] = 10**6  # seq_len 0
    out = mm.ops.mla_decode(**args)
    assert rel_err(out, decode_expected(args, rows)[0]) < 1e-5


@pytest.mark.parametrize("bad_slot", [64, 10**9], ids=["one_past", "far"])
def test_concat_slot_out_of_range_writes_nothing(data_checks, bad_slot):
    args = concat_args()
    args["kv_cache"][0, 0] = 1.0  # partly poisoned: NaN elsewhere
    args["slot_mapping"][3] = bad_slot
    before = args["kv_cache"].clone()
    with pytest.raises(ValueError) as info:
        mm.ops.concat_and_cache_mla(**args)
    assert str(info.value).startswith("slot_mapping") and str(bad_slot) in str(info.value)
    assert torch.equal(args["kv_cache"].view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda a: a["seq_starts"].__setitem__(0, a["block_table"].shape[1] * BLOCK_SIZE), "seq_"),
        (lambda a: a["block_table"].__setitem__((1, 1), a["kv_cache"].shape[0] + 3), "block_table[1]"),
    ],
    ids=["range_past_table", "block_past_cache"],
)
def test_gather_data_checks(data_checks, mutate, fragment):
    args, _ = gather_args()
    mutate(args)
    with pytest.raises(ValueError) as info:
        mm.ops.gather_cache(**args)
    assert str(info.value).startswith(fragment)


@pytest.mark.parametrize("argument, value", [("seq_starts", -4), ("seq_lens", -3)])
def test_gather_negative_starts_or_lengths(data_checks, argument, value):
    args, _ = gather_args()
    # Request 0 covers positions 4..19; a negative start keeps start + length inside the table.
    args[argument][0] = value
    with pytest.raises(ValueError) as info:
        mm.ops.gather_cache(**args)
    assert_names_argument(info.value, argument)


@pytest.mark.parametrize(
    "argument, values",
    [("cu_seqlens_q", [1, 3, 3, 9, 11]), ("cu_seqlens_q", [0, 3, 2, 9, 11]), ("cu_seqlens_q", [0, 3, 3, 9, 12]),
     ("cu_seqlens_k", [0, 3, 5, 15, 23])],
    ids=["not_from_zero", "decreasing", "past_q", "past_k"],
)
def test_prefill_data_checks(data_checks, argument, values):
    args = prefill_args()
    args[argument] = torch.tensor(values, dtype=torch.int32)
    with pytest.raises(ValueError) as info:
        mm.ops.mla_prefill(**args)
    assert_names_argument(info.value, argument)


@pytest.mark.parametrize("variable", ["0", "1"])
def test_data_checks_always_run_on_the_cpu(monkeypatch, variable):
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", variable)
    table = torch.tensor([[5]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):
        checks.check_block_table_data(table, torch.tensor([3]), num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="slot_mapping"):
        checks.check_slot_data(torch.tensor([100]), num_slots=8)
    with pytest.raises(ValueError, match="seq_lens"):
        checks.check_non_negative_data("seq_lens", torch.tensor([-1]))
    assert checks.data_checks_enabled(torch.device("cpu"))


def test_data_checks_on_devices_follow_the_variable(monkeypatch):
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "0")
    assert not checks.data_checks_enabled(torch.device("cuda", 0))
    assert not checks.data_checks_enabled(None)
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "1")
    assert checks.data_checks_enabled(torch.device("cuda", 0))


@pytest.mark.parametrize(
    "op, mutate, fragment",
    [
        ("mla_decode", lambda a: a["block_table"].__setitem__((1, 0), a["kv_cache"].shape[0]), "block_table[1]"),
        ("mla_decode", lambda a: a["seq_lens"].__setitem__(1, 97), "seq_lens="),
        ("mla_prefill", lambda a: a.__setitem__("cu_seqlens_q", cu([1, 2, 6, 2]) + 1), "cu_seqlens_q"),
        ("mla_prefill", lambda a: a.__setitem__("max_seqlen_q", 2), "max_seqlen_q"),
        ("concat_and_cache_mla", lambda a: a["slot_mapping"].__setitem__(0, 64), "slot_mapping"),
        ("gather_cache", lambda a: a["block_table"].__setitem__((1, 1), 99), "block_table[1]"),
        ("gather_cache", lambda a: a["seq_lens"].__setitem__(2, -1), "seq_lens"),
    ],
    ids=["decode-block", "decode-seq-len", "prefill-cu-seqlens", "prefill-max-seqlen", "concat-slot", "gather-block",
         "gather-negative-length"],
)
def test_bad_data_on_the_cpu_is_a_value_error_without_the_variable(monkeypatch, op, mutate, fragment):
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "0")
    args = valid_args(op)
    mutate(args)
    with pytest.raises(ValueError, match="accepted") as info:
        run_op(op, args)
    assert fragment in str(info.value)


# --------------------------------------------------------------------------- values


@pytest.fixture
def no_forced_env(monkeypatch):
    for name in ("MLA_MULTI_PREFILL_BACKEND", "MLA_MULTI_DECODE_BACKEND"):
        monkeypatch.delenv(name, raising=False)


BACKENDS = [None, "REFERENCE", "reference"]


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mla_decode_values(no_forced_env, data_checks, backend, dtype):
    args, rows = decode_args(dtype)
    expected_out, expected_lse = decode_expected(args, rows)
    out = mm.ops.mla_decode(**args, backend=backend)
    assert torch.is_tensor(out) and out.shape == (4, HEADS, KV_LORA_RANK) and out.dtype == dtype
    out, lse = mm.ops.mla_decode(**args, backend=backend, return_lse=True, num_kv_splits=3)
    assert lse.shape == (4, HEADS) and lse.dtype == torch.float32
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    keep = torch.tensor([True, True, False, True])
    assert rel_err(out[keep], expected_out[keep]) < tolerance
    assert rel_err(lse[keep], expected_lse[keep]) < 1e-5
    assert torch.equal(out[2], torch.zeros_like(out[2])) and (lse[2] == NEG_INF).all()


def test_mla_decode_multi_token_and_int64_seq_lens(no_forced_env, data_checks):
    args, rows = decode_args(q_len=3)
    args["seq_lens"] = args["seq_lens"].long()
    out, lse = mm.ops.mla_decode(**args, return_lse=True)
    expected_out, expected_lse = decode_expected(args, rows)
    assert out.shape == (4, 3, HEADS, KV_LORA_RANK) and lse.shape == (4, 3, HEADS)
    assert rel_err(out, expected_out) < 1e-5
    finite = torch.isfinite(expected_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert rel_err(lse[finite], expected_lse[finite]) < 1e-5


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=str)
@pytest.mark.parametrize("backend", [None, "REFERENCE"], ids=str)
def test_mla_decode_fp8(no_forced_env, data_checks, fp8_dtype, backend):
    args, rows = decode_args(kv_dtype=fp8_dtype)
    args["k_scale"] = torch.tensor([args["k_scale"]], dtype=torch.float32)
    out = mm.ops.mla_decode(**args, backend=backend)
    keep = torch.tensor([True, True, False, True])
    assert rel_err(out[keep], decode_expected(args, rows)[0][keep]) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_mla_prefill_values(no_forced_env, data_checks, backend, causal):
    args = prefill_args()
    out, lse = mm.ops.mla_prefill(**args, causal=causal, return_lse=True, backend=backend)
    expected_out, expected_lse = [], []
    q0 = k0 = 0
    for lq, lk in zip(PREFILL_Q, PREFILL_K):
        mask = (torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + lk - lq) if causal else None
        o, l = naive_attention(args["q"][q0 : q0 + lq], args["k"][k0 : k0 + lk], args["v"][k0 : k0 + lk], args["scale"], mask)
        expected_out.append(o)
        expected_lse.append(l)
        q0, k0 = q0 + lq, k0 + lk
    assert out.shape == (sum(PREFILL_Q), HEADS, 16) and lse.shape == (HEADS, sum(PREFILL_Q))
    assert lse.dtype == torch.float32
    assert rel_err(out, torch.cat(expected_out)) < 1e-5
    assert rel_err(lse, torch.cat(expected_lse, dim=1)) < 1e-5
    only_out = mm.ops.mla_prefill(**args, causal=causal, backend=backend)
    assert torch.is_tensor(only_out) and torch.equal(only_out, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merge_attn_states_values(dtype):
    gen = torch.Generator().manual_seed(20)
    q = torch.randn(5, HEADS, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(11, HEADS, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(11, HEADS, 16, generator=gen, dtype=torch.float64)
    whole, whole_lse = naive_attention(q, k, v, 0.25)
    prefix, prefix_lse = naive_attention(q, k[:4], v[:4], 0.25)
    suffix, suffix_lse = naive_attention(q, k[4:], v[4:], 0.25)
    out, lse = mm.ops.merge_attn_states(prefix.to(dtype), prefix_lse.float(), suffix.to(dtype), suffix_lse.float())
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(out, whole) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(lse, whole_lse) < 1e-6
    # The inf rules hold through the op too.
    prefix_lse = prefix_lse.float()
    prefix_lse[0, 0] = float("inf")
    empty = torch.full_like(prefix_lse, NEG_INF)
    out, lse = mm.ops.merge_attn_states(prefix.float(), prefix_lse, suffix.float(), suffix_lse.float())
    assert torch.allclose(out[0, 0].double(), suffix[0, 0], rtol=1e-5, atol=1e-6)
    out, lse = mm.ops.merge_attn_states(prefix.float(), empty, suffix.float(), empty)
    assert torch.equal(out, torch.zeros_like(out)) and (lse == NEG_INF).all()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=str)
def test_concat_and_gather_values(data_checks, cache_dtype):
    args = concat_args(cache_dtype)
    args["kv_c"] = args["kv_c"].to(torch.float32)
    before = args["kv_cache"].clone()
    assert mm.ops.concat_and_cache_mla(**args) is None
    cache = args["kv_cache"]
    rows = torch.cat([args["kv_c"], args["k_pe"]], dim=-1).double()
    scale = args.get("scale", 1.0)
    flat = cache.reshape(-1, WIDTH)
    slots = args["slot_mapping"].tolist()
    fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    tolerance = {torch.float32: 0, torch.bfloat16: 1e-2, torch.float8_e4m3fn: 6e-2, torch.float8_e4m3fnuz: 6e-2}[cache_dtype]
    for token, slot in enumerate(slots):
        if slot >= 0:
            assert rel_err(flat[slot].double() * scale, rows[token]) <= tolerance
    untouched = [s for s in range(flat.shape[0]) if s not in slots]
    assert torch.equal(flat[untouched].view(torch.uint8), before.reshape(-1, WIDTH)[untouched].view(torch.uint8))
    # Gather the written slots back: one request whose block table is the identity.
    table = torch.arange(cache.shape[0], dtype=torch.int32).unsqueeze(0)
    gather_kwargs = {"scale": scale} if fp8 else {}
    for slot_index, slot in enumerate(slots):
        if slot < 0:
            continue
        out = mm.ops.gather_cache(cache, table, torch.tensor([slot]), torch.tensor([1]), **gather_kwargs, out_dtype=torch.float32)
        assert out.shape == (1, WIDTH)
        expected = flat[slot].double() * scale
        assert rel_err(out[0], expected) < 1e-6
        assert rel_err(out[0], rows[slot_index]) <= tolerance


def test_gather_cache_values(data_checks):
    args, rows = gather_args()
    out = mm.ops.gather_cache(**args)
    starts, lens = args["seq_starts"].tolist(), args["seq_lens"].tolist()
    expected = torch.cat([rows[i][s : s + n] for i, (s, n) in enumerate(zip(starts, lens))])
    assert out.shape == (sum(lens), WIDTH) and out.dtype == torch.float32
    assert torch.equal(out.double(), expected)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=str)
def test_gather_cache_fp8_values(data_checks, fp8_dtype):
    args, rows = gather_args(fp8_dtype)
    out = mm.ops.gather_cache(**args)
    starts, lens = args["seq_starts"].tolist(), args["seq_lens"].tolist()
    expected = torch.cat([rows[i][s : s + n] for i, (s, n) in enumerate(zip(starts, lens))])
    assert out.dtype == torch.bfloat16 and rel_err(out, expected) < 1e-2


# --------------------------------------------------------------------------- forcing through the ops


def test_forced_unknown_backend(no_forced_env):
    with pytest.raises(UnknownBackendError) as info:
        mm.ops.mla_decode(**decode_args()[0], backend="NO_SUCH_BACKEND")
    assert "'NO_SUCH_BACKEND'" in str(info.value) and "REFERENCE" in str(info.value)
    with pytest.raises(UnknownBackendError) as info:
        mm.ops.mla_prefill(**prefill_args(), backend="flash")
    assert "'flash'" in str(info.value) and "REFERENCE" in str(info.value)
    assert mm.UnknownBackendError is UnknownBackendError


def test_forced_unknown_backend_from_environment(monkeypatch):
    monkeypatch.setenv("MLA_MULTI_DECODE_BACKEND", "no_such_backend")
    with pytest.raises(UnknownBackendError, match="NO_SUCH_BACKEND"):
        mm.ops.mla_decode(**decode_args()[0])
    monkeypatch.setenv("MLA_MULTI_DECODE_BACKEND", "reference")
    args, rows = decode_args()
    out = mm.ops.mla_decode(**args)
    keep = torch.tensor([True, True, False, True])
    assert rel_err(out[keep], decode_expected(args, rows)[0][keep]) < 1e-5


@pytest.mark.parametrize("argument", ["max_seqlen_q", "max_seqlen_k"])
def test_prefill_max_seqlen_below_longest_sequence_is_rejected(data_checks, argument):
    args = prefill_args()
    args[argument] -= 1
    with pytest.raises(ValueError, match=f"{argument}=.* below the longest sequence"):
        mm.ops.mla_prefill(**args)


def test_decode_non_positive_tensor_scale_is_rejected(data_checks):
    args, _ = decode_args(kv_dtype=torch.float8_e4m3fn)
    args["k_scale"] = torch.tensor([0.0])
    with pytest.raises(ValueError, match=r"k_scale=tensor\(\[0.0\]\); accepted: a finite positive float"):
        mm.ops.mla_decode(**args)


def test_planned_decode_runs_new_values_into_given_outputs():
    """plan_mla_decode / MLADecodePlan.run: new query, cache and lengths of the planned layout give the
    float64 result, written into the given out / lse; another layout is refused; the data checks still run."""
    generator = torch.Generator().manual_seed(11)
    heads, blocks, block_size = 3, 5, 8
    table = torch.tensor([[0, 1, 2], [4, 3, 0]], dtype=torch.int32)

    def inputs():
        return (torch.randn(2, heads, 32, generator=generator), torch.randn(2, heads, 16, generator=generator),
                torch.randn(blocks, block_size, 48, generator=generator))

    q_nope, q_pe, cache = inputs()
    plan = mm.ops.plan_mla_decode(q_nope, q_pe, cache, table, torch.tensor([20, 9], dtype=torch.int32), 0.25)
    assert plan.backend == "REFERENCE"
    for lengths in ([20, 9], [3, 24], [0, 1]):
        q_nope, q_pe, cache = inputs()
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        out = torch.full((2, heads, 32), float("nan"))
        lse = torch.full((2, heads), float("nan"))
        got, got_lse = plan.run(q_nope, q_pe, cache, table, seq_lens, out=out, lse=lse)
        assert got is out and got_lse is lse
        rows = cache.double().view(-1, 48)
        for b, length in enumerate(lengths):
            slots = (table[b].long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[:length]
            if length == 0:
                assert torch.all(out[b] == 0) and torch.all(lse[b] == float("-inf"))
                continue
            logits = 0.25 * torch.cat([q_nope[b], q_pe[b]], -1).double() @ rows[slots].T
            torch.testing.assert_close(out[b].double(), torch.softmax(logits, -1) @ rows[slots, :32], rtol=1e-5,
                                       atol=1e-5)
            torch.testing.assert_close(lse[b].double(), torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="differ from the planned ones"):
        plan.run(q_nope[:1], q_pe[:1], cache, table[:1], torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        plan.run(q_nope, q_pe, cache, table, torch.tensor([4, 4], dtype=torch.int32), out=torch.empty(2, heads, 31))
    bad = table.clone()
    bad[0, 0] = 99
    with pytest.raises(ValueError, match="block_table"):
        plan.run(q_nope, q_pe, cache, bad, torch.tensor([4, 4], dtype=torch.int32))


def test_planned_prefill_matches_the_op_and_refuses_other_layouts():
    generator = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(7, 2, 24, generator=generator), torch.randn(7, 2, 24, generator=generator),
               torch.randn(7, 2, 16, generator=generator))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    plan = mm.ops.plan_mla_prefill(q, k, v, cu, cu, 4, 4, 0.3, return_lse=True)
    q2 = torch.randn(7, 2, 24, generator=generator)
    out, lse = plan.run(q2, k, v, cu, cu)
    expected, expected_lse = mm.ops.mla_prefill(q2, k, v, cu, cu, 4, 4, 0.3, return_lse=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    with pytest.raises(ValueError, match="differ from the planned ones"):
        plan.run(q2[:5], k, v, cu, cu)


def _match_cases():
    base = torch.zeros(4, 3, 8)
    return [
        ("plain", base, (4, 3, 8)),
        ("free first size", base, (None, 3, 8)),
        ("other first size", base, (5, 3, 8)),
        ("free first, other sizes", base, (None, 3, 9)),
        ("rank", base, (4, 24)),
        ("free first, rank", base, (None, 24)),
        ("dtype", base.double(), (4, 3, 8)),
        ("strided last dim", torch.zeros(4, 3, 16)[..., ::2], (4, 3, 8)),
        ("strided last dim of size 1", torch.zeros(4, 3, 2)[..., ::2], (4, 3, 1)),
        ("strided rows", torch.zeros(8, 3, 8)[::2], (4, 3, 8)),
        ("zero size", torch.zeros(0, 3, 8), (0, 3, 8)),
        ("0-dim", torch.zeros(()), (1,)),
        ("parameter (a subclass)", torch.nn.Parameter(base.clone()), (4, 3, 8)),
        ("not a tensor", [[0.0] * 8] * 3, (3, 8)),
    ]


@pytest.mark.parametrize("case", _match_cases(), ids=lambda c: c[0])
def test_fast_tensor_match_never_accepts_what_check_tensor_rejects(case):
    """`checks.matches` (the layer's per-forward fast path) says yes only where `check_tensor` accepts; where it
    says no, `check_tensor` runs and names the problem (or accepts a subclass)."""
    _, value, shape = case
    try:
        checks.check_tensor("x", value, ndim=len(shape), dtypes=(torch.float32,), shape=shape,
                            device=torch.device("cpu"))
        accepted = True
    except ValueError:
        accepted = False
    fast = checks.matches(value, shape, torch.float32, torch.device("cpu"))
    assert not fast or accepted
    assert fast == (accepted and type(value) is torch.Tensor)
    assert not checks.matches(value, shape, torch.float32, torch.device("meta"))


def test_a_planned_cache_write_checks_the_new_slots_then_launches_only():
    """`ops._WritePlan`, what a cache write of a seen layout runs (GPUs): the data checks again where they ran
    when it was planned (a slot past the cache is a ValueError naming slot_mapping, nothing launched), then the
    bound write alone, with the plan's scale tensor or the call's."""
    from mla_multi import ops as ops_module

    launched = []

    class Write:
        def launch(self, *args):
            launched.append(args)

    cache = torch.zeros(2, 4, 584, dtype=torch.uint8)
    kv_c, k_pe = torch.zeros(2, 448), torch.zeros(2, 64)
    plan = ops_module._WritePlan(Write(), cache.device, None)
    assert plan.data_checks  # the CPU always checks data
    with pytest.raises(ValueError, match="slot_mapping"):
        plan.run(kv_c, k_pe, cache, torch.tensor([0, 8]), None)
    assert launched == []
    plan.run(kv_c, k_pe, cache, torch.tensor([0, 7]), None)
    assert len(launched) == 1 and launched[0][4] is None
    scale = torch.ones(1)
    ops_module._WritePlan(Write(), cache.device, scale).run(kv_c, k_pe, cache, torch.tensor([1, -1]), None)
    assert launched[1][4] is scale
