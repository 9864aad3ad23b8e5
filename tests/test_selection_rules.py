"""Selection rules as deltas on the platforms' lists, and the dense decode chosen by the planned batch.

A rule moves the backends it prefers ahead of the ones it names, under its condition; the platform's list stays
the one place that names every backend. `TODAY_ORDERS` / `TODAY_EXCEPTIONS` are the orders the registry gave
before rules became deltas (captured by running that code once over every platform spec and every rule
condition below, with and without the sm_90 warpgroup kernels and the in-place fp8_ds_mla loader): the deltas
must give exactly these. A FAKE backend put into every platform's list is then selected under every rule where
it comes first and fits, and rejected with its reasons where it does not.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import warnings

import pytest
import torch

import mla_multi as mm
from mla_multi import cli, ops, registry
from mla_multi.backends.base import (
    DecodeSelectorConfig,
    MLADecodeBackend,
    MLAPrefillBackend,
    MLASparseBackend,
    PrefillSelectorConfig,
    SparseSelectorConfig,
)
from mla_multi.backends.reference import ReferenceDecodeImpl, ReferencePrefillImpl, ReferenceSparseDecodeImpl
from mla_multi.dims import MLADims
from mla_multi.kernels import launch_config, mla_decode
from mla_multi.platforms import SPECS, override
from mla_multi.registry import NoBackendError, Registry, SelectionRule, UnknownBackendError

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "bench" / "RESULTS.md"
FLASHMLA_RULE = "nvidia-sm90-decode-flashmla-from-64-tokens"

TODAY_ORDERS = {
    ('decode', 'MI300X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('decode', 'MI325X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('decode', 'MI355X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('decode', 'MI250X'): ('TRITON', 'REFERENCE'),
    ('decode', 'RX7900XTX'): ('TRITON', 'REFERENCE'),
    ('decode', 'A100'): ('FLASHINFER', 'TRITON', 'CUDA_FLASH_ATTN', 'FLASHMLA', 'REFERENCE'),
    ('decode', 'H100'): ('TRITON', 'FLASHINFER', 'CUDA_FLASH_ATTN', 'FLASHMLA', 'REFERENCE'),
    ('decode', 'H200'): ('TRITON', 'FLASHINFER', 'CUDA_FLASH_ATTN', 'FLASHMLA', 'REFERENCE'),
    ('decode', 'B200'): ('FLASHINFER', 'TRITON', 'CUDA_FLASH_ATTN', 'FLASHMLA', 'REFERENCE'),
    ('decode', 'CPU'): ('REFERENCE',),
    ('prefill', 'MI300X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('prefill', 'MI325X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('prefill', 'MI355X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('prefill', 'MI250X'): ('TRITON', 'REFERENCE'),
    ('prefill', 'RX7900XTX'): ('TRITON', 'REFERENCE'),
    ('prefill', 'A100'): ('FLASHINFER', 'TRITON', 'CUDA_FLASH_ATTN', 'REFERENCE'),
    ('prefill', 'H100'): ('FLASHINFER', 'TRITON', 'CUDA_FLASH_ATTN', 'REFERENCE'),
    ('prefill', 'H200'): ('FLASHINFER', 'TRITON', 'CUDA_FLASH_ATTN', 'REFERENCE'),
    ('prefill', 'B200'): ('FLASHINFER', 'TRITON', 'CUDA_FLASH_ATTN', 'REFERENCE'),
    ('prefill', 'CPU'): ('REFERENCE',),
    ('sparse_decode', 'MI300X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('sparse_decode', 'MI325X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('sparse_decode', 'MI355X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('sparse_decode', 'MI250X'): ('TRITON', 'REFERENCE'),
    ('sparse_decode', 'RX7900XTX'): ('TRITON', 'REFERENCE'),
    ('sparse_decode', 'A100'): ('FLASHMLA', 'TRITON', 'REFERENCE'),
    ('sparse_decode', 'H100'): ('FLASHMLA', 'TRITON', 'REFERENCE'),
    ('sparse_decode', 'H200'): ('FLASHMLA', 'TRITON', 'REFERENCE'),
    ('sparse_decode', 'B200'): ('FLASHMLA', 'TRITON', 'REFERENCE'),
    ('sparse_decode', 'CPU'): ('REFERENCE',),
    ('sparse_prefill', 'MI300X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('sparse_prefill', 'MI325X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('sparse_prefill', 'MI355X'): ('ROCM_AITER', 'TRITON', 'REFERENCE'),
    ('sparse_prefill', 'MI250X'): ('TRITON', 'REFERENCE'),
    ('sparse_prefill', 'RX7900XTX'): ('TRITON', 'REFERENCE'),
    ('sparse_prefill', 'A100'): ('FLASHMLA', 'TRITON', 'REFERENCE'),
    ('sparse_prefill', 'H100'): ('FLASHMLA', 'TRITON', 'REFERENCE'),
    ('sparse_prefill', 'H200'): ('FLASHMLA', 'TRITON', 'REFERENCE'),
    ('sparse_prefill', 'B200'): ('FLASHMLA', 'TRITON', 'REFERENCE'),
    ('sparse_prefill', 'CPU'): ('REFERENCE',),
}
# the exceptions shared by devices of one architecture (A100 and B200 take the few-heads rules alike, H100 and
# H200 the sm_90 ones)
_FEW_HEADS_TRITON = (('TRITON', 'FLASHINFER', 'CUDA_FLASH_ATTN', 'FLASHMLA', 'REFERENCE'), frozenset({
    'N1 bfloat16 wgmma', 'N1 bfloat16', 'N1 float16 wgmma', 'N1 float16',
    'N1 float8_e4m3fn wgmma', 'N1 float8_e4m3fn', 'N1 float8_e4m3fnuz wgmma', 'N1 float8_e4m3fnuz',
    'N16 bfloat16 wgmma', 'N16 bfloat16', 'N16 float16 wgmma', 'N16 float16',
    'N16 float8_e4m3fn wgmma', 'N16 float8_e4m3fn', 'N16 float8_e4m3fnuz wgmma', 'N16 float8_e4m3fnuz',
    'N17 float8_e4m3fn wgmma', 'N17 float8_e4m3fn', 'N32 float8_e4m3fn wgmma', 'N32 float8_e4m3fn',
}))
_SM90_FLASHINFER = (('FLASHINFER', 'TRITON', 'CUDA_FLASH_ATTN', 'FLASHMLA', 'REFERENCE'), frozenset({
    'N17 bfloat16', 'N17 float16', 'N17 float8_e4m3fnuz', 'N32 bfloat16',
    'N32 float16', 'N32 float8_e4m3fnuz', 'N33 bfloat16', 'N33 float16',
    'N33 float8_e4m3fn', 'N33 float8_e4m3fnuz', 'N64 bfloat16', 'N64 float16',
    'N64 float8_e4m3fn', 'N64 float8_e4m3fnuz', 'N127 bfloat16', 'N127 float16',
    'N127 float8_e4m3fn', 'N127 float8_e4m3fnuz', 'N128 bfloat16', 'N128 float16',
    'N128 float8_e4m3fn', 'N128 float8_e4m3fnuz',
}))
_SM90_SPARSE_TRITON = (('TRITON', 'FLASHMLA', 'REFERENCE'), frozenset({
    'N32 uint8 T1 in-place', 'N32 uint8 T2 in-place', 'N32 uint8 T66 in-place', 'N64 uint8 T1 in-place',
    'N64 uint8 T2 in-place', 'N64 uint8 T66 in-place', 'N128 uint8 T1 in-place',
}))
TODAY_EXCEPTIONS = {
    ('decode', 'A100'): _FEW_HEADS_TRITON,
    ('decode', 'H100'): _SM90_FLASHINFER,
    ('decode', 'H200'): _SM90_FLASHINFER,
    ('decode', 'B200'): _FEW_HEADS_TRITON,
    ('sparse_decode', 'H100'): _SM90_SPARSE_TRITON,
    ('sparse_decode', 'H200'): _SM90_SPARSE_TRITON,
}


# --------------------------------------------------------------------------- every rule condition

DEC_HEADS = (1, 16, 17, 32, 33, 64, 127, 128)
DEC_KV = ("bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz")
SP_HEADS = (32, 64, 128)
SP_KV = ("uint8", "bfloat16")
# 66 / 67 and 74 / 75: half the compute units of an H100 / H200 and of a B200, and one more
SP_TOKENS = (None, 1, 2, 66, 67, 74, 75, 512)


def rule_cases(phase: str, decode_tokens=(None,)):
    """(label, config, flags) for every condition a rule of `phase` looks at; flags: the sm_90 warpgroup
    kernels (`wgmma`) and the in-place fp8_ds_mla loader (`ds`) available or not. Labels as captured."""
    if phase == "decode":
        for heads, kv, tokens in itertools.product(DEC_HEADS, DEC_KV, decode_tokens):
            for wg in (True, False):
                label = f"N{heads} {kv}{' wgmma' if wg else ''}" + ("" if tokens is None else f" T{tokens}")
                yield label, DecodeSelectorConfig(MLADims.deepseek_v3(num_heads=heads), torch.bfloat16,
                                                  getattr(torch, kv), 64, 1, tokens), {"wgmma": wg}
    elif phase == "prefill":
        for heads in (16, 128):
            yield f"N{heads}", PrefillSelectorConfig(MLADims.deepseek_v3(num_heads=heads), torch.bfloat16), {}
    else:
        for heads, kv, tokens, lengths, ds in itertools.product(SP_HEADS, SP_KV, SP_TOKENS, (False, True),
                                                                 (True, False)):
            label = f"N{heads} {kv} T{tokens}{' lengths' if lengths else ''}{' in-place' if ds else ''}"
            yield label, SparseSelectorConfig(MLADims.deepseek_v3(num_heads=heads), torch.bfloat16,
                                              getattr(torch, kv), 2048, 1, tokens, lengths), {"ds": ds}


def v4_rule_cases(phase: str):
    """(label, config, flags) of the V4 contract's sparse configurations (fp8_ds_mla_v4 caches, bf16 queries)
    for the conditions the V4 rule looks at."""
    if phase not in ("sparse_decode", "sparse_prefill"):
        return
    for heads, tokens, ds, extra in itertools.product(SP_HEADS, SP_TOKENS + (12, 13, 24, 25, 32, 33, 64),
                                                      (True, False), ("fp8_ds_mla_v4", None)):
        label = f"V4 N{heads} T{tokens}{' in-place' if ds else ''}{' window' if extra else ''}"
        yield label, SparseSelectorConfig(MLADims.deepseek_v3(num_heads=heads), torch.bfloat16, torch.uint8, 512, 1,
                                          tokens, True, "fp8_ds_mla_v4", extra, True), {"ds": ds}


@pytest.fixture
def kernels_flags(monkeypatch):
    """set(flags): make the sm_90 warpgroup kernels and the in-place fp8_ds_mla loader available or not."""
    state = {}
    monkeypatch.setattr(launch_config, "wgmma_decode_reason",
                        lambda *args, **kwargs: "" if state.get("wgmma") else "no warpgroup kernels (test)")
    monkeypatch.setattr(mla_decode, "ds_mla_decode_reason",
                        lambda *args, **kwargs: "" if state.get("ds") else "no in-place loader (test)")
    registry.default_registry.clear_cache()
    yield lambda flags: (state.clear(), state.update(flags), registry.default_registry.clear_cache())
    registry.default_registry.clear_cache()


def today(phase: str, spec: str, label: str) -> tuple[str, ...]:
    exception = TODAY_EXCEPTIONS.get((phase, spec))
    if exception is not None and label in exception[1]:
        return exception[0]
    return TODAY_ORDERS[(phase, spec)]


@pytest.mark.parametrize("phase", registry.PHASES)
def test_deltas_give_todays_orders_on_every_platform_and_rule_condition(phase, kernels_flags):
    """The orders of every platform spec under every rule condition are the ones the whole-list rules gave
    (the dense decode planned without a count, or with fewer than 64 tokens: the rule from 64 is new)."""
    checked = 0
    tokens = (None, 1, 63) if phase == "decode" else (None,)
    for label, config, flags in rule_cases(phase, tokens):
        kernels_flags(flags)
        captured = label.rsplit(" T", 1)[0] if phase == "decode" else label
        for spec_name, spec in SPECS.items():
            assert registry.default_registry.priority(phase, spec, config) == today(phase, spec_name, captured), (
                spec_name, label)
            checked += 1
    assert checked == len(SPECS) * {"decode": 192, "prefill": 2}.get(phase, 192)


def test_the_flashmla_rule_is_the_only_change_from_64_tokens(kernels_flags):
    """From 64 planned tokens the dense orders are today's, except on sm_90 at 128 heads with a bf16 cache:
    FLASHMLA just ahead of TRITON (first where the warpgroup rule put TRITON first)."""
    changed = set()
    for label, config, flags in rule_cases("decode", (64, 256)):
        kernels_flags(flags)
        for spec_name, spec in SPECS.items():
            order = registry.default_registry.priority("decode", spec, config)
            before = list(today("decode", spec_name, label.rsplit(" T", 1)[0]))
            if spec.arch == "sm_90" and config.dims.num_heads == 128 and config.kv_cache_dtype == torch.bfloat16:
                before.remove("FLASHMLA")
                before.insert(before.index("TRITON"), "FLASHMLA")
                changed.add((spec_name, flags["wgmma"], order[0]))
            assert order == tuple(before), (spec_name, label)
    assert changed == {("H100", True, "FLASHMLA"), ("H200", True, "FLASHMLA"),
                       ("H100", False, "FLASHINFER"), ("H200", False, "FLASHINFER")}


def test_the_v4_rules_put_triton_first_where_it_reads_in_place_and_is_faster(kernels_flags):
    """V4 sparse decode over fp8_ds_mla_v4 caches: on sm_90, where TRITON reads them in place, TRITON ahead of
    FLASHMLA at most 64 heads (every batch, none planned included) and at 128 heads from 1 to 12 planned tokens
    and from 25 to 32 (measured faster or level there); everywhere else the platform's order."""
    moved = set()
    for label, config, flags in v4_rule_cases("sparse_decode"):
        kernels_flags(flags)
        for spec_name, spec in SPECS.items():
            order = registry.default_registry.priority("sparse_decode", spec, config)
            base = registry.default_registry.base_priority("sparse_decode", spec)
            heads, tokens = config.dims.num_heads, config.num_tokens
            if spec.arch == "sm_90" and flags["ds"] and (
                    heads <= 64 or (tokens is not None and (1 <= tokens <= 12 or 25 <= tokens <= 32))):
                assert order.index("TRITON") < order.index("FLASHMLA"), (spec_name, label)
                moved.add((spec_name, heads, tokens))
            else:
                assert order == base, (spec_name, label)
    assert {(spec, heads) for spec, heads, _ in moved} == {
        ("H100", 32), ("H100", 64), ("H200", 32), ("H200", 64), ("H100", 128), ("H200", 128)}
    assert {tokens for spec, heads, tokens in moved if heads == 128} == {1, 2, 12, 25, 32}
    assert {tokens for spec, heads, tokens in moved if heads == 64} == set(SP_TOKENS + (12, 13, 24, 25, 32, 33, 64))


