"""Training checkpoints: masters, optimizer states, step, loss scale, RNG states and a user dict, written
sharded by `torch.distributed.checkpoint` (DCP) and read back into any plan of the same model.

What is in one checkpoint directory (keys of the DCP state dict):

- `model.<name>`: the master weights under the model's first name of each tensor; a DTensor (each rank
  writes its own shard, DCP reshards on load), or a plain tensor where every holder has it whole
  (data-parallel: DCP writes it once). A program whose pieces are flat ranges (ZeRO-3 chunks) hands each
  tensor whole to the rank that holds its first element (`pieces.assemble`), which writes it;
- `optim.<name>.<state>`: the optimizer's states of that master the same way (SGD's momentum_buffer,
  AdamW's exp_avg, exp_avg_sq and step), so a checkpoint moves between program kinds;
- `autopar.meta` (step, loss scale, optimizer hyperparameters), `autopar.extra` (the user's dict),
  `autopar.rng.rank<r>` (rank r's CPU, CUDA, Python and NumPy generators).

Atomicity: every rank writes into `<dir>.partial`; once DCP has written its metadata, rank 0 writes the
marker `autopar_checkpoint.json` (step, layout) last, fsyncs it, and renames the folder to `<dir>`. A
directory without the marker is not a checkpoint: `latest_checkpoint` skips it and `load` refuses it.
`keep_last=K` then removes all but the K newest checkpoints (those with a marker) next to it.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.checkpoint.pieces import Piece, assemble, barrier, rank, region_of, world
from autopar.errors import ConfigError

MARKER = "autopar_checkpoint.json"
FORMAT = "autopar-checkpoint"
VERSION = 1


def latest_checkpoint(root) -> str | None:
    """The newest complete checkpoint directory under `root` (by step, then by when it was committed); None if
    there is none. Directories without the marker (a save cut short) are skipped."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        info = read_marker(child)
        if info is not None:
            found.append((int(info.get("step", 0)), (child / MARKER).stat().st_mtime_ns, child.name, child))
    return str(max(found)[3]) if found else None


def read_marker(path) -> dict | None:
    """The marker of a complete checkpoint directory, or None."""
    marker = Path(path) / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("format") == FORMAT else None


# ------------------------------------------------------------------------------------------------ state


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def tensor_entries(masters: dict[str, Piece], optim: dict[str, dict]) -> dict[str, Piece | torch.Tensor]:
    """`model.<name>` and `optim.<name>.<state>` -> a piece (or a scalar tensor, the same on every holder)."""
    out: dict = {f"model.{name}": piece for name, piece in masters.items()}
    for name, states in optim.items():
        for key, value in states.items():
            out[f"optim.{name}.{key}"] = value
    return out


def _for_save(entries: dict) -> dict:
    """DCP values: DTensors and whole tensors as they are; flat pieces whole on the rank holding element 0."""
    out, flat = {}, {}
    for key, v in entries.items():
        if isinstance(v, Piece) and v.flat is not None:
            flat[key] = v
        else:
            out[key] = v.as_checkpoint_value() if isinstance(v, Piece) else v
    out.update(_assembled_flat(flat))
    return out


def _assembled_flat(flat: dict[str, Piece]) -> dict[str, torch.Tensor]:
    """Every flat-pieced tensor made whole on the rank that holds its first element (collective)."""
    firsts = {k: rank() for k, p in flat.items() if p.flat[0] == 0}
    everyone = [firsts]
    if world() > 1:
        everyone = [None] * world()
        dist.all_gather_object(everyone, firsts)
    owners: dict[str, int] = {}
    for part in everyone:
        for k, r in part.items():
            owners.setdefault(k, r)
    dtypes = {k: p.tensor.dtype for k, p in flat.items()}
    everyone_dtypes = [dtypes]
    if world() > 1:
        everyone_dtypes = [None] * world()
        dist.all_gather_object(everyone_dtypes, dtypes)
    for part in everyone_dtypes:
        for k, d in part.items():
            dtypes.setdefault(k, d)
    return assemble(flat, owners, dtypes)


