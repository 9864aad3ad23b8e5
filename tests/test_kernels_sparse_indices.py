"""The index-list launches around a trusting kernel (`kernels/sparse_indices`), run by the Triton interpreter.

The sanitising kernel against the contract's PyTorch form (`_sanitized`: every index outside [0, num_slots)
and every entry past the token's length -1, a token holding an index outside [-1, num_slots) marked, the
error flag set), for one list and for two in one launch (DeepSeek-V4's top-k and window lists), whole lists
in one block and lists longer than a block; columns past each list's width poisoned and left alone, every
access inside its tensors (`interpreter.memcheck`). The finishing kernel: a marked token's rows and LSE NaN,
a +inf LSE -inf, every other value as it was.
"""

import pytest
import torch

from interpreter import memcheck, print_results, run_interpreter_script

POISON = -7777
# (case, tokens, first list's width, second list's width or None, BLOCK, WHOLE, lengths given)
SANITIZE_CASES = [
    ("one-list-whole", 5, 40, None, 64, True, True),
    ("one-list-no-lengths", 3, 33, None, 64, True, False),
    ("two-lists-whole", 5, 40, 12, 64, True, True),
    ("one-list-in-blocks", 4, 40, None, 16, False, True),
    ("two-lists-in-blocks", 4, 40, 21, 16, False, True),
]


def _lists(generator, tokens, width, num_slots):
    indices = torch.randint(-1, num_slots, (tokens, width), generator=generator, dtype=torch.int32)
    lengths = torch.randint(0, width + 1, (tokens,), generator=generator, dtype=torch.int32)
    lengths[0] = width
    if tokens > 1:
        lengths[1] = 0
    return indices, lengths


def _sanitize_case(case):
    from mla_multi.kernels import sparse_indices as si

    name, tokens, width, width2, block, whole, has_length = case
    generator = torch.Generator().manual_seed(hash(name) % 1000)
    num_slots, num_slots2 = 97, 50
    indices, lengths = _lists(generator, tokens, width, num_slots)
    # bad data in token 2's first list (past its length too: bad wherever it lies), token 3 only in the second
    indices[2, width - 1] = num_slots
    indices[2, 0] = -5
    second = None
    if width2 is not None:
        indices2, lengths2 = _lists(generator, tokens, width2, num_slots2)
        indices2[3, width2 // 2] = num_slots2 + 3
        second = (indices2, lengths2)
    # the outputs wider than the lists, their extra columns poisoned
    out = torch.full((tokens, width + 5), POISON, dtype=torch.int32)
    out2 = torch.full((tokens, (width2 or 1) + 3), POISON, dtype=torch.int32)
    bad_rows = torch.full((tokens,), 99, dtype=torch.int8)
    flag = torch.zeros(1, dtype=torch.int32)
    length = lengths if has_length else out
    args2 = (indices, out, length, num_slots, width, indices.stride(0), out.stride(0))
    if second is not None:
        args2 = (second[0], out2, second[1], num_slots2, width2, second[0].stride(0), out2.stride(0))
    with memcheck() as violations:
        si._sanitize_indices_kernel[(tokens,)](
            indices, out, bad_rows, flag, length, num_slots, width, indices.stride(0), out.stride(0), *args2,
            BLOCK=block, BAD_IS_ERROR=True, HAS_LENGTH=has_length, SECOND=second is not None,
            HAS_LENGTH2=second is not None, WHOLE=whole)
    want, want_bad = si._sanitized(indices, num_slots, lengths if has_length else None, None)
    result = {
        "violations": violations,
        "clean": torch.equal(out[:, :width], want),
        "poison_kept": bool((out[:, width:] == POISON).all()),
        "flag": int(flag.item()),
    }
    if second is not None:
        want2, want_bad2 = si._sanitized(second[0], num_slots2, second[1], None)
        want_bad = want_bad | want_bad2
        result["clean2"] = torch.equal(out2[:, :width2], want2)
        result["poison2_kept"] = bool((out2[:, width2:] == POISON).all())
    result["bad_rows"] = bad_rows.tolist()
    result["want_bad_rows"] = want_bad.to(torch.int8).tolist()
    return result


def _finish_case(has_bad):
    from mla_multi.kernels import sparse_indices as si

    tokens, heads, width = 4, 3, 40
    generator = torch.Generator().manual_seed(7)
    out = torch.randn(tokens, heads, width, generator=generator).to(torch.bfloat16)
    lse = torch.randn(tokens, heads, generator=generator)
    lse[1, 0] = float("inf")
    lse[3, 2] = float("-inf")
    bad_rows = torch.tensor([0, 0, 1, 0], dtype=torch.int8)
    want_out, want_lse = out.clone(), lse.clone()
    want_lse[1, 0] = float("-inf")
    if has_bad:
        want_out[2] = float("nan")
        want_lse[2] = float("nan")
    with memcheck() as violations:
        si._finish_rows_kernel[(tokens,)](bad_rows if has_bad else lse, out, lse, heads * width, heads, out.stride(0),
                                          lse.stride(0), BLOCK=16, LSE_BLOCK=4, HAS_BAD=has_bad)
    return {"violations": violations, "out": torch.equal(out.isnan(), want_out.isnan())
            and torch.equal(out.nan_to_num(), want_out.nan_to_num()),
            "lse": torch.equal(lse.isnan(), want_lse.isnan()) and torch.equal(lse.nan_to_num(), want_lse.nan_to_num())}


def _interpreter_main() -> None:
    results = {case[0]: _sanitize_case(case) for case in SANITIZE_CASES}
    for has_bad in (True, False):
        results[f"finish-{has_bad}"] = _finish_case(has_bad)
    print_results(results)


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreter_script(__file__)


@pytest.mark.parametrize("case", [case[0] for case in SANITIZE_CASES])
def test_sanitize_kernel_gives_the_contracts_lists_marks_and_flag(interpreter_results, case):
    from mla_multi import errors

    result = interpreter_results[case]
    assert result["violations"] == [], result
    assert result["clean"] and result["poison_kept"], result
    assert result.get("clean2", True) and result.get("poison2_kept", True), result
    assert result["bad_rows"] == result["want_bad_rows"], result
    assert sum(result["want_bad_rows"]) >= 1  # the case holds bad data
    assert result["flag"] == errors.SPARSE_INDEX, result
    if case.startswith("two"):
        assert result["want_bad_rows"][3] == 1  # a bad index in the second list alone marks its token


@pytest.mark.parametrize("has_bad", [True, False])
def test_finish_kernel_poisons_marked_rows_and_turns_an_empty_lse_to_minus_inf(interpreter_results, has_bad):
    result = interpreter_results[f"finish-{has_bad}"]
    assert result["violations"] == [], result
    assert result["out"] and result["lse"], result


if __name__ == "__main__":
    _interpreter_main()
