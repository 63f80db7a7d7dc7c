"""Collectives that do not communicate: the step a method would run if its communication cost nothing.

`autopar bench run` measures the communication a step waits for (its exposed communication) as the step's
time minus the same step's time with every collective replaced by a no-op. Every torch.distributed
collective reaches the backend through one of c10d's dispatcher ops (`c10d::allreduce_`,
`c10d::_allgather_base_`, ...): `dist.all_reduce` and friends, the functional collectives DTensor issues
(`_c10d_functional::*` call the process group, which calls these ops), FSDP2's all-gathers and
reduce-scatters, and DDP's reducer, which calls the process group from C++. `noop_collectives()` replaces
the CPU kernels of those ops for the duration of a `with` block and restores gloo's on leaving it.

A replaced collective returns a completed work handle at once (so `wait()`, async handles and
`wait_tensor` behave as before) and leaves its outputs with values of the right kind: an all-reduce or a
broadcast leaves its tensors as they are (this rank's contribution), an all-gather fills every rank's slot
with this rank's input, a reduce-scatter gives this rank the first slot of its input. The compute that
follows runs on the same shapes and on finite values; the copies stand in for the ones the backend makes.
What is replaced is counted per op (`NoopCollectives.counts`), so a caller can check that a step's
collectives did go through here. `c10d::barrier` is left alone: the bench's own synchronisation needs it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _done(result) -> object:
    """A work handle that is already complete (the future's value is what gloo's handle would give)."""
    fut = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut).boxed()


def _source(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`src`, copied first when it lies in `out`'s storage (FSDP2 gathers in place: its input is its slot)."""
    same = src.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    return src.clone() if same else src


def _gather_into(out: torch.Tensor, inp: torch.Tensor) -> None:
    out.view(-1, inp.numel()).copy_(_source(inp, out).reshape(1, -1))


def _first_slot(out: torch.Tensor, inp: torch.Tensor) -> None:
    out.copy_(_source(inp.reshape(-1, out.numel())[0], out).view_as(out))


def _kernels(counts: Counter) -> dict:
    """Op name -> the no-op kernel standing in for gloo's (same schema as the op)."""

    def allreduce_(tensors, pg, op, sparse_indices, async_op=True, timeout=-1):
        counts["allreduce_"] += 1
        return tensors, _done(tensors)

    def allreduce_coalesced_(tensors, pg, op, async_op=True, timeout=-1):
        counts["allreduce_coalesced_"] += 1
        return _done(tensors)

    def broadcast_(tensors, pg, root_rank, root_tensor, async_op=True, timeout=-1):
        counts["broadcast_"] += 1
        return tensors, _done(tensors)

    def allgather_(outputs, inputs, pg, async_op=True, timeout=-1):
        counts["allgather_"] += 1
        for outs, inp in zip(outputs, inputs, strict=True):
            for out in outs:
                out.copy_(inp)
        return outputs, _done(outputs)

    def _allgather_base_(out, inp, pg, async_op=True, timeout=-1):
        counts["_allgather_base_"] += 1
        _gather_into(out, inp)
        return out, _done(out)

    def allgather_into_tensor_coalesced_(outputs, inputs, pg, async_op=True):
        counts["allgather_into_tensor_coalesced_"] += 1
        for out, inp in zip(outputs, inputs, strict=True):
            _gather_into(out, inp)
        return _done(outputs)

    def reduce_scatter_(outputs, inputs, pg, op, async_op=True, timeout=-1):
        counts["reduce_scatter_"] += 1
        for out, ins in zip(outputs, inputs, strict=True):
            out.copy_(ins[0])
        return outputs, _done(outputs)

    def _reduce_scatter_base_(out, inp, pg, op, async_op=True, timeout=-1):
        counts["_reduce_scatter_base_"] += 1
        _first_slot(out, inp)
        return out, _done(out)

    def reduce_scatter_tensor_coalesced_(outputs, inputs, pg, op, async_op=True, timeout=-1):
        counts["reduce_scatter_tensor_coalesced_"] += 1
        for out, inp in zip(outputs, inputs, strict=True):
            _first_slot(out, inp)
        return _done(outputs)

    def alltoall_base_(out, inp, pg, output_split_sizes, input_split_sizes, async_op=True, timeout=-1):
        counts["alltoall_base_"] += 1
        if out.numel() == inp.numel():
            out.copy_(inp.view_as(out))
        return _done(out)

    return {
        f.__name__: f
        for f in (
            allreduce_,
            allreduce_coalesced_,
            broadcast_,
            allgather_,
            _allgather_base_,
            allgather_into_tensor_coalesced_,
            reduce_scatter_,
            _reduce_scatter_base_,
            reduce_scatter_tensor_coalesced_,
            alltoall_base_,
        )
    }


class NoopCollectives:
    """What a `noop_collectives()` block replaced: `counts`, op name -> calls."""

    def __init__(self):
        self.counts: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextmanager
def noop_collectives() -> Iterator[NoopCollectives]:
    """Within the block, every c10d collective on CPU tensors completes at once without communicating.

    Every rank of a group must enter and leave the block at the same point of its program (a collective one rank
    runs for real while its peer skips it would wait forever). The kernels are process-wide while the block runs.
    """
    import warnings

    record = NoopCollectives()
    lib = torch.library.Library("c10d", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")  # "overriding a previously registered kernel"
            for name, kernel in _kernels(record.counts).items():
                lib.impl(name, kernel, "CPU")
        yield record
    finally:
        lib._destroy()  # gloo's kernels are registered again
