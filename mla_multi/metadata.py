"""Batch metadata: decode/prefill split, slot mapping and chunked-context planning.

The vocabulary is vLLM's.  A batch holds requests with their *query* lengths
(tokens scheduled now) and *sequence* lengths (tokens in the cache after this
step, new ones included); decodes (query length <= decode_threshold) come
first.  Context chunks follow vLLM's MLA common module: the workspace is
shared equally among the prefills that have cached context, rounded down to
the block size, and the context is cut into chunks of that many tokens.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import importlib
import itertools
import operator
from collections.abc import Sequence

import torch

from mla_multi.checks import check_positive_int


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device` without waiting for the device. A copy from pageable memory first
    synchronises with the stream, so the host would wait for all queued work (the step running while the
    next is planned); through pinned memory the copy is queued behind that work instead (PyTorch's pinned
    allocator keeps the staging block until the copy has run)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return pinned(host).to(device, non_blocking=True)


@functools.lru_cache(maxsize=1)
def _device_slots() -> bool:
    """Whether GPU metadata computes its slots with the Triton kernel (`cache_ops.slot_mapping`): Triton is
    importable and not interpreting."""
    try:
        from mla_multi.kernels import interpreter_active

        importlib.import_module("mla_multi.kernels.cache_ops")
    except Exception:  # no usable Triton: the slots are gathered with PyTorch
        return False
    return not interpreter_active()


def pinned(host: torch.Tensor) -> torch.Tensor:
    """A page-locked copy of `host` for a queued copy to the GPU (`host` itself where none can be had: the copy
    then waits, as a pageable one does)."""
    try:
        return host.pin_memory()
    except RuntimeError:
        return host


def host_int32(values: list[int]) -> torch.Tensor:
    """A list of ints as a host int32 tensor, read from an array's buffer (a third of `torch.tensor`'s time
    on a list: a step makes several); values outside int32 raise `torch.tensor`'s error."""
    if not values:
        return torch.empty(0, dtype=torch.int32)
    try:
        return torch.frombuffer(array.array("i", values), dtype=torch.int32)
    except OverflowError:
        return torch.tensor(values, dtype=torch.int32)


def _checked_lengths(query_lens, seq_lens, block_table, block_size: int) -> tuple[list[int], list[int], int]:
    """(query_lens, seq_lens as int lists, the block table's capacity in tokens), or a ValueError naming what does
    not fit: lengths of unequal count, a block table that is not 2-D int32 with a row per request, a block size,
    the first request (in the given order) whose new tokens exceed its sequence or whose sequence its row."""
    query_lens = _as_int_list(query_lens, "query_lens")
    seq_lens_list = _as_int_list(seq_lens, "seq_lens")
    if len(query_lens) != len(seq_lens_list):
        raise ValueError(f"query_lens has {len(query_lens)} entries and seq_lens {len(seq_lens_list)}; they must match")
    if not torch.is_tensor(block_table) or block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table={_describe(block_table)}; accepted: a 2-D int32 tensor [num_reqs, max_blocks]")
    if block_table.shape[0] != len(query_lens):
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {len(query_lens)} requests")
    check_positive_int("block_size", block_size)
    capacity = block_table.shape[1] * block_size
    if any(map(operator.gt, query_lens, seq_lens_list)) or max(seq_lens_list, default=0) > capacity:
        for i, (q, s) in enumerate(zip(query_lens, seq_lens_list)):  # the first bad request, named
            if q > s:
                raise ValueError(f"request {i}: query_len {q} > seq_len {s}; the new tokens are part of the sequence")
            if s > capacity:
                raise ValueError(f"request {i}: seq_len {s} needs more than the {block_table.shape[1]} blocks of "
                                 f"{block_size} tokens in its block_table row")
    return query_lens, seq_lens_list, capacity


