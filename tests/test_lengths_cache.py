"""The per-length cache of traced states (`autopar.runtime.shapes`): traced once per length, bounded, and which
batches count as a shorter sequence."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import ConfigError
from autopar.runtime.base import input_signature
from autopar.runtime.shapes import MAX_LENGTHS, Lengths, shorter_length


class _Program:
    """What `Lengths` asks of a program: the attributes kept per length and how to bind a trace."""

    _per_length = ("graph",)

    def __init__(self):
        self.graph = "traced at 64"
        self.bound: list[int] = []

    def _bind_trace(self, traced):
        self.graph = traced
        self.bound.append(int(traced.split()[-1]))


def test_each_length_is_traced_once_and_at_most_max_lengths_are_kept():
    program = _Program()
    lengths = Lengths(64, tracer=lambda args, kwargs: f"traced at {args[0]}")
    for n in [*range(1, MAX_LENGTHS + 1), 1, 2]:
        lengths.use(program, n, lambda n=n: ((n,), {}))
        assert program.graph == f"traced at {n}"
    assert program.bound == list(range(1, MAX_LENGTHS + 1))  # 1 and 2 came back from the cache
    lengths.use(program, 64, lambda: ((64,), {}))  # the planned one is kept, never traced again
    assert program.graph == "traced at 64" and program.bound[-1] == MAX_LENGTHS
    lengths.use(program, MAX_LENGTHS + 1, lambda: ((MAX_LENGTHS + 1,), {}))  # one more: the oldest (3) goes
    assert len(lengths.traced) == MAX_LENGTHS + 1 and 3 not in lengths.traced and 64 in lengths.traced
    lengths.use(program, 3, lambda: ((3,), {}))
    assert program.bound[-1] == 3  # traced again


def _signature(seq: int, mask_seq: int | None = None, rows: int = 4):
    ids = torch.zeros(rows, seq, dtype=torch.long)
    mask = torch.ones(rows, mask_seq if mask_seq is not None else seq, dtype=torch.long)
    return input_signature((ids,), {"attention_mask": mask, "flag": True})


def test_a_shorter_sequence_is_one_length_on_every_sequence_input():
    planned = _signature(16)
    assert shorter_length(planned, _signature(16), 16, "train_step") == 16
    assert shorter_length(planned, _signature(8), 16, "train_step") == 8
    assert shorter_length(planned, _signature(8, mask_seq=12), 16, "train_step") is None  # two lengths
    assert shorter_length(planned, _signature(8, rows=2), 16, "train_step") is None  # other rows: not a length
    with pytest.raises(ConfigError, match="longer than the 16"):
        shorter_length(planned, _signature(32), 16, "train_step")
