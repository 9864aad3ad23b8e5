"""`mla_multi.kernels`' shared rules: what a bound launch keeps from a call, and when."""

from __future__ import annotations

import types

import torch

from mla_multi.kernels import capturing, capturing_on, keep_unless_capturing


def test_nothing_is_captured_off_cuda():
    assert not capturing(torch.zeros(1)) and not capturing_on(torch.device("cpu"))


def test_what_a_capture_makes_is_not_kept_what_an_eager_call_makes_is():
    owner = types.SimpleNamespace(kept=None)
    made_in_capture = object()
    assert keep_unless_capturing(owner, "kept", made_in_capture, True) is made_in_capture
    assert owner.kept is None
    made_eagerly = object()
    assert keep_unless_capturing(owner, "kept", made_eagerly, False) is made_eagerly
    assert owner.kept is made_eagerly