# --------------------------------------------------------------------------- the rules as data


def test_package_rules_are_deltas_naming_registered_backends_and_their_record():
    text = RESULTS.read_text()
    rules = registry.SELECTION_RULES
    assert len({rule.name for rule in rules}) == len(rules)
    for rule in rules:
        assert rule.prefer and set(rule.names()) <= set(registry.default_registry.names(rule.phase)), rule.name
        assert rule.measured.startswith("bench/RESULTS.md, '"), rule.name
        title = rule.measured.split("'")[1]
        assert title in text, f"{rule.name}: {title!r} is not in bench/RESULTS.md"
        # a rule orders backends of a list it can apply to
        lists = [order for (vendor, _), order in registry.default_registry.priorities[rule.phase].items()
                 if rule.vendor in (None, vendor)]
        assert any(set(rule.names()) <= set(order) for order in lists), rule.name
    flashmla = next(rule for rule in rules if rule.name == FLASHMLA_RULE)
    assert (flashmla.prefer, flashmla.over, flashmla.arch, flashmla.num_heads, flashmla.num_tokens) == (
        ("FLASHMLA",), ("TRITON",), "sm_90", (128, 128), (64, None))
    assert flashmla.kv_cache_dtypes == frozenset({torch.bfloat16})
    assert "Dense decode on sm_90: FLASHMLA from B = 64 (H200)" in flashmla.measured
    assert text.rstrip().splitlines()[-1] and "## Dense decode on sm_90: FLASHMLA from B = 64 (H200)" in text


