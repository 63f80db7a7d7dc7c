"""What a program hands the checkpoint code: the `Checkpointable` protocol.

The checkpoint code (training checkpoints in `training`, Hugging Face weights in `hf`) reads and writes a program
only through these names, as torchtitan's checkpointer holds `Stateful` states and never a trainer's insides. Every
program kind implements them (`autopar.runtime.base.Program` once, a kind overriding what it holds its own way); a
test double implements them too (tests/test_checkpoint_hf.py). Nothing here imports the runtime.

- `checkpoint_names`: the `ModelNames` of the model the program was built from (names, shapes, dtypes);
- `checkpoint_masters()`: name -> this rank's `Piece` of each master weight, live storage (a checkpoint read into
  a piece changes the program);
- `checkpoint_optimizer_state()`: name -> {state: a `Piece` shaped like the master's, or a tensor the same on every
  holder (a step count)}, live storage too;
- `prepare_optimizer_state()` / `reset_optimizer_state()`: create the optimizer's states (before a first step there
  are none to read into) / forget them (a checkpoint written before a first step is being loaded);
- `checkpoint_buffers()`: the persistent buffers (running statistics), live, whole on every rank;
- `checkpoint_meta()` / `restore_checkpoint_meta(meta)`: plain data (JSON: numbers, strings, lists, dicts) of the
  step, loss scale, optimizer hyperparameters and layout; restored after a load;
- `after_checkpoint_load()`: make what the program computes with agree with masters and buffers just written into.

A program may also hold a step guard as `guard` (`autopar.runtime.step_guard.StepGuard`): its `skipped_steps` is
saved and restored, and its `accumulating` calls (gradients waiting for their step) refuse a save or a load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from autopar.checkpoint.pieces import Piece


@dataclass(frozen=True, slots=True)
class ModelNames:
    """The names a checkpoint or a weights folder keys a model's tensors by.

    Attributes:
        first_names: every parameter name (tied ones included) -> the first name of its tensor, the name its
            master goes by.
        masters: the masters' names, in the model's order.
        shapes: master name -> its full shape.
        dtypes: every state-dict name -> the dtype the model was handed in.
        persistent_buffers: the buffers `state_dict` holds (running statistics and the like), in order.
    """

    first_names: Mapping[str, str]
    masters: tuple[str, ...]
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, torch.dtype]
    persistent_buffers: tuple[str, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelNames:
        """The names of `model` (before any program changes it)."""
        state = model.state_dict(keep_vars=True)
        first: dict[int, str] = {}
        first_names = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
        return cls(
            first_names=first_names,
            masters=tuple(dict.fromkeys(first_names.values())),
            shapes={n: tuple(p.shape) for n, p in model.named_parameters()},
            dtypes={k: v.dtype for k, v in state.items()},
            persistent_buffers=tuple(n for n in state if n not in first_names),
        )


@runtime_checkable
class Checkpointable(Protocol):
    """A program as the checkpoint code sees it (see the module docstring)."""

    checkpoint_names: ModelNames

    def checkpoint_masters(self) -> dict[str, Piece]: ...

    def checkpoint_optimizer_state(self) -> dict[str, dict]: ...

    def prepare_optimizer_state(self) -> None: ...

    def reset_optimizer_state(self) -> None: ...

    def checkpoint_buffers(self) -> dict[str, torch.Tensor]: ...

    def checkpoint_meta(self) -> dict: ...

    def restore_checkpoint_meta(self, meta: dict) -> None: ...

    def after_checkpoint_load(self) -> None: ...
