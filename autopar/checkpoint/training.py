"""Training checkpoints: masters, optimizer states, step, loss scale, RNG states and a user dict, written
sharded by `torch.distributed.checkpoint` (DCP) and read back into any plan of the same model.

What is in one checkpoint directory (keys of the DCP state dict):

- `model.<name>`: the master weights under the model's first name of each tensor; a DTensor (each rank
  writes its own shard, DCP reshards on load), or a plain tensor where every holder has it whole
  (data-parallel: DCP writes it once). A program whose pieces are flat ranges (ZeRO-3 chunks) hands each
  tensor whole to the rank that holds its first element (`pieces.assemble`), which writes it;
- `optim.<name>.<state>`: the optimizer's states of that master the same way (SGD's momentum_buffer,
  AdamW's exp_avg, exp_avg_sq and step), so a checkpoint moves between program kinds;
- `buffer.<name>`: the persistent buffers (BatchNorm's running statistics and the like), whole, written once;
- `autopar.meta` (step, loss scale, optimizer hyperparameters), `autopar.extra` (the user's dict),
  `autopar.rng.rank<r>` (rank r's CPU, CUDA, Python and NumPy generators).

Atomicity: every rank writes into `<dir>.partial`; once DCP has written its metadata, rank 0 writes the
marker `autopar_checkpoint.json` (step, layout) last, fsyncs it, and renames the folder to `<dir>`. A
directory without the marker is not a checkpoint: `latest_checkpoint` skips it and `load` refuses it.
`keep_last=K` then removes all but the K newest checkpoints (those with a marker) next to it.

Asynchronous saves (`async_save=True`) go through DCP's `async_save`: before the call returns, DCP copies
every tensor of the state (whole storages) into fresh CPU memory, so the checkpoint holds the state at the
call whatever the training does next; a thread then writes the shards and another commits as above (marker,
rename, retention) once the writes of every rank are done. The background collectives run on a gloo group of
their own (`new_group`, made at the first asynchronous save), as two threads must not share one group. Until
the commit, the folder is `<dir>.partial`, which nothing loads. One save is in flight at a time: the next save,
a load, or `wait_checkpoint` waits for it; wait for it before the process group is destroyed. The copy costs
one rank's share of the state in memory for as long as the writes take.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.checkpoint.pieces import Piece, assemble, barrier, rank, region_of, world
from autopar.errors import ConfigError

MARKER = "autopar_checkpoint.json"
FORMAT = "autopar-checkpoint"
VERSION = 1
_pending: WeakKeyDictionary = WeakKeyDictionary()  # program -> the Future of its save in flight
_groups: WeakKeyDictionary = WeakKeyDictionary()  # program -> its background writes' process group


def latest_checkpoint(root) -> str | None:
    """The newest complete checkpoint directory under `root` (by step, then by when it was committed); None if
    there is none. Directories without a valid marker (a save cut short, another version) are skipped."""
    found = _complete(_path(root, "latest_checkpoint(root)"))
    return str(max(found)[3]) if found else None


def _path(path, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        hint = " (latest_checkpoint found none: start from scratch when it returns None)" if path is None else ""
        raise ConfigError(f"{what}: expected a directory path, got {path!r}{hint}")
    return Path(path)


def _complete(root: Path) -> list[tuple]:
    """(step, commit time, name, path) of every complete checkpoint directly under `root`."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        info = read_marker(child)
        if info is not None:
            try:
                found.append((info["step"], (child / MARKER).stat().st_mtime_ns, child.name, child))
            except OSError:  # removed since it was read (another job's retention)
                continue
    return found


def read_marker(path) -> dict | None:
    """The marker of a complete checkpoint directory of this version, or None (`marker_problem` says why)."""
    info, problem = _read_marker(path)
    return None if problem else info


def marker_problem(path) -> str | None:
    """Why `path` is not a complete checkpoint this autopar reads (None: it is one)."""
    return _read_marker(path)[1]


