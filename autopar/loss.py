"""The user's loss: `compile(..., loss_fn=fn)` with `fn(outputs, batch) -> scalar`, global over the ranks.

The loss is computed in the traced graph, after the model: `with_loss(model, ...)` gives a module that
shares the model's parameters, buffers and names (nothing is copied or renamed) and whose forward is
`fn(model(*args, **model_kwargs), batch)`, where `batch` is the dict of the call's keyword inputs and the
model gets every keyword but those named in `loss_inputs` (default `("labels",)`: a Hugging Face model given
labels would compute its own loss too).

The rule (`loss_reduction`):

- "mean" (default): `fn` returns the mean over the loss tokens of the batch it is given, and
  `loss_tokens(batch)` counts them (default `count_loss_tokens`: the labels other than -100 in
  `batch["labels"]`, without each row's first position for a causal LM, whose labels are shifted by one; the
  batch's rows when it has no labels). The global loss is the mean over every loss token of the global
  batch: sum_s n_s L_s / n over the shards s the program cuts the step into (ranks, micro-batches), n_s the
  shard's tokens and n = sum_s n_s: exact whatever the padding on each rank. A shard may hold no loss token
  (a rank given only padding): `fn` must then return a finite value, e.g. divide by `count.clamp(min=1)`.
- "sum": `fn` returns a sum over its rows; the global loss is the sum over the shards (a sum stays a sum).

The batch `fn` gets (`LossSpec.batch`): for a causal LM it holds ``shift_labels`` besides ``labels``:
``labels[:, 1:]`` padded with -100 on the right, the target of each position (Hugging Face's name for it). Under
context parallelism (a cp axis) each rank holds a zig-zag chunk of every sequence, on which ``labels[:, 1:]``
would pair a chunk's last position with its own first label: there the batch holds this rank's chunk of the
whole sequence's ``shift_labels`` and no ``labels``, so a loss written over ``shift_labels`` (without a shift of
its own) runs on every plan, and one that reads ``labels`` is refused with a clear error. The loss tokens are
counted on ``shift_labels`` too, so the chunks' counts add up to the sequence's: with the rule above the global
loss is then the sum of every rank's token losses over the global count, exactly one process's.

How: a program averages a loss it does not recognise over its N shards with equal weights (N: the data-axis
ranks times the micro-batches: every program runs each rank's rows on plain local tensors). The traced module
returns N n_s L_s / n ("sum": N L_s), N / n fed each step as the input `LOSS_SCALE` computed from the global
batch (`LossSpec.scale`), so that average is the global loss, and its gradients those of the global loss.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.context_parallel.inputs import IGNORE_INDEX, sequences_are_split
from autopar.errors import ConfigError
from autopar.runtime.collectives import waiting_for

LOSS_SCALE = "_autopar_loss_scale"  # the keyword input that carries N / n
REDUCTIONS = ("mean", "sum")


def count_loss_tokens(batch: dict, *, causal_lm: bool = False) -> torch.Tensor:
    """Loss tokens of a batch: labels other than -100, each row's first position left out for a causal LM
    (its loss compares position t's logits with label t+1); the batch's rows when it has no labels."""
    shifted = batch.get("shift_labels")
    if causal_lm and isinstance(shifted, torch.Tensor):  # already shifted: a cp chunk's, or the loss's batch
        return (shifted != IGNORE_INDEX).sum()
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor):
        if causal_lm and labels.ndim >= 2:
            labels = labels[:, 1:]
        return (labels != -100).sum()
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.ndim:
            return torch.tensor(value.shape[0])
    raise ConfigError("loss_fn: the batch holds no tensor to count loss tokens in; pass loss_tokens=")


@dataclass(frozen=True, slots=True)
class LossSpec:
    """A user's loss and its rule (module docstring)."""

    fn: Callable
    reduction: str = "mean"
    loss_inputs: tuple[str, ...] = ("labels",)
    tokens: Callable | None = None  # batch -> tokens; None: `count_loss_tokens`
    causal_lm: bool = False

    def __post_init__(self):
        if not callable(self.fn):
            raise ConfigError(f"loss_fn must be a callable (outputs, batch) -> scalar, got {type(self.fn).__name__}")
        if self.reduction not in REDUCTIONS:
            raise ConfigError(f"loss_reduction={self.reduction!r}: expected one of {', '.join(REDUCTIONS)}")
        if self.tokens is not None and not callable(self.tokens):
            raise ConfigError(f"loss_tokens must be a callable batch -> count, got {type(self.tokens).__name__}")

    def batch(self, kwargs: dict, *, split: bool = False) -> dict:
        """The batch `fn` and `tokens` get from a call's keywords (module docstring): for a causal LM with
        ``shift_labels`` added (whole sequences) or without ``labels`` (`split`: a cp rank's chunks, whose
        ``shift_labels`` the program cut from the whole sequence's)."""
        batch = dict(kwargs)
        if not self.causal_lm:
            return batch
        if split:
            batch.pop("labels", None)
        elif isinstance(batch.get("labels"), torch.Tensor) and batch.get("shift_labels") is None:
            labels = batch["labels"]
            if labels.ndim >= 2:
                batch["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return batch

    def count(self, batch: dict) -> torch.Tensor:
        """The loss tokens of `batch` (a scalar tensor)."""
        if self.tokens is not None:
            n = self.tokens(batch)
            return n if isinstance(n, torch.Tensor) else torch.tensor(n)
        return count_loss_tokens(batch, causal_lm=self.causal_lm)

    def scale(self, shards: int, tokens: float | None) -> torch.Tensor:
        """N / n for a step of n loss tokens (`global_tokens`) cut into N = `shards` shards; N for "sum"."""
        if self.reduction == "sum":
            return torch.tensor(float(shards), dtype=torch.float64)
        return torch.tensor(shards / max(float(tokens), 1.0), dtype=torch.float64)


def global_tokens(spec: LossSpec, feed, kwargs: dict) -> float | None:
    """The loss tokens of the step's global batch (None for a summed loss): counted on the batch when every rank
    passes it, summed over the data-parallel ranks (one all-reduce) when each passes its own rows."""
    if spec.reduction == "sum":
        return None
    n = float(spec.count(spec.batch(kwargs)))
    if not feed.local_batch or feed.world == 1:
        return n
    total = torch.tensor([n / feed.copies], dtype=torch.float64, device=feed.device)
    with waiting_for("the all-reduce of the step's loss tokens over the data-parallel ranks"):
        dist.all_reduce(total)
    return round(float(total), 6)


def with_loss(model: torch.nn.Module, spec: LossSpec) -> torch.nn.Module:
    """A module over the model's own parameters, buffers and submodules (a shallow copy: same names, same
    tensors, its config and class name kept) whose forward returns the scaled user loss (module docstring)."""
    cls = type(model)
    forward = _loss_forward(cls)
    wrapped = copy.copy(model)
    wrapped.__class__ = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    wrapped.__dict__["_autopar_loss"] = spec
    return wrapped


_SPLIT_LABELS = (
    "loss_fn read batch['labels'] on a plan with a cp axis: each rank holds a chunk of every sequence, on which "
    "labels[:, 1:] would pair a chunk's last position with its own first label. Read batch['shift_labels'] "
    "instead (the target of each position, already shifted, -100 where none; present on every plan) without "
    "shifting again, or plan without cp (constraints={'cp': 1})"
)


def _loss_forward(cls):
    inner = cls.forward

    def forward(self, *args, **kwargs):
        spec: LossSpec = self.__dict__["_autopar_loss"]
        scale = kwargs.pop(LOSS_SCALE)
        # shift_labels: the loss's (a causal LM's targets, `LossSpec.batch`), never the model's
        hidden = set(spec.loss_inputs) | ({"shift_labels"} if spec.causal_lm else set())
        model_kwargs = {k: v for k, v in kwargs.items() if k not in hidden}
        outputs = inner(self, *args, **model_kwargs)
        split = sequences_are_split()
        batch = spec.batch(kwargs, split=split)
        try:
            loss = spec.fn(outputs, batch)
        except KeyError as e:
            if split and spec.causal_lm and e.args == ("labels",):
                raise ConfigError(_SPLIT_LABELS) from e
            raise
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ConfigError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        if spec.reduction == "mean":
            loss = loss * spec.count(batch).to(loss.dtype)
        return (loss * scale.to(loss.dtype),)

    return forward
