"""Sequence lengths up to the planned one, on the plan's layout, without planning again.

A plan is made for batches of B rows of S tokens. A batch of B rows of S' < S tokens (every input whose dim 1 is
the planned S has S' there, the other dims as planned) runs on the same layout: mesh, parameter placements,
ZeRO stage, micro-batches, buckets, optimizer. What a program needs for the new length:

- data-parallel: the model traced again at the new length (one rank's share of one micro-batch) and the program's
  graph passes run on it; the gradient buckets and their hooks belong to the parameters and stay;
- sharded: the model traced again and lowered with the plan's placements as at compile (`passes.lower`): the plan's
  per-node placements name the graph's nodes, which a trace at another length has too (checked: a graph whose
  nodes differ is refused with what to do); buckets, prefetch groups and released weights belong to the
  parameters and stay. With a cp axis the new length must split into the zig-zag chunks (2 cp of them);
- offload: the model runs eagerly over its chunks: any length, nothing traced;
- pipeline: the model traced again and cut into the plan's stages, each lowered with its stage plan's placements as
  at compile (a trace whose nodes differ, or whose stages read other parameters, is refused); the stages' send and
  receive buffers (`PipelineStage`) and the schedule are made anew whenever the length changes, shaped by it, so
  only the current length's buffers are held. Every rank of a pp group has the same rows, so a sender and its
  receiver switch at the same step and agree on the shape without exchanging it. Parameters, buckets, gradient
  hooks and tie groups belong to the parameters and stay.

Each length is traced the first time a batch of it comes, with the program's own tracer (`compile` hands it one
over a copy of the model whose parameters are fake tensors, so nothing of the model's size is held), and kept:
at most `MAX_LENGTHS` lengths per program besides the planned one, the least recently used dropped (traced again
if it comes back). A batch longer than the planned length is refused: plan (compile) for that length.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from autopar.errors import ConfigError

MAX_LENGTHS = 8  # traced lengths a program keeps besides its planned one


def planned_length(args, kwargs) -> int | None:
    """The sequence length of a batch: dim 1 of its first integer input of two or more dims (None: no such input)."""
    for t in pytree.tree_leaves((tuple(args), dict(kwargs))):
        if isinstance(t, torch.Tensor) and t.ndim >= 2 and not t.is_floating_point():
            return int(t.shape[1])
    return None


def shorter_length(expected: dict, got: dict, planned: int | None, where: str) -> int | None:
    """The length of a batch whose inputs (`input_signature`s) differ from the planned ones only in a shorter
    sequence (every input whose dim 1 was `planned` has the same shorter one); None if it differs otherwise
    (the caller says how). ConfigError for a longer one."""
    if planned is None or set(got) != set(expected):
        return None
    lengths = set()
    for name, (shape, dtype) in expected.items():
        g_shape, g_dtype = got[name]
        if shape is None or g_shape is None or g_dtype != dtype or len(g_shape) != len(shape):
            if (shape, dtype) != (g_shape, g_dtype) and not (shape is None and g_shape is None):
                return None
            continue
        if len(shape) >= 2 and shape[1] == planned and g_shape[0] == shape[0] and g_shape[2:] == shape[2:]:
            lengths.add(g_shape[1])
        elif g_shape != shape:
            return None
    if len(lengths) != 1:
        return None
    length = lengths.pop()
    if length > planned:
        raise ConfigError(
            f"{where}: the batch holds sequences of {length} tokens, longer than the {planned} the program was "
            f"planned for; compile again with an example batch of {length} tokens (the longest you train on), "
            f"which runs every shorter one too"
        )
    return length


def fake_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters are fake tensors (no storage) and buffers real: what the program traces
    again at another length, without holding the model's weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        if id(p) not in memo:
            with mode:
                fake = torch.empty(p.shape, dtype=p.dtype, device="meta" if p.is_meta else p.device)
            memo[id(p)] = torch.nn.Parameter(fake, p.requires_grad)
    return copy.deepcopy(model, memo)


class Lengths:
    """The traced states of one program by sequence length (module docstring).

    A program says what of it depends on the trace (`Program._per_length`: attribute names) and how to bind a new
    trace (`Program._bind_trace`); this keeps those attributes per length and switches between them.
    """

    def __init__(self, planned: int | None, tracer: Callable | None = None):
        self.planned, self.current, self.tracer = planned, planned, tracer
        self._kept: OrderedDict[int, dict] = OrderedDict()

    def use(self, program, length: int, trace_inputs: Callable[[], tuple]) -> None:
        """Make `program` run sequences of `length`: its state for that length, traced now if it was not kept.
        `trace_inputs()` gives the (args, kwargs) to trace with (one part of the batch, as compile traced)."""
        if length == self.current:
            return
        names = program._per_length
        if names:
            self._kept[self.current] = {n: getattr(program, n) for n in names}
            self._kept.move_to_end(self.current)
            state = self._kept.pop(length, None)
            if state is None:
                if self.tracer is None:
                    raise ConfigError(
                        f"the program was built without a tracer and runs only {self.planned} tokens; build it with "
                        f"autopar.compile to run shorter sequences"
                    )
                args, kwargs = trace_inputs()
                program._bind_trace(self.tracer(args, kwargs))
            else:
                for name, value in state.items():
                    setattr(program, name, value)
            self._evict(length)
        self.current = length

    def _evict(self, current: int) -> None:
        """Drop the least recently used lengths beyond MAX_LENGTHS besides the planned one (`current` included)."""
        others = [k for k in self._kept if k != self.planned]
        while len(others) + (current != self.planned) > MAX_LENGTHS:
            del self._kept[others.pop(0)]

    @property
    def traced(self) -> list[int]:
        """The lengths held: the planned one, those kept, the current one."""
        return sorted({self.current, *self._kept} - {None})
