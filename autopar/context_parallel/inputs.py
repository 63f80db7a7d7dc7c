"""A batch as the ranks of a context-parallel (cp) group see it: every token dimension split in zig-zag order.

With cp the model runs on sequence chunks, so everything a Hugging Face model derives from the *local* shape
must be handed to it from the *global* sequence instead:

* positions: ``position_ids`` (``(batch, seq)``, global positions, ``arange(seq)`` unless the caller passed
  its own) is split with the tokens, so rotary and learned position embeddings see global positions. A model
  without them would number each chunk from 0.
* labels of a causal LM: HF's ``ForCausalLMLoss`` shifts ``labels`` by one inside the model, which on a chunk
  would pair each chunk's last token with its own first label. The shift is done here on the whole sequence
  (``shift_labels``: ``labels[:, 1:]`` padded with -100) before the split, and the loss takes it unshifted.
* the causal mask: built inside the model from the local shapes (with zig-zag positions HF even reads the
  chunks as packed sequences); the cp attention replaces it by causality over global positions, so what the
  graph builds is never used. A padding ``attention_mask`` from the caller cannot be honoured and is refused.

`local_batch` gives one cp rank its share; `traced_batch` the batch the model is traced with for a cp plan:
the cp ranks' shares stacked on the batch dimension, ``(cp·batch, seq/cp)``, so one sequence's chunks are
rows of the data axis and every per-token op needs no rewriting (`passes.context_parallel`).

`splitting_sequences()` marks a trace of such chunks: code that runs inside the traced forward (a user's loss,
`autopar.loss`) asks `sequences_are_split()` whether the labels it sees are a chunk's, whose shift must come
from ``shift_labels``.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from autopar.context_parallel.layout import SequenceLayout, check_cp_sequence, shard_sequence
from autopar.errors import ConfigError

IGNORE_INDEX = -100
LAYOUT = SequenceLayout.ZIGZAG  # the layout cp plans run: causal attention costs every rank the same


_SPLIT = contextvars.ContextVar("autopar_sequences_split", default=False)


@contextlib.contextmanager
def splitting_sequences(split: bool = True):
    """Within it, a forward being traced runs on cp chunks of the sequences (`split`), or on whole ones."""
    token = _SPLIT.set(split)
    try:
        yield
    finally:
        _SPLIT.reset(token)


def sequences_are_split() -> bool:
    """Whether the forward being traced runs on cp chunks of its sequences (`splitting_sequences`)."""
    return _SPLIT.get()


def is_causal_lm(model: torch.nn.Module) -> bool:
    """Whether `model` is a Hugging Face causal LM, whose loss shifts its labels inside the model: its loss type
    says so, or transformers registers its class as a causal LM (GPT-2's `GPT2LMHeadModel` among them: its
    loss type is unset, and its loss function falls back to the causal one)."""
    name = type(model).__name__
    if getattr(model, "loss_type", None) == "ForCausalLM" or name.endswith("ForCausalLM"):
        return True
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # no transformers: not one of its models
        return False
    registered = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return any(name == v or (isinstance(v, tuple) and name in v) for v in registered)


def sequence_length(args, kwargs) -> int:
    """The sequence length of a batch: dim 1 of its first integer input of two or more dims (the token ids)."""
    for t in pytree.tree_leaves((tuple(args), dict(kwargs))):
        if isinstance(t, torch.Tensor) and t.ndim >= 2 and not t.is_floating_point():
            return int(t.shape[1])
    raise ConfigError("context parallelism splits the sequence, but the inputs hold no (batch, seq) token ids")


def check_cp_inputs(args, kwargs, cp: int) -> int:
    """Raise ConfigError unless the batch can be split over `cp` ranks; return its sequence length."""
    seq = sequence_length(args, kwargs)
    check_cp_sequence(seq, cp, LAYOUT)
    if kwargs.get("attention_mask") is not None:
        raise ConfigError(
            "context parallelism runs attention causally over global positions and cannot take a "
            "padding attention_mask: drop attention_mask and mark padded tokens with label -100 "
            "instead (or plan without cp)"
        )
    for t in pytree.tree_leaves((tuple(args), dict(kwargs))):
        if isinstance(t, torch.Tensor) and t.ndim and (t.ndim < 2 or t.shape[1] != seq):
            raise ConfigError(
                f"context parallelism splits every input along its sequence dim (dim 1, {seq} "
                f"tokens), but an input has shape {tuple(t.shape)}"
            )
    return seq


def _with_global_sequence(args, kwargs, causal_lm: bool) -> tuple[tuple, dict]:
    """The inputs plus what the model would otherwise derive from the local shape (positions, shifted labels)."""
    seq = sequence_length(args, kwargs)
    kwargs = dict(kwargs)
    like = next(t for t in pytree.tree_leaves((tuple(args), kwargs)) if isinstance(t, torch.Tensor) and t.ndim >= 2)
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = torch.arange(seq, device=like.device).expand(like.shape[0], seq).contiguous()
    labels = kwargs.get("labels")
    if causal_lm and labels is not None and kwargs.get("shift_labels") is None:
        kwargs["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return tuple(args), kwargs


def local_batch(args, kwargs, cp: int, cp_rank: int, *, causal_lm: bool) -> tuple[tuple, dict]:
    """Rank `cp_rank`'s share of a batch for a cp group of `cp`: every (batch, seq, ...) tensor split on dim 1."""
    args, kwargs = _with_global_sequence(args, kwargs, causal_lm)

    def split(t):
        return shard_sequence(t, 1, cp, cp_rank, LAYOUT) if isinstance(t, torch.Tensor) and t.ndim >= 2 else t

    return pytree.tree_map(split, (args, kwargs))


def traced_batch(args, kwargs, cp: int, *, causal_lm: bool) -> tuple[tuple, dict]:
    """The batch a cp plan traces the model with: the cp ranks' shares stacked on dim 0, (cp·batch, seq/cp)."""
    shares = [local_batch(args, kwargs, cp, c, causal_lm=causal_lm) for c in range(cp)]
    flat = [pytree.tree_flatten(s)[0] for s in shares]
    spec = pytree.tree_flatten(shares[0])[1]
    joined = [
        torch.cat(list(vals)) if isinstance(vals[0], torch.Tensor) and vals[0].ndim else vals[0]
        for vals in zip(*flat, strict=True)
    ]
    return pytree.tree_unflatten(joined, spec)