def _as_int_list(values, name: str) -> list[int]:
    if torch.is_tensor(values):
        if values.dim() != 1 or values.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} has shape {tuple(values.shape)} and dtype {values.dtype}; accepted: 1-D int32/int64")
        values = values.tolist()
    values = list(values)
    # checked at C speed (a step's lists are checked on every step): exactly ints (no bool), none negative
    if values and (not set(map(type, values)) <= {int} or min(values) < 0):
        raise ValueError(f"{name}={values!r}; accepted: non-negative ints")
    return values


def reorder_batch_to_split_decodes_and_prefills(query_lens: Sequence[int], decode_threshold: int = 1) -> list[int]:
    """A stable permutation of request indices that puts decodes (query_len <= threshold) first."""
    query_lens = _as_int_list(query_lens, "query_lens")
    decodes = [i for i, q in enumerate(query_lens) if q <= decode_threshold]
    prefills = [i for i, q in enumerate(query_lens) if q > decode_threshold]
    return decodes + prefills


@dataclasses.dataclass(frozen=True, eq=False)
class BatchOrder:
    """How a step built with ``CommonAttentionMetadata.from_lengths(..., reorder=True)`` maps the caller's order
    of requests (any order) onto the metadata's (decodes first, otherwise in the caller's order).

    requests[i] is the caller's index of the metadata's request i; token_index [T] int64 (on the block table's
    device) the caller's index of the step's token t, inverse_token_index [T] the step's index of the caller's
    token c. `to_step(x)` gathers a caller-ordered [T, ...] tensor into the step's order, `to_caller(y)` a
    step-ordered one back. `MLAAttention.forward` does both itself (one gather per input, one scatter of the
    output, per layer); a caller may instead order the model's inputs once per step with `to_step` and pass
    metadata built without `reorder`. identity: the caller's order is already decodes first (nothing moves).
    """

    requests: tuple[int, ...]
    token_index: torch.Tensor
    inverse_token_index: torch.Tensor
    identity: bool

    @classmethod
    def of(cls, permutation: Sequence[int], query_lens: Sequence[int], device) -> BatchOrder:
        """The order whose step request i is the caller's request permutation[i] (query_lens in the caller's
        order)."""
        starts = list(itertools.accumulate(query_lens, initial=0))
        tokens = [t for r in permutation for t in range(starts[r], starts[r + 1])]
        host = torch.tensor(tokens, dtype=torch.int64)
        inverse = torch.empty_like(host)
        inverse[host] = torch.arange(len(tokens), dtype=torch.int64)
        identity = list(permutation) == list(range(len(permutation)))
        packed = to_device(torch.cat([host, inverse]), device)
        return cls(tuple(permutation), packed[: len(tokens)], packed[len(tokens):], identity)

    def to_step(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] in the caller's token order -> the step's (decodes first); x itself where nothing moves."""
        return x if self.identity else x.index_select(0, self.token_index)

    def to_caller(self, y: torch.Tensor) -> torch.Tensor:
        """y [T, ...] in the step's token order -> the caller's; y itself where nothing moves."""
        return y if self.identity else y.index_select(0, self.inverse_token_index)


@dataclasses.dataclass
class CommonAttentionMetadata:
    """Per-batch metadata shared by every layer.

    query_start_loc [B + 1] int32 and seq_lens [B] int32 live on the device
    of `block_table`; the `_cpu` copies are for host-side planning.
    slot_mapping [num_actual_tokens] int64 is the cache slot of every new token.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    decode_threshold: int = 1
    # Plans of backends with a planning stage, made once per batch by the first
    # layer that needs them and reused by the others (see `MLAAttention.plan`).
    backend_plans: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # `from_lengths(..., reorder=True)`: the caller's order of requests and tokens (None: decodes first already)
    batch_order: BatchOrder | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_lengths(
        cls,
        query_lens: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        decode_threshold: int = 1,
        *,
        reorder: bool = False,
    ) -> CommonAttentionMetadata:
        """Build the metadata of a batch whose decodes come first.

        query_lens[i] new tokens of request i sit at cache positions
        seq_lens[i] - query_lens[i] .. seq_lens[i] - 1; their slots come from
        block_table [B, max_blocks] int32. Requests with query_len 0 are allowed
        (padding rows). Use `reorder_batch_to_split_decodes_and_prefills` to
        order a batch, or:

        reorder=True: the requests (and block_table's rows, and the step's
        tokens, request by request) may come in any order. The metadata holds
        them decodes first (a stable reorder) and `batch_order` (a `BatchOrder`)
        maps the caller's tokens onto its own: `MLAAttention.forward` then takes
        q, kv_c_normed and k_pe in the caller's order and returns the output in
        it (`batch_order.to_step` / `to_caller` for the caller's own tensors).
        """
        if reorder:
            return cls._from_lengths_in_any_order(query_lens, seq_lens, block_table, block_size, decode_threshold)
        query_lens, seq_lens_list, capacity = _checked_lengths(query_lens, seq_lens, block_table, block_size)
        is_decode = [q <= decode_threshold for q in query_lens]
        if False in is_decode[: is_decode.count(True)]:  # a prefill before a decode
            raise ValueError(
                f"query_lens={query_lens}: decodes (query_len <= {decode_threshold}) must come before prefills; "
                "reorder with reorder_batch_to_split_decodes_and_prefills"
            )
        device = block_table.device
        num_reqs = len(query_lens)
        starts = list(itertools.accumulate(query_lens, initial=0))
        computed_list = list(map(operator.sub, seq_lens_list, query_lens))
        query_start_loc_cpu = host_int32(starts)
        seq_lens_cpu = host_int32(seq_lens_list)
        computed = host_int32(computed_list)
        total = starts[-1]
        if device.type == "cuda" and _device_slots():
            # every token's slot computed on the device (one launch) from the lengths, which reach it in two
            # queued copies (each in its own storage: a view at an offset that changes with the batch would
            # recompile a compiled caller): no per-token work on the host
            from mla_multi.kernels.cache_ops import slot_mapping as device_slot_mapping

            query_start_loc = to_device(query_start_loc_cpu, device)
            seq_lens = to_device(seq_lens_cpu, device)
            slot_mapping = device_slot_mapping(query_start_loc, seq_lens, block_table, block_size, total)
        else:
            # slot of each new token: block_table[req, pos // block_size] * block_size + pos % block_size,
            # gathered where the block table lives; the start locations and each token's (table entry,
            # offset) reach the device in one copy
            req_of_token = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(query_lens, dtype=torch.int64))
            positions = torch.arange(total) + (computed - query_start_loc_cpu[:-1]).long()[req_of_token]
            flat_index = req_of_token * block_table.shape[1] + positions // block_size
            packed = torch.cat([query_start_loc_cpu, flat_index.to(torch.int32),
                                (positions % block_size).to(torch.int32)])
            packed = to_device(packed, device)
            query_start_loc = packed[: num_reqs + 1]
            seq_lens = to_device(seq_lens_cpu, device)
            if total:
                blocks = block_table.reshape(-1).index_select(0, packed[num_reqs + 1 : num_reqs + 1 + total])
                slot_mapping = blocks.long() * block_size + packed[num_reqs + 1 + total :]
            else:
                slot_mapping = torch.zeros(0, dtype=torch.int64, device=device)
        metadata = cls(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=computed,
            block_table=block_table,
            slot_mapping=slot_mapping,
            block_size=block_size,
            num_reqs=num_reqs,
            num_actual_tokens=total,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens_list, default=0),
            decode_threshold=decode_threshold,
        )
        metadata.backend_plans[_HOST_LENGTHS] = (query_lens, computed_list)
        return metadata

    @classmethod
    def _from_lengths_in_any_order(cls, query_lens, seq_lens, block_table, block_size: int,
                                   decode_threshold: int) -> CommonAttentionMetadata:
        """`from_lengths(..., reorder=True)`: the caller's requests checked in the caller's order (errors name
        the caller's request), then built decodes first with their `batch_order`."""
        query_lens, seq_lens_list, capacity = _checked_lengths(query_lens, seq_lens, block_table, block_size)
        permutation = reorder_batch_to_split_decodes_and_prefills(query_lens, decode_threshold)
        order = BatchOrder.of(permutation, query_lens, block_table.device)
        if not order.identity:
            rows = to_device(torch.tensor(permutation, dtype=torch.int64), block_table.device)
            block_table = block_table.index_select(0, rows)
            query_lens = [query_lens[i] for i in permutation]
            seq_lens_list = [seq_lens_list[i] for i in permutation]
        metadata = cls.from_lengths(query_lens, seq_lens_list, block_table, block_size, decode_threshold)
        metadata.batch_order = order
        return metadata

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    def host_lengths(self) -> tuple[list[int], list[int]]:
        """(query_lens, num_computed_tokens) of every request as Python lists, made once per step (`from_lengths`
        keeps the lists it was given): the planning stage reads them without a tensor operation."""
        found = self.backend_plans.get(_HOST_LENGTHS)
        if found is None:
            found = self.backend_plans[_HOST_LENGTHS] = (self.query_lens_cpu.tolist(),
                                                         self.num_computed_tokens_cpu.tolist())
        return found


