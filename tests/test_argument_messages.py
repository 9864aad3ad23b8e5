"""Every public op's shape, dtype and rank errors name the argument at fault.

Each op is called once with good CPU inputs (it must run), then once per
argument with that argument alone broken: its last dimension one wider, its
dtype wrong, or one dimension more. The call must raise ValueError, and the
message must name the broken argument (it may name others too: a width that
must equal the sum of two others names all three).
"""

from __future__ import annotations

import re

import pytest
import torch

import mla_multi as mm

B, N, LKV, R, BLOCKS, BLOCK_SIZE = 2, 4, 32, 16, 4, 8
WIDTH = LKV + R


def _randn(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def decode_inputs():
    return dict(q_nope=_randn(B, N, LKV), q_pe=_randn(B, N, R), kv_cache=_randn(BLOCKS, BLOCK_SIZE, WIDTH),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([5, 12], dtype=torch.int32), scale=0.1)


def prefill_inputs():
    tokens = 6
    return dict(q=_randn(tokens, N, 24), k=_randn(tokens, N, 24), v=_randn(tokens, N, 16),
                cu_seqlens_q=torch.tensor([0, 2, 6], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 2, 6], dtype=torch.int32), max_seqlen_q=4, max_seqlen_k=4, scale=0.2)


def sparse_decode_inputs():
    return dict(q_nope=_randn(3, N, LKV), q_pe=_randn(3, N, R), kv_cache=_randn(BLOCKS, BLOCK_SIZE, WIDTH),
                indices=torch.tensor([[0, 1, -1, 5], [3, 4, 2, -1], [7, 8, 9, 10]], dtype=torch.int32), scale=0.1)


def sparse_prefill_inputs():
    return dict(q_nope=_randn(3, N, LKV), q_pe=_randn(3, N, R), kv=_randn(12, WIDTH),
                indices=torch.tensor([[0, 1, -1, 5], [3, 4, 2, -1], [7, 8, 9, 10]], dtype=torch.int32), scale=0.1)


def merge_inputs():
    tokens, dim = 5, 16
    return dict(prefix_output=_randn(tokens, N, dim), prefix_lse=_randn(N, tokens),
                suffix_output=_randn(tokens, N, dim), suffix_lse=_randn(N, tokens))


def concat_inputs():
    return dict(kv_c=_randn(3, LKV), k_pe=_randn(3, R), kv_cache=torch.zeros(BLOCKS, BLOCK_SIZE, WIDTH),
                slot_mapping=torch.tensor([0, 9, -1], dtype=torch.int64))


def gather_inputs():
    return dict(kv_cache=_randn(BLOCKS, BLOCK_SIZE, WIDTH), block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_starts=torch.tensor([0, 3], dtype=torch.int32), seq_lens=torch.tensor([5, 12], dtype=torch.int32))


OPS = {
    "mla_decode": (mm.ops.mla_decode, decode_inputs),
    "mla_prefill": (mm.ops.mla_prefill, prefill_inputs),
    "mla_sparse_decode": (mm.ops.mla_sparse_decode, sparse_decode_inputs),
    "mla_sparse_prefill": (mm.ops.mla_sparse_prefill, sparse_prefill_inputs),
    "merge_attn_states": (mm.ops.merge_attn_states, merge_inputs),
    "concat_and_cache_mla": (mm.ops.concat_and_cache_mla, concat_inputs),
    "gather_cache": (mm.ops.gather_cache, gather_inputs),
}

# Arguments whose last dimension is free (a block table's width, a top-k list's length): widening them is
# no mistake, so only their dtype and rank are broken.
FREE_WIDTH = {("mla_decode", "block_table"), ("mla_sparse_decode", "indices"), ("mla_sparse_prefill", "indices"),
              ("gather_cache", "block_table"), ("gather_cache", "kv_cache"), ("mla_prefill", "v")}


def _wider(tensor):
    return torch.cat([tensor, tensor[..., :1]], dim=-1)


def _wrong_dtype(tensor):
    return tensor.to(torch.float32) if not tensor.is_floating_point() else tensor.to(torch.int32)


def _one_more_dim(tensor):
    return tensor.unsqueeze(0)


BREAKS = {"width": _wider, "dtype": _wrong_dtype, "ndim": _one_more_dim}


def _cases():
    for op_name, (_, make) in OPS.items():
        for argument, value in make().items():
            if not torch.is_tensor(value):
                continue
            for how in BREAKS:
                if how == "width" and (op_name, argument) in FREE_WIDTH:
                    continue
                yield pytest.param(op_name, argument, how, id=f"{op_name}-{argument}-{how}")


def _names(message: str, argument: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(argument)}(?!\w)", message) is not None


@pytest.mark.parametrize("op_name", list(OPS))
def test_the_good_inputs_run(op_name):
    op, make = OPS[op_name]
    op(**make())


@pytest.mark.parametrize("op_name, argument, how", list(_cases()))
def test_a_broken_argument_is_named(op_name, argument, how):
    op, make = OPS[op_name]
    inputs = make()
    inputs[argument] = BREAKS[how](inputs[argument])
    with pytest.raises(ValueError) as raised:
        op(**inputs)
    message = str(raised.value)
    assert _names(message, argument), f"{op_name} with a broken {argument} ({how}) says: {message}"


def test_the_q_pe_width_case_of_the_report():
    """mla_decode with a q_pe of width 32 once said only `kv_cache has shape [8, 16, 576]; accepted: [*, *, 544]`."""
    q_nope, q_pe = torch.randn(2, 16, 512), torch.randn(2, 16, 32)
    with pytest.raises(ValueError, match=r"kv_cache has shape \[8, 16, 576\]; accepted: \[\*, \*, 544\] "
                                         r"\(q_nope's 512 \+ q_pe's 32 columns"):
        mm.ops.mla_decode(q_nope, q_pe, torch.randn(8, 16, 576), torch.zeros(2, 1, dtype=torch.int32),
                          torch.ones(2, dtype=torch.int32), 0.1)