def rule(**kwargs) -> SelectionRule:
    kwargs.setdefault("name", "test")
    kwargs.setdefault("phase", "decode")
    kwargs.setdefault("measured", "bench/RESULTS.md, 'a test'")
    return SelectionRule(**kwargs)


@pytest.mark.parametrize(
    "prefer, over, order, expected",
    [
        (("B",), ("A",), "A B C", "B A C"),
        (("C",), ("B",), "A B C", "A C B"),
        (("A",), ("B",), "A B C", "A B C"),  # already ahead: unchanged
        (("C",), ("A", "B"), "A B C", "C A B"),  # ahead of the first of `over` in the list
        (("C", "B"), ("A",), "A B C D", "C B A D"),  # in prefer's order
        (("D",), ("A",), "A B C", "A B C"),  # prefers a backend the list lacks: nothing
        (("C",), ("D",), "A B C", "A B C"),  # over a backend the list lacks: nothing
        (("C", "A"), (), "A B C", "C A B"),  # over nothing: ahead of every other
        (("B",), ("A",), "A NEW B C", "B A NEW C"),  # a backend the rule does not name keeps its place
        (("B",), ("A",), "NEW A B", "NEW B A"),
    ],
)
def test_a_delta_moves_only_what_it_names(prefer, over, order, expected):
    assert rule(prefer=prefer, over=over).apply(tuple(order.split())) == tuple(expected.split())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"phase": "encode", "prefer": ("A",)}, "phase='encode'; accepted: prefill, decode"),
        ({"prefer": ()}, "prefer=(); accepted: at least one backend name"),
        ({"prefer": "TRITON"}, "prefer='TRITON'; accepted: a tuple of upper-case backend names"),
        ({"prefer": ("triton",)}, "prefer=('triton',); accepted: a tuple of upper-case"),
        ({"prefer": ("A",), "over": ("A", "B")}, "A in both prefer and over"),
        ({"prefer": ("A",), "num_tokens": (32, 16)}, "num_tokens=(32, 16); accepted: None or (low, high)"),
        ({"prefer": ("A",), "num_tokens": (-1, None)}, "num_tokens=(-1, None)"),
        ({"prefer": ("A",), "num_heads": (0, 16)}, "num_heads=(0, 16); accepted: (low, high) with 1 <= low"),
        ({"prefer": ("A",), "measured": ""}, "measured=''; accepted: the record"),
    ],
)
def test_bad_rules_name_the_value_and_the_accepted_ones(kwargs, message):
    with pytest.raises(ValueError) as error:
        rule(**kwargs)
    assert message in str(error.value)