_HOST_LENGTHS = "host_lengths"  # the key of `CommonAttentionMetadata.host_lengths` in its backend_plans


def _describe(value) -> str:
    if torch.is_tensor(value):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    return repr(value)


def split_decodes_and_prefills(
    common_attn_metadata: CommonAttentionMetadata, decode_threshold: int | None = None
) -> tuple[int, int, int, int]:
    """(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens) of a batch ordered decodes first."""
    threshold = common_attn_metadata.decode_threshold if decode_threshold is None else decode_threshold
    query_lens = common_attn_metadata.host_lengths()[0]
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] <= threshold:
        num_decodes += 1
    num_decode_tokens = sum(query_lens[:num_decodes])
    return (
        num_decodes,
        len(query_lens) - num_decodes,
        num_decode_tokens,
        common_attn_metadata.num_actual_tokens - num_decode_tokens,
    )


@dataclasses.dataclass
class ChunkedContextMetadata:
    """How the cached context of the prefills is cut into workspace-sized chunks.

    starts [num_chunks, num_prefills] int32: first context position of each
    request in each chunk; seq_lens [num_chunks, num_prefills]; cu_seq_lens
    [num_chunks, num_prefills + 1] int32 (device); seq_tot[c] tokens in chunk c
    (never over the workspace); max_seq_lens[c] the longest piece of chunk c.
    """

    starts: torch.Tensor
    seq_lens: torch.Tensor
    cu_seq_lens: torch.Tensor
    seq_tot: list[int]
    max_seq_lens: list[int]
    max_context_chunk: int
    starts_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor

    @property
    def num_chunks(self) -> int:
        return len(self.seq_tot)