def _read_marker(path) -> tuple[dict | None, str | None]:
    marker = Path(path) / MARKER
    try:
        info = json.loads(marker.read_text())
    except OSError:
        return None, f"it has no {MARKER} (the save was cut short, or it is another kind of folder)"
    except (ValueError, RecursionError):
        return None, f"its {MARKER} is not valid JSON"
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        return None, f"its {MARKER} is not an autopar checkpoint marker (no 'format': '{FORMAT}')"
    if info.get("version") != VERSION or isinstance(info.get("version"), bool):
        return None, (
            f"it is of checkpoint format version {info.get('version')!r}; this autopar reads version {VERSION}"
        )
    step = info.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None, f"its {MARKER} gives the step as {step!r}, not a count of steps"
    return info, None


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


def buffer_entries(program) -> dict[str, torch.Tensor]:
    """`buffer.<name>` -> the program's persistent buffers (running statistics and the like: state a step may
    change); every rank holds them whole, so DCP writes each once. Non-persistent buffers (rotary tables) are
    derived from the config and are not saved, as `state_dict` leaves them out."""
    return {f"buffer.{n}": b for n, b in program.checkpoint_buffers().items()}


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


def save(program, path, *, extra: dict | None = None, keep_last: int | None = None, async_save: bool = False):
    """Write `program`'s training state to the directory `path` (see the module docstring); returns it.

    With `async_save`, returns once the state is copied (a `concurrent.futures.Future` of the path): the
    writes go on in the background and the checkpoint is committed when they are done (see the module
    docstring); `wait_checkpoint(program)` waits. A save still in flight is waited for first.
    Every rank must call it with the same path, on a file system every rank sees."""
    path = _path(path, "save_checkpoint(path)").resolve()
    partial = path.with_name(path.name + ".partial")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"keep_last must be a whole number of checkpoints, at least 1, got {keep_last!r}")
    if not isinstance(async_save, bool):
        raise ConfigError(f"async_save must be True or False, got {async_save!r}")
    extra_bytes = _pickled_extra(extra)
    wait_checkpoint(program)  # one save at a time: the previous one commits (and retains) before this one starts
    if rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    state = _state(program, extra_bytes)
    marker = {
        "format": FORMAT,
        "version": VERSION,
        "step": program.num_steps,
        "world_size": world(),
        "program": str(program.plan.program),
        "mesh": dict(program.plan.mesh),
        "model": program.plan.model_name,
    }
    if not async_save:
        _written(lambda: dcp.save(state, checkpoint_id=str(partial)), path)
        return _commit(path, marker, keep_last, group=None)
    group = _checkpoint_group(program)
    # DCP copies the state (every tensor's storage) into CPU memory before it returns, then writes from a thread
    upload = dcp.async_save(state, checkpoint_id=str(partial), process_group=group)
    committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-checkpoint")
    future = committer.submit(_commit_after, upload, path, marker, keep_last, group)
    committer.shutdown(wait=False)
    _pending[program] = future
    return future


def wait_checkpoint(program) -> str | None:
    """Wait for `program`'s asynchronous save in flight, if any, to be written and committed; returns its path
    (None: none was in flight). Raises what the save raised (every rank does). Every rank must call it."""
    future = _pending.pop(program, None)
    return None if future is None else future.result()


def _pickled_extra(extra) -> bytes:
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError(f"extra must be a dict (data position, schedule state, ...), got {type(extra).__name__}")
    try:  # on every rank, before any collective: a rank that failed alone would leave the others waiting
        return pickle.dumps(dict(extra or {}))
    except Exception as e:  # pickling runs the user's objects' own code: anything may come out
        raise ConfigError(
            f"extra holds a value that cannot be pickled ({type(e).__name__}: {e}); keep plain "
            f"data (numbers, strings, lists, dicts, tensors) in it"
        ) from e


def _state(program, extra_bytes: bytes) -> dict:
    """The DCP state dict of `program` now (collective: flat pieces travel to the rank that writes them)."""
    masters, optim = program.checkpoint_masters(), program.checkpoint_optimizer_state()
    state = _for_save(tensor_entries(masters, optim)) | buffer_entries(program)
    # objects go as pickled bytes: DCP would flatten a dict into keys of its own
    if rank() == 0:  # one copy of what every rank shares; every rank reads it back
        state["autopar.meta"] = pickle.dumps(program.checkpoint_meta())
        state["autopar.extra"] = extra_bytes
    state[f"autopar.rng.rank{rank()}"] = pickle.dumps(rng_state())
    return state