def test_a_rule_naming_an_unregistered_backend_is_refused():
    with pytest.raises(UnknownBackendError) as error:
        Registry(backends={"decode": {"A": object}}, priorities={"decode": {}},
                 rules=(rule(prefer=("A",), over=("TRITNO",)),))
    assert "TRITNO" in str(error.value) and "valid names: A" in str(error.value)


def test_a_whole_order_still_works_and_warns():
    with pytest.warns(DeprecationWarning, match="priority="):
        old = rule(priority=("B", "A"))
    assert (old.prefer, old.over) == (("B", "A"), ())
    assert old.apply(("A", "NEW", "B")) == ("B", "A", "NEW")  # a new backend is kept, behind


def test_num_tokens_ranges_match_only_a_planned_call():
    h200 = SPECS["H200"]
    ranged = rule(prefer=("A",), vendor="cuda", num_tokens=(32, 63))
    config = DecodeSelectorConfig(MLADims.deepseek_v3(), torch.bfloat16, torch.bfloat16, 64)
    assert [ranged.matches(h200, dataclasses.replace(config, num_tokens=t)) for t in (None, 31, 32, 63, 64)] == [
        False, False, True, True, False]
    registry_ = Registry(backends={"decode": {"A": object}}, priorities={"decode": {}},
                         rules=(ranged, rule(prefer=("A",), num_tokens=(8, None))))
    assert registry_.num_tokens_bounds("decode") == (8, 32, 64)


# --------------------------------------------------------------------------- a FAKE backend in every list


class _FakeLimits:
    """A FAKE backend: NVIDIA and AMD, 16-bit queries, at most 64 heads."""

    name = "FAKE"
    vendors = frozenset({"cuda", "rocm"})
    supported_dtypes = (torch.float16, torch.bfloat16)
    max_num_heads = 64


class FakeDecode(_FakeLimits, MLADecodeBackend):
    supported_kv_cache_dtypes = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz)

    @staticmethod
    def get_decode_impl_cls():
        return ReferenceDecodeImpl