def plan_context_chunks(
    context_lens: Sequence[int] | torch.Tensor, workspace_tokens: int, block_size: int, device: torch.device | str = "cpu"
) -> ChunkedContextMetadata | None:
    """Cut the cached context of each prefill into chunks that fit `workspace_tokens` together.

    The workspace is shared equally among the prefills with context, rounded
    down to the block size (the gather starts on block boundaries); None when
    no prefill has context.
    """
    return _chunked_context(_as_int_list(context_lens, "context_lens"), workspace_tokens, block_size, device)[0]


def _chunked_context(
    context_lens: list[int], workspace_tokens: int, block_size: int, device, head: Sequence[int] = ()
) -> tuple[ChunkedContextMetadata | None, torch.Tensor, torch.Tensor]:
    """`plan_context_chunks`, and `head` (ints) as an int32 tensor on `device` and on the host: the tables are
    computed on the host in plain Python (a step plans them for every prefill: no tiny tensor operations) and
    reach the device in one copy together with `head`."""
    num_with_context = sum(1 for c in context_lens if c > 0)
    if num_with_context == 0:
        host = host_int32(head)
        return None, to_device(host, device), host
    max_context_chunk = (workspace_tokens // num_with_context) // block_size * block_size
    if max_context_chunk <= 0:
        raise ValueError(
            f"workspace_tokens={workspace_tokens} cannot hold one block of {block_size} tokens for each of the "
            f"{num_with_context} prefills with context; accepted: at least {num_with_context * block_size}"
        )
    num_chunks = -(-max(context_lens) // max_context_chunk)
    starts, seq_lens, cu = [], [], []
    for chunk in range(num_chunks):
        first = chunk * max_context_chunk
        row = [max(0, min(length, first + max_context_chunk) - first) for length in context_lens]
        starts.append([first] * len(context_lens))
        seq_lens.append(row)
        cu.append(list(itertools.accumulate(row, initial=0)))
    seq_tot = [row[-1] for row in cu]
    if max(seq_tot) > workspace_tokens:  # cannot happen by construction; guard the invariant
        raise AssertionError(f"context chunk of {max(seq_tot)} tokens exceeds the workspace of {workspace_tokens}")
    tables = list(head) + [v for rows in (starts, seq_lens, cu) for row in rows for v in row]
    host = host_int32(tables)
    packed = to_device(host, device)  # one host-to-device copy
    size, shape, cu_shape = num_chunks * len(context_lens), (num_chunks, len(context_lens)), (num_chunks, len(context_lens) + 1)
    offset = len(head)
    chunked = ChunkedContextMetadata(
        starts=packed[offset : offset + size].view(shape),
        seq_lens=packed[offset + size : offset + 2 * size].view(shape),
        cu_seq_lens=packed[offset + 2 * size :].view(cu_shape),
        seq_tot=seq_tot,
        max_seq_lens=[max(row) for row in seq_lens],
        max_context_chunk=max_context_chunk,
        starts_cpu=host[offset : offset + size].view(shape),
        seq_lens_cpu=host[offset + size : offset + 2 * size].view(shape),
    )
    return chunked, packed[:offset], host[:offset]


@dataclasses.dataclass
class MLAPrefillMetadata:
    """What prefill backends read: the prefill requests only, positions relative to the first prefill token.

    query_start_loc [num_prefills + 1] int32 (device); block_table rows of the
    prefills; context_lens_cpu tokens already cached per prefill.
    """

    query_start_loc: torch.Tensor
    max_query_len: int
    block_table: torch.Tensor
    context_lens_cpu: torch.Tensor
    chunked_context: ChunkedContextMetadata | None = None
    backend_plans: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    query_start_loc_cpu: torch.Tensor | None = None  # the host copy: planning reads it without a synchronisation


def build_prefill_metadata(
    common: CommonAttentionMetadata, workspace_tokens: int, metadata_cls: type = MLAPrefillMetadata,
    split: tuple[int, int, int, int] | None = None,
) -> MLAPrefillMetadata | None:
    """Prefill metadata of `common`'s prefills with their context chunks; None without prefills.
    `split`: the step's `split_decodes_and_prefills`, where the caller has it."""
    num_decodes, num_prefills, num_decode_tokens, _ = split or split_decodes_and_prefills(common)
    if num_prefills == 0:
        return None
    device = common.block_table.device
    query_lens, computed = common.host_lengths()
    start = list(itertools.accumulate(query_lens[num_decodes:], initial=0))
    context_lens = common.num_computed_tokens_cpu[num_decodes:]
    chunked, query_start_loc, query_start_loc_cpu = _chunked_context(
        computed[num_decodes:], workspace_tokens, common.block_size, device, head=start
    )
    return metadata_cls(
        query_start_loc=query_start_loc,
        max_query_len=max(query_lens[num_decodes:]),
        block_table=common.block_table[num_decodes:],
        context_lens_cpu=context_lens,
        chunked_context=chunked,
        query_start_loc_cpu=query_start_loc_cpu,
    )
