"""The checkpoint methods every program shares: saving and loading training checkpoints and Hugging Face weights,
and the checkpoint protocol (`autopar.checkpoint.protocol.Checkpointable`) the checkpoint writers and readers call.

`ProgramCheckpoints` is a mixin of `autopar.runtime.base.Program`: the methods stay the program's (its public
surface and the protocol), written once here; a program kind overrides `checkpoint_masters` and
`after_checkpoint_load`, and gives `_named_buffers` and its optimizer.
"""

from __future__ import annotations

import torch

from autopar.checkpoint import hf, training
from autopar.checkpoint.pieces import Piece
from autopar.runtime.collectives import waiting_for


class ProgramCheckpoints:
    """The checkpoints of a `Program` (a mixin of it: see the module docstring)."""

    def save_checkpoint(
        self, path, *, extra: dict | None = None, keep_last: int | None = None, async_save: bool = False
    ):
        """Write the training state (masters, optimizer states, step, loss scale, every rank's RNG states and
        `extra`: plain data and tensors) to the directory `path`, sharded, atomically; keep only the `keep_last`
        newest checkpoints this run wrote next to it; returns the path. Every rank calls it. See
        `autopar.checkpoint.training`.

        With `async_save=True` it returns once the state is copied to CPU memory, with a
        `concurrent.futures.Future` of the path; the files are written and the checkpoint committed in the
        background (`wait_checkpoint` waits; the next save or load waits for it too)."""
        with waiting_for(f"the other ranks in save_checkpoint({path})"):
            return training.save(self, path, extra=extra, keep_last=keep_last, async_save=async_save)

    def wait_checkpoint(self) -> str | None:
        """Wait until the asynchronous save in flight (if any) is written and committed; returns its path (None
        when there was none) or raises what it raised. Every rank calls it."""
        with waiting_for("the other ranks to write and commit the asynchronous checkpoint"):
            return training.wait_checkpoint(self)

    def load_checkpoint(self, path) -> dict:
        """Read a checkpoint of this model written under any plan; returns the `extra` dict it was saved with.
        A load that fails leaves the program as it was."""
        with waiting_for(f"the other ranks in load_checkpoint({path})"):
            return training.load(self, path)

    def save_pretrained(self, path, *, max_shard_size="2GB", merged: bool = False) -> None:
        """Write the weights as Hugging Face safetensors (sharded with an index above `max_shard_size`, each file
        written by one rank) with the model's config. Every rank calls it. See `autopar.checkpoint.hf`.

        A PEFT model writes its adapters as PEFT does (`PeftModel.from_pretrained` reads them), or with `merged`
        the base model with the adapters merged in (`autopar.checkpoint.peft`)."""
        hf.save_pretrained(self, path, max_shard_size=max_shard_size, merged=merged)

    def load_pretrained(self, path) -> None:
        """Read Hugging Face safetensors weights into the masters, each rank only the slices it holds."""
        hf.load_pretrained(self, path)

    def checkpoint_masters(self) -> dict[str, Piece]:
        """name -> this rank's piece of each master weight (live storage) under the model's first name of each
        tensor."""
        raise NotImplementedError

    def checkpoint_optimizer_state(self) -> dict[str, dict]:
        """name -> {state: Piece for a tensor shaped like the master's piece, else the value} of this rank's
        optimizer states, for a torch.optim optimizer over the pieces' `param`s."""
        out = {}
        for name, piece in self.checkpoint_masters().items():
            state = self.optimizer.state.get(piece.param) if piece.param is not None else None
            if not state:
                continue
            out[name] = {
                k: piece.like(v) if isinstance(v, torch.Tensor) and v.shape == piece.tensor.shape and v.ndim else v
                for k, v in state.items()
                if isinstance(v, torch.Tensor)
            }
        return out

    def prepare_optimizer_state(self) -> None:
        """Create the optimizer's states (before a first step there are none to read a checkpoint into): one
        step at lr 0 on zero gradients, as torch.distributed.checkpoint.state_dict does."""
        if any(self.optimizer.state.values()):
            return
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        saved_grads = [p.grad for p in params]
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, g in zip(params, saved_grads, strict=True):
            p.grad = g

    def reset_optimizer_state(self) -> None:
        """Forget the optimizer's states, as before a first step (a checkpoint saved then is being loaded)."""
        self.optimizer.state.clear()

    def checkpoint_buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers (state a step may change), live, whole on every rank. Non-persistent buffers
        (rotary tables) are derived from the config and are not saved, as `state_dict` leaves them out."""
        buffers = self._named_buffers()
        return {n: buffers[n] for n in self.checkpoint_names.persistent_buffers if n in buffers}

    def checkpoint_meta(self) -> dict:
        """Plain data: the step, the loss scale, the optimizer's hyperparameters, the layout that wrote it."""
        return {
            "step": self.num_steps,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "param_groups": [plain_hyperparameters(g) for g in getattr(self.optimizer, "param_groups", [])],
            "layout": {
                "program": str(self.plan.program),
                "mesh": dict(self.plan.mesh),
                "model": self.plan.model_name,
            },
        }

    def restore_checkpoint_meta(self, meta: dict) -> None:
        """Take the step, loss scale and the hyperparameters a schedule may have moved from `checkpoint_meta`'s
        data (values of the types the optimizer holds: a tuple stays a tuple, a tensor is filled)."""
        self.num_steps = int(meta.get("step", 0))
        if self.scaler is not None and meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])
        groups = meta.get("param_groups") or []
        mine = getattr(self.optimizer, "param_groups", [])
        if len(groups) == len(mine):
            for group, saved in zip(mine, groups, strict=True):
                for k, v in saved.items():
                    if k == "params" or k not in group or not _same_kind(group[k], v):
                        continue
                    if isinstance(group[k], torch.Tensor):
                        group[k].fill_(v)
                    else:
                        group[k] = tuple(v) if isinstance(group[k], tuple) else v

    def after_checkpoint_load(self) -> None:
        """Make what the program computes with agree with masters just read (copies, payloads)."""


def plain_hyperparameters(group: dict) -> dict:
    """An optimizer param group's hyperparameters as plain data: numbers, strings, booleans, None, tuples and lists
    of those, a one-element tensor as its number; other values (and `params`) are left out."""
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor):
            if v.numel() == 1:
                out[k] = v.item()
        elif _is_plain(v):
            out[k] = list(v) if isinstance(v, tuple) else v
    return out


def _is_plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (tuple, list)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value)


def _same_kind(held, saved) -> bool:
    """Whether a saved hyperparameter can replace the one an optimizer holds (a number for a number or a
    one-element tensor, a sequence of as many for a sequence, a string for a string, None for None)."""
    if isinstance(held, torch.Tensor):
        return held.numel() == 1 and isinstance(saved, (int, float)) and not isinstance(saved, bool)
    if isinstance(held, bool) or isinstance(saved, bool):
        return isinstance(held, bool) and isinstance(saved, bool)
    if isinstance(held, (int, float)):
        return isinstance(saved, (int, float))
    if isinstance(held, (tuple, list)):
        return isinstance(saved, list) and len(saved) == len(held)
    return held is None and saved is None or isinstance(held, str) and isinstance(saved, str)


__all__ = ["ProgramCheckpoints", "plain_hyperparameters"]