class FakePrefill(_FakeLimits, MLAPrefillBackend):
    @staticmethod
    def get_prefill_impl_cls():
        return ReferencePrefillImpl

    @classmethod
    def validate_configuration(cls, platform, config):
        reasons = super().validate_configuration(platform, config)
        if config.dims.num_heads > cls.max_num_heads:
            reasons.append(f"num_heads {config.dims.num_heads} is over the maximum of {cls.max_num_heads}")
        return reasons


class FakeSparse(_FakeLimits, MLASparseBackend):
    supported_kv_dtypes = (torch.bfloat16, torch.uint8)

    @staticmethod
    def get_impl_cls():
        return ReferenceSparseDecodeImpl


FAKES = {"decode": FakeDecode, "prefill": FakePrefill, "sparse_decode": FakeSparse, "sparse_prefill": FakeSparse}


def fake_fits(spec, config) -> bool:
    return spec.vendor in ("cuda", "rocm") and config.dims.num_heads <= 64


@pytest.fixture
def with_fake(monkeypatch):
    """put(phase, position): FAKE registered for `phase` and placed at `position` of every platform's list
    (None: the end) of the default registry, undone after the test."""
    default = registry.default_registry

    def put(phase, position=0):
        monkeypatch.setitem(default.backends[phase], "FAKE", FAKES[phase])
        for key, order in list(default.priorities[phase].items()):
            order = [n for n in order if n != "FAKE"]
            order.insert(len(order) if position is None else position, "FAKE")
            monkeypatch.setitem(default.priorities[phase], key, tuple(order))
        default.clear_cache()

    yield put
    default.clear_cache()


@pytest.mark.parametrize("phase", registry.PHASES)
def test_a_new_backend_keeps_its_place_under_every_rule(phase, with_fake, kernels_flags):
    """FAKE first, second or last in every list: under every rule it is there, and the backends a rule does not
    name keep their order relative to each other; every package rule of the phase is met on the way."""
    applied = set()
    for position in (0, 1, None):
        with_fake(phase, position)
        for label, config, flags in itertools.chain(rule_cases(phase, (None, 1, 64)), v4_rule_cases(phase)):
            kernels_flags(flags)
            for spec in SPECS.values():
                base = registry.default_registry.base_priority(phase, spec)
                order, rules = registry.default_registry.ordering(phase, spec, config)
                assert "FAKE" in order and sorted(order) == sorted(base), (spec.name, label)
                named = {n for r in rules for n in r.names()}
                assert [n for n in order if n not in named] == [n for n in base if n not in named], (spec.name, label)
                applied.update(r.name for r in rules)
    assert applied == {r.name for r in registry.SELECTION_RULES if r.phase == phase}


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("phase", registry.PHASES)
def test_a_new_backend_first_is_selected_where_it_fits_and_rejected_with_reasons(phase, spec, with_fake,
                                                                                 kernels_flags):
    """On every impersonated platform and under every rule: FAKE, first in the list, is chosen where it fits;
    where it does not, the choice is another backend and `explain`, a forced FAKE's NoBackendError and, where
    nothing fits, the NoBackendError list FAKE's reasons."""
    with_fake(phase, 0)
    platform = SPECS[spec]
    seen = {"selected": 0, "rejected": 0}
    with override(platform):
        for label, config, flags in rule_cases(phase, (None, 1, 32, 256)):
            kernels_flags(flags)
            rows = {row["name"]: row for row in registry.default_registry.explain(phase, config)}
            assert rows["FAKE"]["rank"] == 0, label
            if fake_fits(platform, config):
                assert registry.default_registry.select(phase, config).name == "FAKE", label
                assert rows["FAKE"]["selected"] and rows["FAKE"]["reasons"] == []
                seen["selected"] += 1
                continue
            reasons = rows["FAKE"]["reasons"]
            assert reasons and not rows["FAKE"]["selected"], label
            if platform.vendor == "cpu":
                assert any("supported vendors: cuda, rocm" in r for r in reasons)
            else:
                assert reasons == [f"num_heads {config.dims.num_heads} is over the maximum of 64"]
            try:
                chosen = registry.default_registry.select(phase, config).name
            except NoBackendError as error:  # nothing else fits here either: FAKE's block is in the message
                assert error.reasons["FAKE"] == reasons and "  FAKE:\n" in str(error)
            else:
                assert chosen != "FAKE"
            with pytest.raises(NoBackendError) as error:
                registry.default_registry.select(phase, config, backend="FAKE")
            assert error.value.forced == "FAKE" and all(f"    - {r}" in str(error.value) for r in reasons)
            seen["rejected"] += 1
        # a configuration nothing runs: the error lists FAKE's block first, with its reasons
        config = dataclasses.replace(config, dtype=torch.int8)
        with pytest.raises(NoBackendError) as error:
            registry.default_registry.select(phase, config)
        assert list(error.value.reasons)[0] == "FAKE" and "dtype int8 is not supported" in str(error.value)
    assert seen["rejected"] > 0 and (seen["selected"] > 0) == (platform.vendor != "cpu"), seen


# --------------------------------------------------------------------------- dense decode by planned batch


