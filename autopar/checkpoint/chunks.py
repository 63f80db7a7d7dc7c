"""Checkpoint pieces of a `ChunkStore` (the offload program): each rank's shard of a chunk is a flat range of
the chunk, so it holds flat ranges of the parameters packed in it, and of their AdamW moments."""

from __future__ import annotations

import torch

from autopar.checkpoint.pieces import Piece


def chunk_pieces(store, attr: str) -> dict[str, Piece]:
    """name -> this rank's flat piece of `chunk.<attr>` (master, exp_avg, exp_avg_sq) for every parameter whose
    slot meets this rank's shard of its chunk."""
    out = {}
    for chunk in store.chunks:
        buf = getattr(chunk, attr)
        if buf is None:
            continue
        lo, hi = store._shard_range(chunk)
        for slot in chunk.layout.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                out[slot.name] = Piece(
                    buf.narrow(0, a - lo, b - a), tuple(slot.shape), flat=(a - slot.offset, b - slot.offset)
                )
    return out


def chunk_optimizer_state(store, optimizer) -> dict[str, dict]:
    """name -> {"exp_avg", "exp_avg_sq": pieces, "step": a scalar} as torch.optim.AdamW names them."""
    step = _step_holder(optimizer)
    step.fill_(float(optimizer.num_steps))
    avg, avg_sq = chunk_pieces(store, "exp_avg"), chunk_pieces(store, "exp_avg_sq")
    return {name: {"exp_avg": avg[name], "exp_avg_sq": avg_sq[name], "step": step} for name in avg}


def after_load(store, optimizer) -> None:
    """Take the step read into the holder; copy the masters into the payloads the model computes with."""
    optimizer.num_steps = int(_step_holder(optimizer).item())
    store.refresh_payloads()


def _step_holder(optimizer) -> torch.Tensor:
    holder = getattr(optimizer, "_checkpoint_step", None)
    if holder is None:
        holder = optimizer._checkpoint_step = torch.zeros((), dtype=torch.float32)
    return holder


def reset_optimizer_state(store, optimizer) -> None:
    """Zero the chunks' moments and the step count, as before a first step."""
    for chunk in store.chunks:
        for attr in ("exp_avg", "exp_avg_sq"):
            buf = getattr(chunk, attr)
            if buf is not None:
                buf.zero_()
    optimizer.num_steps = 0
    _step_holder(optimizer).zero_()  # `after_load` takes the step from it