def save(program, path, *, extra: dict | None = None, keep_last: int | None = None) -> str:
    """Write `program`'s training state to the directory `path` (see the module docstring); returns it.

    Every rank must call it with the same path, on a file system every rank sees."""
    path = Path(path).resolve()
    partial = path.with_name(path.name + ".partial")
    if keep_last is not None and keep_last < 1:
        raise ConfigError(f"keep_last must be at least 1, got {keep_last}")
    if rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    masters, optim = program._local_masters(), program._local_optimizer_state()
    state = _for_save(tensor_entries(masters, optim))
    # objects go as pickled bytes: DCP would flatten a dict into keys of its own
    if rank() == 0:  # one copy of what every rank shares; every rank reads it back
        state["autopar.meta"] = pickle.dumps(program._checkpoint_meta())
        state["autopar.extra"] = pickle.dumps(dict(extra or {}))
    state[f"autopar.rng.rank{rank()}"] = pickle.dumps(rng_state())
    dcp.save(state, checkpoint_id=str(partial))
    barrier()
    if rank() == 0:
        marker = {"format": FORMAT, "version": VERSION, "step": program.num_steps, "world_size": world(),
                  "program": str(program.plan.program), "mesh": dict(program.plan.mesh),
                  "model": program.plan.model_name, "time": time.time()}  # fmt: skip
        with open(partial / MARKER, "w") as f:
            json.dump(marker, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last is not None:
            _retain(path.parent, keep_last)
    barrier()
    return str(path)


def _retain(root: Path, keep_last: int) -> None:
    """Remove all but the `keep_last` newest complete checkpoints in `root`."""
    found = []
    for child in root.iterdir():
        info = read_marker(child)
        if info is not None:
            found.append((int(info.get("step", 0)), (child / MARKER).stat().st_mtime_ns, child.name, child))
    for *_, child in sorted(found)[:-keep_last]:
        shutil.rmtree(child, ignore_errors=True)


def load(program, path) -> dict:
    """Read a checkpoint written by `save` (any plan of the same model) into `program`; returns the user's
    `extra` dict. Every rank must call it."""
    path = Path(path)
    info = read_marker(path)
    if info is None:
        raise ConfigError(f"{path} is not a complete autopar checkpoint (no {MARKER}: the save was cut short, or "
                          f"it is another kind of folder); pass autopar.latest_checkpoint(root)")  # fmt: skip
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    program._ensure_optimizer_state()
    entries = tensor_entries(program._local_masters(), program._local_optimizer_state())
    _check_against(entries, metadata, path)
    check_model_names(program._master_names, metadata, path)
    state, flat = {}, {}
    for key, v in entries.items():
        if isinstance(v, Piece) and v.flat is not None:
            flat[key] = v
            state[key] = torch.empty(v.shape, dtype=v.tensor.dtype)  # read whole, then the piece is copied out
        else:
            state[key] = v.as_checkpoint_value() if isinstance(v, Piece) else v
    rng_key = f"autopar.rng.rank{rank()}"
    objects = ["autopar.meta", "autopar.extra"] + ([rng_key] if rng_key in metadata else [])
    state.update(dict.fromkeys(objects, b""))
    dcp.load(state, checkpoint_id=str(path))
    for key, piece in flat.items():
        piece.tensor.copy_(region_of(state[key], piece.region))
    program._restore_checkpoint_meta(pickle.loads(state["autopar.meta"]))
    if rng_key in metadata:  # a rank the saving run did not have keeps its own generators
        set_rng_state(pickle.loads(state[rng_key]))
    program._after_checkpoint_load()
    barrier()
    return pickle.loads(state["autopar.extra"])


def _check_against(entries: dict, metadata: dict, path: Path) -> None:
    """Every tensor the program holds is in the checkpoint with the same full shape; the checkpoint holds no
    master the model lacks."""
    missing, wrong = [], []
    for key, v in entries.items():
        md = metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            missing.append(key)
            continue
        shape = tuple(v.shape) if isinstance(v, Piece) else tuple(v.shape)
        if tuple(md.size) != shape:
            wrong.append(f"{key}: checkpoint {tuple(md.size)}, model {shape}")
    if missing:
        raise ConfigError(f"the checkpoint {path} lacks {len(missing)} tensor(s) this program holds, e.g. "
                          f"{missing[:4]}: it is of another model, or was written with another optimizer")  # fmt: skip
    if wrong:
        raise ConfigError(f"the checkpoint {path} holds tensors of other shapes than the model's: {wrong[:4]}; "
                          f"it is of another model")  # fmt: skip


def check_model_names(names, metadata: dict, path: Path) -> None:
    """The checkpoint holds no master the model lacks (`names`: the model's parameter names)."""
    ours = {f"model.{n}" for n in names}
    others = sorted(k for k in metadata if k.startswith("model.") and k not in ours)
    if others:
        raise ConfigError(f"the checkpoint {path} holds weights the model does not have, e.g. {others[:4]}: "
                          f"it is of another model")  # fmt: skip