@pytest.fixture
def sm90(monkeypatch):
    """set(flashmla_available): TRITON importable, the sm_90 warpgroup kernels available, FLASHMLA's library
    reported installed or not."""
    from mla_multi.backends import flashmla
    from mla_multi.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "_triton_import_error", lambda: None)
    monkeypatch.setattr(launch_config, "wgmma_decode_reason", lambda *args, **kwargs: "")

    def flashmla_available(available: bool):
        reasons = [] if available else ["sgl-flash-mla is not importable (test)"]
        monkeypatch.setattr(flashmla.FlashMLADecodeBackend, "availability_reasons", classmethod(lambda cls: reasons))
        registry.default_registry.clear_cache()

    flashmla_available(True)
    yield flashmla_available
    registry.default_registry.clear_cache()


def pick(tokens, heads=128, kv=torch.bfloat16, **kwargs):
    return registry.select_decode_backend(MLADims.deepseek_v3(num_heads=heads), torch.bfloat16, kv, 64,
                                          num_tokens=tokens, **kwargs).name


@pytest.mark.parametrize("spec", ["H100", "H200"])
def test_dense_decode_on_sm90_takes_flashmla_from_64_planned_tokens(spec, sm90):
    with override(spec):
        assert [pick(t) for t in (None, 1, 8, 32, 63)] == ["TRITON"] * 5
        assert [pick(t) for t in (64, 128, 4096)] == ["FLASHMLA"] * 3
        assert pick(64, max_query_len=2) == "FLASHMLA"  # 32 requests of 2 tokens
        assert pick(64, heads=64) == "TRITON" and pick(64, kv=torch.float8_e4m3fn) == "TRITON"
        assert pick(64, backend="TRITON") == "TRITON"  # a forced backend stays forced
        config = registry.decode_config(MLADims.deepseek_v3(), torch.bfloat16, "auto", 64, num_tokens=64)
        rules = registry.default_registry.rules_for("decode", mm.current_platform(), config)
        assert [r.name for r in rules] == ["nvidia-sm90-decode-warpgroup", FLASHMLA_RULE]
        assert registry.default_registry.rule_for("decode", mm.current_platform(), config).name == FLASHMLA_RULE
        assert "num_tokens=64" in config.describe()
        sm90(False)
        assert pick(64) == "TRITON"  # not installed: TRITON, the rule still listed
        assert FLASHMLA_RULE in [r.name for r in registry.default_registry.rules_for("decode", mm.current_platform(),
                                                                                     config)]
        rows = {row["name"]: row for row in registry.default_registry.explain("decode", config)}
        assert rows["FLASHMLA"]["rank"] == 0 and "sgl-flash-mla" in rows["FLASHMLA"]["reasons"][0]
        assert rows["TRITON"]["selected"]
    for other in ("A100", "B200"):
        with override(other):
            assert pick(64) != "FLASHMLA"


def test_planned_batch_ranges(sm90):
    config = registry.decode_config(MLADims.deepseek_v3(), torch.bfloat16, "auto", 64, platform=SPECS["H200"])
    ranges = registry.default_registry.by_num_tokens("decode", config, SPECS["H200"], max_tokens=256)
    assert [(low, high, backend.name) for low, high, backend in ranges] == [(1, 63, "TRITON"), (64, 256, "FLASHMLA")]
    ranges = registry.default_registry.by_num_tokens("decode", config, SPECS["H200"], max_tokens=16)
    assert [(low, high, backend.name) for low, high, backend in ranges] == [(1, 16, "TRITON")]
    ranges = registry.default_registry.by_num_tokens("decode", config, SPECS["H200"], backend="TRITON")
    assert [(low, high, backend.name) for low, high, backend in ranges] == [(1, None, "TRITON")]
    with pytest.raises(ValueError, match="num_tokens=-1; accepted: None or an int >= 0"):
        registry.decode_config(MLADims.deepseek_v3(), torch.bfloat16, num_tokens=-1)


@pytest.mark.parametrize("available", [True, False])
def test_info_names_the_rule_of_a_planned_batch(available, sm90, monkeypatch, capsys):
    sm90(available)
    monkeypatch.setattr(mm.platforms, "current_platform", mm.platforms.current_platform)
    info = cli.collect_info("H200")
    decode = info["phases"]["decode"]
    assert decode["selected"] == "TRITON" and decode["rule"].startswith("nvidia-sm90-decode-warpgroup")
    by_tokens = {entry["num_tokens"]: entry for entry in decode["by_num_tokens"]}
    assert set(by_tokens) == {"1-63", "64+"}
    assert by_tokens["1-63"]["selected"] == "TRITON" and FLASHMLA_RULE not in by_tokens["1-63"]["rule"]
    assert by_tokens["64+"]["selected"] == ("FLASHMLA" if available else "TRITON")
    assert FLASHMLA_RULE in by_tokens["64+"]["rule"] and "RESULTS.md" in by_tokens["64+"]["rule"]
    cli._print_info(info)
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if "a call of 64+ tokens" in line)
    assert FLASHMLA_RULE in line and ("FLASHMLA," if available else "TRITON,") in line
    assert cli.collect_info("A100")["phases"]["decode"]["by_num_tokens"] == []


def test_the_functional_op_plans_with_its_batch(monkeypatch):
    seen = []
    select = ops.select_decode_backend

    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_tokens"))
        return select(*args, **kwargs)

    monkeypatch.setattr(ops, "select_decode_backend", spy)
    monkeypatch.setattr(ops, "_PLANS", {})
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(8, 16, 80, generator=generator, dtype=torch.float64)
    table = torch.arange(6, dtype=torch.int32).view(3, 2)
    seq_lens = torch.tensor([5, 17, 32], dtype=torch.int32)
    for q_len in (1, 2):
        shape = (3, 4) if q_len == 1 else (3, q_len, 4)
        q = torch.randn(*shape, 80, generator=generator, dtype=torch.float64)
        mm.ops.mla_decode(q[..., :64], q[..., 64:], cache, table, seq_lens, 0.1)
    assert seen == [3, 6]