def _checkpoint_group(program):
    """A gloo process group of every rank for the background writes (None alone): their collectives run
    beside the training's on the default group, and two threads must not interleave calls on one group.
    Created on the first asynchronous save (every rank calls it then), kept by the program."""
    if world() == 1:
        return None
    group = _groups.get(program)
    if group is None:
        group = _groups[program] = dist.new_group(backend="gloo")
    return group


def _commit_after(upload: Future, path: Path, marker: dict, keep_last: int | None, group) -> str:
    """In the background: once DCP's writes are done on every rank, commit the checkpoint."""
    _written(upload.result, path)
    return _commit(path, marker, keep_last, group=group)


def _written(write, path: Path) -> None:
    """Run DCP's writes; a failure on any rank (DCP gathers them and raises on every rank) as a ConfigError."""
    try:
        write()
    except CheckpointException as e:
        raise ConfigError(
            f"the checkpoint {path} could not be written: {_first_failure(e)}; it is not valid "
            f"(latest_checkpoint skips it): check the file system (space, permissions) and save "
            f"again"
        ) from e


def _commit(path: Path, marker: dict, keep_last: int | None, *, group) -> str:
    """Make `<path>.partial` the checkpoint `path` once every rank's shards are written (DCP writes its index
    after every rank's files, fsynced): rank 0 writes the marker last, renames the folder, then applies
    retention. Collective over `group`; a failure on rank 0 is raised on every rank."""
    partial = path.with_name(path.name + ".partial")
    barrier(group)
    problem = None
    if rank() == 0:
        try:
            _write_marker(partial, marker | {"time": time.time()})
            _replace(partial, path)
            if keep_last is not None:
                _retain(path.parent, keep_last)
        except OSError as e:
            problem = f"{type(e).__name__}: {e}"
    if world() > 1:
        shared = [problem]
        dist.broadcast_object_list(shared, src=0, group=group)
        problem = shared[0]
    if problem is not None:
        raise ConfigError(
            f"the checkpoint {path} could not be committed on rank 0 ({problem}); it is not valid: "
            f"check the file system (space, permissions) and save again"
        )
    return str(path)


