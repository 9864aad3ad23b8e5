"""Batch metadata: slot mapping, validation, the decode/prefill split, reordering and context-chunk planning."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import mla_multi as mm
from mla_multi.metadata import (
    CommonAttentionMetadata,
    MLAPrefillMetadata,
    build_prefill_metadata,
    plan_context_chunks,
    reorder_batch_to_split_decodes_and_prefills,
    split_decodes_and_prefills,
)


def random_block_table(rng: random.Random, seq_lens: list[int], block_size: int, extra_columns: int = 2) -> torch.Tensor:
    """Distinct, shuffled blocks per request; unused entries hold a huge sentinel that must never be read."""
    needed = [-(-s // block_size) for s in seq_lens]
    width = max(needed, default=0) + extra_columns
    pool = list(range(sum(needed) + 5))
    rng.shuffle(pool)
    table = torch.full((len(seq_lens), width), 10**6, dtype=torch.int32)
    for row, count in enumerate(needed):
        table[row, :count] = torch.tensor([pool.pop() for _ in range(count)], dtype=torch.int32)
    return table


def random_batch(rng: random.Random, num_reqs: int, threshold: int = 1):
    """Lengths of a batch ordered decodes first: (query_lens, seq_lens)."""
    num_decodes = rng.randint(0, num_reqs)
    query_lens = [rng.randint(0, threshold) for _ in range(num_decodes)]
    query_lens += [rng.randint(threshold + 1, threshold + 40) for _ in range(num_reqs - num_decodes)]
    seq_lens = [q + rng.choice([0, rng.randint(0, 300)]) for q in query_lens]
    return query_lens, seq_lens


# --------------------------------------------------------------------------- from_lengths


_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a GPU")])


@pytest.mark.parametrize("device", ["cpu", _GPU])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("seed", range(4))
def test_from_lengths_against_per_token_computation(block_size, seed, device):
    """On a GPU the slots come from `cache_ops.slot_mapping` (one program a request, 256 tokens a pass; a
    prefill of up to 700 tokens and a block table that is a view with a wider row stride), on the CPU from
    PyTorch: both against a per-token loop."""
    rng = random.Random(seed * 100 + block_size)
    query_lens, seq_lens = random_batch(rng, rng.randint(1, 9))
    if seed % 2:
        query_lens.append(700)
        seq_lens.append(700 + rng.randint(0, 100))
    table = random_block_table(rng, seq_lens, block_size)
    if device == "cuda":
        wide = torch.full((table.shape[0], table.shape[1] + 3), -7, dtype=torch.int32, device=device)
        wide[:, : table.shape[1]] = table.to(device)
        table = wide[:, : table.shape[1]]
    metadata = CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, block_size)

    expected_slots, expected_starts = [], [0]
    for row, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for position in range(s - q, s):
            block = int(table[row, position // block_size].item())
            expected_slots.append(block * block_size + position % block_size)
        expected_starts.append(expected_starts[-1] + q)
    assert metadata.slot_mapping.dtype == torch.int64
    assert metadata.slot_mapping.tolist() == expected_slots
    assert len(set(expected_slots)) == len(expected_slots)  # distinct blocks -> distinct slots
    assert metadata.query_start_loc.dtype == torch.int32 and metadata.seq_lens.dtype == torch.int32
    assert metadata.query_start_loc.tolist() == expected_starts
    assert metadata.query_start_loc_cpu.tolist() == expected_starts
    assert metadata.seq_lens.tolist() == seq_lens and metadata.seq_lens_cpu.tolist() == seq_lens
    assert metadata.num_computed_tokens_cpu.tolist() == [s - q for q, s in zip(query_lens, seq_lens)]
    assert metadata.query_lens_cpu.tolist() == query_lens
    assert metadata.num_reqs == len(query_lens)
    assert metadata.num_actual_tokens == sum(query_lens)
    assert metadata.max_query_len == max(query_lens)
    assert metadata.max_seq_len == max(seq_lens)
    assert metadata.block_size == block_size
    assert metadata.block_table is table


def test_from_lengths_accepts_tensors_and_padding_rows():
    table = torch.tensor([[3, 9], [7, 0], [1, 2]], dtype=torch.int32)
    metadata = CommonAttentionMetadata.from_lengths(
        torch.tensor([1, 0, 3], dtype=torch.int64), torch.tensor([5, 2, 6], dtype=torch.int32), table, 4
    )
    # request 0: position 4 -> block 9; request 1 writes nothing; request 2: positions 3..5 -> blocks 1, 2, 2
    assert metadata.slot_mapping.tolist() == [9 * 4 + 0, 1 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]
    assert metadata.query_start_loc.tolist() == [0, 1, 1, 4]


def test_from_lengths_empty_batch():
    metadata = CommonAttentionMetadata.from_lengths([], [], torch.zeros(0, 4, dtype=torch.int32), 16)
    assert metadata.num_reqs == 0 and metadata.num_actual_tokens == 0
    assert metadata.slot_mapping.numel() == 0 and metadata.query_start_loc.tolist() == [0]
    assert split_decodes_and_prefills(metadata) == (0, 0, 0, 0)


def test_host_lengths_of_a_built_and_a_hand_made_metadata_agree():
    """`host_lengths` (what planning reads instead of tensors) holds the lengths `from_lengths` was given, and a
    metadata made field by field computes the same lists from its tensors; the split and the prefill
    metadata made from either are the same."""
    query_lens, seq_lens = [1, 0, 1, 5, 3, 7], [10, 4, 1, 40, 3, 100]
    table = random_block_table(random.Random(5), seq_lens, 16)
    built = CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, 16)
    assert built.host_lengths() == (query_lens, [s - q for q, s in zip(query_lens, seq_lens)])
    fields = {f.name: getattr(built, f.name) for f in dataclasses.fields(built) if f.name != "backend_plans"}
    by_hand = CommonAttentionMetadata(**fields)
    assert by_hand.host_lengths() == built.host_lengths()
    assert split_decodes_and_prefills(by_hand) == split_decodes_and_prefills(built) == (3, 3, 2, 15)
    for common in (built, by_hand):
        prefill = build_prefill_metadata(common, workspace_tokens=64)
        assert prefill.query_start_loc.tolist() == prefill.query_start_loc_cpu.tolist() == [0, 5, 8, 15]
        assert prefill.query_start_loc_cpu.dtype == torch.int32 and prefill.max_query_len == 7
        assert prefill.context_lens_cpu.tolist() == [35, 0, 93]


def test_host_int32_matches_torch_tensor():
    from mla_multi.metadata import host_int32

    for values in ([], [0], [5, -3, 2**31 - 1, -(2**31)], list(range(1000))):
        made = host_int32(values)
        assert made.dtype == torch.int32 and made.tolist() == values
    with pytest.raises(RuntimeError, match="overflow"):
        host_int32([1, 2**31])


def test_from_lengths_is_exported():
    assert mm.CommonAttentionMetadata is CommonAttentionMetadata


@pytest.mark.parametrize(
    "query_lens, seq_lens, table, block_size, fragment",
    [
        ([4, 1], [4, 9], torch.zeros(2, 4, dtype=torch.int32), 16, "decodes (query_len <= 1) must come before prefills"),
        ([1, 5], [3, 4], torch.zeros(2, 4, dtype=torch.int32), 16, "request 1: query_len 5 > seq_len 4"),
        ([1, 3], [3, 65], torch.zeros(2, 4, dtype=torch.int32), 16, "request 1: seq_len 65 needs more than the 4 blocks"),
        ([1], [3], torch.zeros(1, 4, dtype=torch.int64), 16, "block_table="),
        ([1], [3], torch.zeros(4, dtype=torch.int32), 16, "block_table="),
        ([1], [3], [[0, 1]], 16, "block_table="),
        ([1, 1], [3, 3], torch.zeros(3, 4, dtype=torch.int32), 16, "block_table has 3 rows for 2 requests"),
        ([1, 1], [3], torch.zeros(2, 4, dtype=torch.int32), 16, "query_lens has 2 entries and seq_lens 1"),
        ([1], [3], torch.zeros(1, 4, dtype=torch.int32), 0, "block_size=0"),
        ([-1], [3], torch.zeros(1, 4, dtype=torch.int32), 16, "query_lens=[-1]"),
        ([1], [2.5], torch.zeros(1, 4, dtype=torch.int32), 16, "seq_lens=[2.5]"),
        (torch.tensor([1.0]), [3], torch.zeros(1, 4, dtype=torch.int32), 16, "query_lens has shape (1,) and dtype torch.float32"),
        (torch.tensor([[1]]), [3], torch.zeros(1, 4, dtype=torch.int32), 16, "query_lens has shape (1, 1)"),
    ],
)
def test_from_lengths_validation(query_lens, seq_lens, table, block_size, fragment):
    with pytest.raises(ValueError) as info:
        CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, block_size)
    assert fragment in str(info.value)


def test_from_lengths_decode_threshold():
    table = torch.zeros(3, 4, dtype=torch.int32)
    # With a threshold of 2 (speculative decoding) a 2-token request is a decode.
    metadata = CommonAttentionMetadata.from_lengths([2, 1, 5], [9, 9, 9], table, 16, decode_threshold=2)
    assert split_decodes_and_prefills(metadata) == (2, 1, 3, 5)
    with pytest.raises(ValueError, match="must come before prefills"):
        CommonAttentionMetadata.from_lengths([2, 1, 5], [9, 9, 9], table, 16)


# --------------------------------------------------------------------------- split and reorder


@pytest.mark.parametrize("threshold", [1, 3])
def test_split_decodes_and_prefills(threshold):
    rng = random.Random(threshold)
    for _ in range(50):
        query_lens, seq_lens = random_batch(rng, rng.randint(0, 10), threshold)
        table = random_block_table(rng, seq_lens, 16)
        metadata = CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, 16, decode_threshold=threshold)
        decodes = [q for q in query_lens if q <= threshold]
        prefills = [q for q in query_lens if q > threshold]
        expected = (len(decodes), len(prefills), sum(decodes), sum(prefills))
        assert split_decodes_and_prefills(metadata) == expected
        assert mm.split_decodes_and_prefills(metadata, decode_threshold=threshold) == expected


def test_split_with_a_different_threshold_than_the_batch():
    metadata = CommonAttentionMetadata.from_lengths([1, 1, 2, 7], [4, 4, 4, 9], torch.zeros(4, 1, dtype=torch.int32), 16)
    assert split_decodes_and_prefills(metadata) == (2, 2, 2, 9)
    assert split_decodes_and_prefills(metadata, decode_threshold=2) == (3, 1, 4, 7)
    assert split_decodes_and_prefills(metadata, decode_threshold=0) == (0, 4, 0, 11)


@pytest.mark.parametrize("threshold", [1, 4])
def test_reorder_permutation(threshold):
    rng = random.Random(7 + threshold)
    for _ in range(100):
        query_lens = [rng.choice([0, 1, 2, 4, 5, 17]) for _ in range(rng.randint(0, 12))]
        order = reorder_batch_to_split_decodes_and_prefills(query_lens, threshold)
        assert sorted(order) == list(range(len(query_lens)))
        reordered = [query_lens[i] for i in order]
        is_decode = [q <= threshold for q in reordered]
        assert is_decode == sorted(is_decode, reverse=True)  # all decodes, then all prefills
        # Stable within each group.
        decode_ids = [i for i in order if query_lens[i] <= threshold]
        prefill_ids = [i for i in order if query_lens[i] > threshold]
        assert decode_ids == sorted(decode_ids) and prefill_ids == sorted(prefill_ids)
        # The reordered batch is accepted.
        seq_lens = [q + 3 for q in reordered]
        table = torch.zeros(len(reordered), 2, dtype=torch.int32)
        CommonAttentionMetadata.from_lengths(reordered, seq_lens, table, 16, decode_threshold=threshold)


def test_reorder_is_exported_and_validates():
    assert mm.reorder_batch_to_split_decodes_and_prefills([5, 1, 3, 1]) == [1, 3, 0, 2]
    with pytest.raises(ValueError, match="query_lens"):
        reorder_batch_to_split_decodes_and_prefills([1, -2])


# --------------------------------------------------------------------------- context chunks


def check_plan(context_lens: list[int], workspace_tokens: int, block_size: int) -> None:
    plan = plan_context_chunks(context_lens, workspace_tokens, block_size)
    with_context = sum(1 for c in context_lens if c > 0)
    if with_context == 0:
        assert plan is None
        return
    # vLLM's rule: the workspace shared equally among the prefills with context, rounded down to the block size.
    expected_chunk = (workspace_tokens // with_context) // block_size * block_size
    assert plan.max_context_chunk == expected_chunk
    assert plan.num_chunks == -(-max(context_lens) // expected_chunk)
    num_prefills = len(context_lens)
    for name in ("starts", "seq_lens", "starts_cpu", "seq_lens_cpu"):
        tensor = getattr(plan, name)
        assert tensor.shape == (plan.num_chunks, num_prefills) and tensor.dtype == torch.int32, name
    assert plan.cu_seq_lens.shape == (plan.num_chunks, num_prefills + 1) and plan.cu_seq_lens.dtype == torch.int32
    covered = [[0] * c for c in context_lens]
    for chunk in range(plan.num_chunks):
        lengths = plan.seq_lens[chunk].tolist()
        starts = plan.starts[chunk].tolist()
        assert plan.seq_tot[chunk] == sum(lengths) <= workspace_tokens
        assert plan.max_seq_lens[chunk] == max(lengths)
        cumulative = [0]
        for length in lengths:
            cumulative.append(cumulative[-1] + length)
        assert plan.cu_seq_lens[chunk].tolist() == cumulative
        for request, (start, length) in enumerate(zip(starts, lengths)):
            assert 0 <= length <= expected_chunk
            if length == 0:
                continue
            assert start % block_size == 0  # gathers start on block boundaries
            for position in range(start, start + length):
                covered[request][position] += 1
    # Every context token in exactly one chunk.
    for request, counts in enumerate(covered):
        assert counts == [1] * context_lens[request], f"request {request}"
    assert plan.starts_cpu.tolist() == plan.starts.tolist()
    assert plan.seq_lens_cpu.tolist() == plan.seq_lens.tolist()


def test_chunk_planning_property():
    rng = random.Random(1234)
    for _ in range(400):
        block_size = rng.choice([1, 16, 64])
        num_prefills = rng.randint(1, 8)
        context_lens = [rng.choice([0, rng.randint(1, 600), rng.randint(1, 40)]) for _ in range(num_prefills)]
        with_context = max(1, sum(1 for c in context_lens if c > 0))
        workspace_tokens = rng.randint(with_context * block_size, 3000)
        check_plan(context_lens, workspace_tokens, block_size)


@pytest.mark.parametrize(
    "context_lens, workspace_tokens, block_size, chunk, num_chunks",
    [
        ([100, 0, 300], 256, 16, 128, 3),      # 2 prefills with context share 256 -> 128 each
        ([1000], 4096, 64, 4096, 1),           # one chunk when everything fits
        ([64, 64, 64], 200, 64, 64, 1),        # 200 // 3 = 66 -> 64
        ([65, 1, 1], 200, 64, 64, 2),
        ([7, 5], 10, 1, 5, 2),
    ],
)
def test_chunk_planning_examples(context_lens, workspace_tokens, block_size, chunk, num_chunks):
    plan = plan_context_chunks(context_lens, workspace_tokens, block_size)
    assert plan.max_context_chunk == chunk and plan.num_chunks == num_chunks
    check_plan(context_lens, workspace_tokens, block_size)


def test_chunk_planning_without_context():
    assert plan_context_chunks([0, 0], 1024, 16) is None
    assert plan_context_chunks([], 1024, 16) is None


@pytest.mark.parametrize("context_lens, workspace_tokens, block_size, minimum",
                         [([10, 20, 30], 47, 16, 48), ([5], 63, 64, 64), ([1, 0, 1], 1, 1, 2)])
def test_chunk_planning_workspace_too_small(context_lens, workspace_tokens, block_size, minimum):
    with pytest.raises(ValueError) as info:
        plan_context_chunks(context_lens, workspace_tokens, block_size)
    message = str(info.value)
    assert f"workspace_tokens={workspace_tokens}" in message
    assert f"at least {minimum}" in message
    plan_context_chunks(context_lens, minimum, block_size)  # the minimum named is enough


def test_build_prefill_metadata():
    query_lens, seq_lens = [1, 1, 5, 3, 7], [10, 1, 40, 3, 100]
    rng = random.Random(3)
    table = random_block_table(rng, seq_lens, 16)
    common = CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table, 16)
    prefill = build_prefill_metadata(common, workspace_tokens=64)
    assert isinstance(prefill, MLAPrefillMetadata)
    # Positions are relative to the first prefill token.
    assert prefill.query_start_loc.tolist() == [0, 5, 8, 15]
    assert prefill.max_query_len == 7
    assert prefill.context_lens_cpu.tolist() == [35, 0, 93]
    assert torch.equal(prefill.block_table, table[2:])
    chunks = prefill.chunked_context
    assert chunks.max_context_chunk == 32  # 64 tokens shared by the 2 prefills with context
    assert chunks.num_chunks == 3
    check_plan([35, 0, 93], 64, 16)
    # Decodes only: no prefill metadata.
    decodes = CommonAttentionMetadata.from_lengths([1, 1], [4, 9], table[:2], 16)
    assert build_prefill_metadata(decodes, workspace_tokens=64) is None
    # Prefills without context: no chunks.
    fresh = CommonAttentionMetadata.from_lengths([4, 9], [4, 9], table[:2], 16)
    assert build_prefill_metadata(fresh, workspace_tokens=64).chunked_context is None