def test_the_decode_benchmark_marks_the_choice_at_its_batch(sm90, monkeypatch):
    from mla_multi.benchmarks import decode as bench

    class Stop(Exception):
        pass

    chosen = []

    def installed(config):
        chosen.append((config.num_tokens, bench.installed_decode_backends.__wrapped__(config)[1]))
        raise Stop

    installed.__wrapped__ = bench.installed_decode_backends
    monkeypatch.setattr(bench, "installed_decode_backends", installed)
    with override("H200"):
        for batch, q_len in ((8, 1), (64, 1), (32, 2)):
            with pytest.raises(Stop):
                bench.bench_backends_case(batch, 8192, 128, 64, torch.bfloat16, q_len)
    assert chosen == [(8, "TRITON"), (64, "FLASHMLA"), (64, "FLASHMLA")]


# --------------------------------------------------------------------------- the layer chooses per step

SMALL = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
# decode requests per step: 0, 2, 2 and 5
STEPS = [
    [(0, 23), (1, 5), (2, 40)],
    [(0, 1), (1, 1), (3, 9), (2, 17)],
    [(3, 1), (0, 1), (4, 33), (1, 12)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)],
]


@pytest.fixture
def stepwise(monkeypatch):
    """A planning decode backend STEPWISE (REFERENCE's math) behind REFERENCE in the CPU list, and a rule that
    prefers it from 3 planned tokens on the CPU; the plans it makes."""
    from mla_multi.backends.reference import ReferenceDecodeBackend

    plans = []

    class StepwiseImpl(ReferenceDecodeImpl):
        def plan_key(self):
            return ("STEPWISE", self.num_heads)

        def plan(self, seq_lens_cpu, block_table, query_len=1, *, k_scale=None, cuda_graph=False):
            plans.append(block_table.shape[0])
            return type("Plan", (), {"rows": block_table.shape[0], "cuda_graph": cuda_graph})

        def forward_mqa(self, q_nope, q_pe, kv_cache, block_table, seq_lens, *, plan=None, **kwargs):
            assert plan is not None and plan.rows == q_nope.shape[0]
            return super().forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens, **kwargs)

    class Stepwise(ReferenceDecodeBackend):
        name = "STEPWISE"
        requires_plan = True

        @staticmethod
        def get_decode_impl_cls():
            return StepwiseImpl

    default = registry.default_registry
    monkeypatch.setitem(default.backends["decode"], "STEPWISE", Stepwise)
    monkeypatch.setitem(default.priorities["decode"], ("cpu", None), ("REFERENCE", "STEPWISE"))
    monkeypatch.setattr(default, "rules", default.rules + (
        rule(name="cpu-stepwise-from-3-tokens", vendor="cpu", num_tokens=(3, None), prefer=("STEPWISE",),
             over=("REFERENCE",)),))
    default.clear_cache()
    yield plans
    default.clear_cache()


def test_the_layer_chooses_its_decode_backend_per_step(stepwise):
    from mla_multi.testing import PagedScenario, relative_error

    dims = mm.MLADims(4, **SMALL)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                         generator=generator, dtype=torch.float64) / dims.kv_lora_rank**0.5
    scale = dims.qk_head_dim**-0.5
    with override("CPU"):
        layers = [mm.MLAAttention(dims, scale, weight, block_size=16, max_model_len=1024, max_num_seqs=8,
                                  workspace_tokens=32) for _ in range(2)]
        forced = mm.MLAAttention(dims, scale, weight, block_size=16, max_model_len=1024, max_num_seqs=8,
                                 workspace_tokens=32, decode_backend="REFERENCE")
        assert layers[0].backends() == {"prefill": "REFERENCE", "decode": "REFERENCE",
                                        "decode_3_to_8_rows": "STEPWISE"}
        assert forced.backends() == {"prefill": "REFERENCE", "decode": "REFERENCE"}
        scenario = PagedScenario(dims, 16, 256, torch.device("cpu"), torch.float64, seed=3)
        cache = torch.full((256, 16, dims.kv_cache_width), float("nan"), dtype=torch.float64)
        for index, requests in enumerate(STEPS):
            metadata, q, kv_c, k_pe = scenario.step(requests)
            before = len(stepwise)
            if index == 3:
                layers[1].plan(metadata)
            outs = [layer.forward(q, kv_c, k_pe, cache, metadata) for layer in layers + [forced]]
            decodes = sum(1 for _, n in requests if n == 1)
            # one plan a step for every layer that takes STEPWISE, none where the step's rows are fewer than 3
            assert stepwise[before:] == ([decodes] if decodes >= 3 else []), (index, stepwise)
            reference = scenario.reference(requests, q, scale, weight)
            for out in outs:
                assert relative_error(out, reference) < 1e-12