def _write_marker(folder: Path, marker: dict) -> None:
    with open(folder / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _replace(partial: Path, path: Path) -> None:
    """Rename the written folder to `path`, replacing an older checkpoint of that name."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    partial.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _retain(root: Path, keep_last: int) -> None:
    """Remove all but the `keep_last` newest complete checkpoints in `root`."""
    for *_, child in sorted(_complete(root))[:-keep_last]:
        shutil.rmtree(child, ignore_errors=True)


def load(program, path) -> dict:
    """Read a checkpoint written by `save` (any plan of the same model) into `program`; returns the user's
    `extra` dict. Every rank must call it."""
    path = _path(path, "load_checkpoint(path)")
    wait_checkpoint(program)  # a save of this program in flight may be the checkpoint asked for
    problem = marker_problem(path)
    if problem is not None:
        raise ConfigError(
            f"{path} is not a complete autopar checkpoint: {problem}; pass "
            f"autopar.latest_checkpoint(root), which skips such folders"
        )
    metadata = _read_metadata(path)
    # a checkpoint saved before the first optimizer step holds no optimizer states: the program starts afresh too
    fresh = not any(key.startswith("optim.") for key in metadata)
    if not fresh:
        program.prepare_optimizer_state()
    entries = tensor_entries(program.checkpoint_masters(), {} if fresh else program.checkpoint_optimizer_state())
    _check_against(entries, metadata, path)
    check_model_names(program.checkpoint_names.masters, metadata, path)
    state, flat = {}, {}
    for key, v in entries.items():
        if isinstance(v, Piece) and v.flat is not None:
            flat[key] = v
            state[key] = torch.empty(v.shape, dtype=v.tensor.dtype)  # read whole, then the piece is copied out
        else:
            state[key] = v.as_checkpoint_value() if isinstance(v, Piece) else v
    # checkpoints written before buffers were saved hold none: the program keeps its own then
    buffers = {k: v for k, v in buffer_entries(program).items() if k in metadata}
    wrong = [
        f"{k}: checkpoint {tuple(metadata[k].size)}, model {tuple(v.shape)}"
        for k, v in buffers.items()
        if not isinstance(metadata[k], TensorStorageMetadata) or tuple(metadata[k].size) != tuple(v.shape)
    ]
    if wrong:
        raise ConfigError(
            f"the checkpoint {path} holds buffers of other shapes than the model's: {wrong[:4]}; it is of another model"
        )
    state.update({k: torch.empty_like(v) for k, v in buffers.items()})
    rng_key = f"autopar.rng.rank{rank()}"
    objects = ["autopar.meta", "autopar.extra"] + ([rng_key] if rng_key in metadata else [])
    state.update(dict.fromkeys(objects, b""))
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:  # every rank raises it (DCP gathers the failures), so none is left waiting
        raise ConfigError(
            f"the checkpoint {path} could not be read: {_first_failure(e)}; its shard files are "
            f"missing or damaged: load an earlier checkpoint"
        ) from e
    for key, piece in flat.items():
        piece.tensor.copy_(region_of(state[key], piece.region))
    for key, buffer in buffers.items():
        buffer.copy_(state[key])
    meta, extra = _unpickled(state, "autopar.meta", path), _unpickled(state, "autopar.extra", path)
    if fresh:
        program.reset_optimizer_state()
    program.restore_checkpoint_meta(meta)
    if rng_key in metadata:  # a rank the saving run did not have keeps its own generators
        set_rng_state(_unpickled(state, rng_key, path))
    program.after_checkpoint_load()
    barrier()
    return extra


def _read_metadata(path: Path) -> dict:
    """DCP's index of the checkpoint: key -> storage metadata; ConfigError when it is missing or damaged."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # an unpickler fed damaged bytes may raise anything
        raise ConfigError(
            f"the checkpoint {path} has a missing or damaged index (.metadata: {type(e).__name__}: "
            f"{e}); load an earlier checkpoint"
        ) from e
    if not isinstance(metadata, dict):
        raise ConfigError(f"the checkpoint {path} has a damaged index (.metadata); load an earlier checkpoint")
    return metadata


def _unpickled(state: dict, key: str, path: Path) -> dict:
    """One of the checkpoint's pickled dicts (meta, extra, a rank's RNG states)."""
    try:
        value = pickle.loads(state[key])
    except Exception as e:  # damaged bytes may raise anything
        raise ConfigError(
            f"the checkpoint {path} holds a damaged {key} ({type(e).__name__}); load an earlier checkpoint"
        ) from e
    if not isinstance(value, dict):
        raise ConfigError(f"the checkpoint {path} holds a damaged {key} (a {type(value).__name__}, not a dict)")
    return value


def _first_failure(e: CheckpointException) -> str:
    failures = getattr(e, "failures", {}) or {}
    for rank_, failure in sorted(failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure  # (exception, stack summary)
        return f"rank {rank_}: {type(error).__name__}: {error}"
    return str(e)


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
        raise ConfigError(
            f"the checkpoint {path} lacks {len(missing)} tensor(s) this program holds, e.g. "
            f"{missing[:4]}: it is of another model, or was written with another optimizer"
        )
    if wrong:
        raise ConfigError(
            f"the checkpoint {path} holds tensors of other shapes than the model's: {wrong[:4]}; it is of another model"
        )


def check_model_names(names, metadata: dict, path: Path) -> None:
    """The checkpoint holds no master the model lacks (`names`: the model's parameter names)."""
    ours = {f"model.{n}" for n in names}
    others = sorted(k for k in metadata if k.startswith("model.") and k not in ours)
    if others:
        raise ConfigError(
            f"the checkpoint {path} holds weights the model does not have, e.g. {others[:4]}: it is of another model"
        )