def test_an_h200_layer_decodes_a_step_of_64_rows_through_flashmla(fake_flash_mla, sm90):
    """Built without a batch, an H200 layer at 128 heads keeps TRITON as its decode backend, and a step of 64
    decode rows runs (planned, then launched) through FLASHMLA, here FlashMLA's interface in PyTorch, with the
    output of a layer forced to REFERENCE."""
    from mla_multi.testing import PagedScenario, relative_error

    dims = MLADims.deepseek_v3()
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                          generator=generator, dtype=torch.float64) / dims.kv_lora_rank**0.5).to(torch.bfloat16)
    scale = dims.qk_head_dim**-0.5
    with override("H200"):
        layer = mm.MLAAttention(dims, scale, weight, block_size=64, max_model_len=256, max_num_seqs=72,
                                prefill_backend="REFERENCE")
        assert layer.backends() == {"prefill": "REFERENCE", "decode": "TRITON", "decode_64_to_72_rows": "FLASHMLA"}
        scenario = PagedScenario(dims, 64, 128, torch.device("cpu"), torch.bfloat16, seed=1)
        cache = torch.zeros(128, 64, dims.kv_cache_width, dtype=torch.bfloat16)
        requests = [(r, 1) for r in range(64)]  # 64 new requests of one token each: 64 decode rows
        metadata, q, kv_c, k_pe = scenario.step(requests)
        layer.plan(metadata)
        out = layer.forward(q, kv_c, k_pe, cache, metadata)
        reference = mm.MLAAttention(dims, scale, weight, block_size=64, max_model_len=256, max_num_seqs=72,
                                    prefill_backend="REFERENCE", decode_backend="REFERENCE")
        expected = reference.forward(q, kv_c, k_pe, cache.clone(), metadata)
        assert relative_error(out, expected) < 2e-2
    calls = [call["function"] for call in fake_flash_mla.CALLS]
    assert calls == ["get_mla_decoding_metadata", "flash_mla_with_kvcache"], calls


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [8, 64])
def test_gpu_layer_steps_take_the_backend_of_their_batch_eager_and_captured(batch):
    """On an sm_90 GPU with sgl-flash-mla: a 128-head layer decodes a step of 8 rows through TRITON and one of 64
    through FLASHMLA, eager and replayed from a CUDA graph with new lengths, as a layer forced to REFERENCE."""
    dims = MLADims.deepseek_v3()
    config = registry.decode_config(dims, torch.bfloat16, "auto", 64, num_tokens=64)
    reasons = registry.default_registry.reasons("decode", "FLASHMLA", mm.current_platform(), config)
    if reasons or mm.current_platform().arch != "sm_90":
        pytest.skip(f"FLASHMLA's dense decode cannot run here: {reasons[:1] or mm.current_platform().arch}")
    no_warpgroup = launch_config.wgmma_decode_reason(mm.current_platform(), torch.bfloat16)
    if no_warpgroup:  # then FLASHINFER keeps its place ahead of both where it is installed
        pytest.skip(f"the sm_90 warpgroup kernels cannot run here: {no_warpgroup}")
    expected_backend = "FLASHMLA" if batch >= 64 else "TRITON"
    generator = torch.Generator().manual_seed(batch)
    weight = (torch.randn(128 * 256, 512, generator=generator) / 512**0.5).to(torch.bfloat16).cuda()
    scale = dims.qk_head_dim**-0.5
    layer = mm.MLAAttention(dims, scale, weight, block_size=64, max_model_len=4096, max_num_seqs=64)
    reference = mm.MLAAttention(dims, scale, weight, block_size=64, max_model_len=4096, max_num_seqs=64,
                                decode_backend="REFERENCE")
    assert layer.backends()["decode_64_to_64_rows"] == "FLASHMLA"
    blocks = 4096 // 64
    cache = torch.randn(batch * blocks, 64, 576, generator=generator).to(torch.bfloat16).cuda()
    table = torch.randperm(batch * blocks, generator=generator).to(torch.int32).view(batch, blocks).cuda()
    q = torch.randn(batch, 128, 192, generator=generator).to(torch.bfloat16).cuda()
    kv_c = torch.randn(batch, 512, generator=generator).to(torch.bfloat16).cuda()
    k_pe = torch.randn(batch, 64, generator=generator).to(torch.bfloat16).cuda()

    def metadata():
        lens = [int(n) for n in torch.randint(1, 4096, (batch,), generator=generator)]
        return mm.CommonAttentionMetadata.from_lengths([1] * batch, lens, table, 64)

    def error(out, md):
        expected = reference.forward(q, kv_c, k_pe, cache.clone(), md)
        return ((out.float() - expected.float()).norm() / expected.float().norm()).item()

    eager_md = metadata()
    assert layer._step_decode(eager_md, batch)[0].name == expected_backend
    assert error(layer.forward(q, kv_c, k_pe, cache, eager_md), eager_md) < 2e-2
    # captured at the longest lengths, replayed with new ones copied into the captured metadata, re-planned first
    md = mm.CommonAttentionMetadata.from_lengths([1] * batch, [4096] * batch, table, 64)
    out = torch.empty(batch, 128 * 128, device="cuda", dtype=torch.bfloat16)
    layer.plan(md, cuda_graph=True)
    layer.forward(q, kv_c, k_pe, cache, md, output=out)
    layer.lock_workspace()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer.forward(q, kv_c, k_pe, cache, md, output=out)
        for _ in range(2):
            new_md = metadata()
            md.seq_lens.copy_(new_md.seq_lens)
            md.slot_mapping.copy_(new_md.slot_mapping)
            layer.plan(new_md, cuda_graph=True)  # FLASHMLA's schedule, into the buffers the graph reads
            graph.replay()
            torch.cuda.synchronize()
            assert error(out, new_md) < 2e-2
    finally:
        layer.workspace.unlock()
