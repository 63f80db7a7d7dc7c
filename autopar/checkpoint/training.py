"""Training checkpoints: masters, optimizer states, step, loss scale, RNG states and a user dict, written
sharded by `torch.distributed.checkpoint` (DCP) and read back into any plan of the same model. A program is
read and written through the `Checkpointable` protocol (`autopar.checkpoint.protocol`) only.

What is in one checkpoint directory (keys of the DCP state dict):

- `model.<name>`: the master weights under the model's first name of each tensor; a DTensor (each rank
  writes its own shard, DCP reshards on load), or a plain tensor where every holder has it whole
  (data-parallel: DCP writes it once). A program whose pieces are flat ranges (ZeRO-3 chunks) hands each
  tensor whole to the rank that holds its first element (`pieces.assemble`), which writes it;
- `optim.<name>.<state>`: the optimizer's states of that master the same way (SGD's momentum_buffer,
  AdamW's exp_avg, exp_avg_sq and step), so a checkpoint moves between program kinds;
- `buffer.<name>`: the persistent buffers (BatchNorm's running statistics and the like), whole, written once;
- `autopar.meta`, `autopar.extra` (and its tensors), `autopar.rng.rank<r>`: plain data as JSON in uint8
  tensors, generator states as tensors (`autopar.checkpoint.data`). The meta holds the step guard's count of
  skipped steps (`skipped_steps`) beside the program's own meta. Nothing in a checkpoint is a pickle, and
  DCP's own index is read by an unpickler that builds only its own classes (`autopar.checkpoint.reader`):
  loading a checkpoint never runs code from it.

A save is a collective from its first step: every rank checks its arguments, rank 0 takes the folder's lock
(`autopar.checkpoint.lock`: one job writes into a folder at a time) and makes `<dir>.partial`, and the ranks
agree (`pieces.agree`) before anything is written: a failure on any rank is an error on every rank. Every rank
writes into `<dir>.partial`; once DCP has written its index, rank 0 writes the marker `autopar_checkpoint.json`
(step, run id, layout; `autopar.checkpoint.marker`) last, fsyncs it, and renames the folder to `<dir>`. A
directory without the marker is not a checkpoint: `latest_checkpoint` skips it and `load` refuses it.
`keep_last=K` then removes all but the K newest checkpoints of this run next to it (never another run's, never
the one just written, never the folder's newest).

Asynchronous saves (`async_save=True`) go through DCP's `async_save`: before the call returns, DCP copies
every tensor of the state (whole storages) into fresh CPU memory, so the checkpoint holds the state at the
call whatever the training does next; a thread then writes the shards and another commits as above (marker,
rename, retention) once the writes of every rank are done. The background collectives run on a gloo group of
their own (`new_group`, made at the first asynchronous save), as two threads must not share one group. Until
the commit, the folder is `<dir>.partial`, which nothing loads. One save is in flight at a time: the next save,
a load, or `wait_checkpoint` waits for it; so does the interpreter's exit (`autopar.checkpoint.exits`). The copy
costs one rank's share of the state in memory for as long as the writes take.

Gradients accumulated by `train_step(..., accumulate=True)` calls whose step has not run yet are not part of a
checkpoint: a save (or a load) while such calls are pending is refused, with nothing written (or changed), on
every rank. Save after the step that takes them, as one saves after an optimizer step.

A load reads everything, checks it, and agrees with the other ranks before it changes the program: the
tensors DCP reads in place are copied to CPU memory first (one rank's share of masters and optimizer states,
for the length of the load) and put back when any rank fails, so a failed load leaves the program as it was.
"""

from __future__ import annotations

import shutil
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.checkpoint import data, lock
from autopar.checkpoint.data import DataError, ExtraError
from autopar.checkpoint.lock import CheckpointLockError
from autopar.checkpoint.marker import (
    FORMAT,
    MARKER,
    VERSION,
    checkpoint_path,
    latest_checkpoint,
    marker_problem,
    read_marker,
    remove,
    retain,
    write_marker,
)
from autopar.checkpoint.pieces import Piece, agree, assemble, barrier, rank, region_of, world
from autopar.checkpoint.reader import CheckpointReader, TensorsOnlyPlanner, UnsafeCheckpointError, read_index
from autopar.errors import ConfigError

__all__ = ["MARKER", "latest_checkpoint", "load", "marker_problem", "read_marker", "save", "wait_checkpoint"]

META, EXTRA = "autopar.meta", "autopar.extra"
RNG_LIMIT_BYTES = 1 << 20  # a generator state tensor (torch's is 5056 bytes)
_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # program -> the Future of its save in flight
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # program -> its background writes' group


def tensor_entries(masters: dict[str, Piece], optim: dict[str, dict]) -> dict[str, Piece | torch.Tensor]:
    """`model.<name>` and `optim.<name>.<state>` -> a piece (or a scalar tensor, the same on every holder)."""
    out: dict = {f"model.{name}": piece for name, piece in masters.items()}
    for name, states in optim.items():
        for key, value in states.items():
            out[f"optim.{name}.{key}"] = value
    return out


def buffer_entries(program) -> dict[str, torch.Tensor]:
    """`buffer.<name>` -> the program's persistent buffers (whole on every rank: DCP writes each once)."""
    return {f"buffer.{n}": b for n, b in program.checkpoint_buffers().items()}


# ------------------------------------------------------------------------------------------------ save


def save(program, path, *, extra: dict | None = None, keep_last: int | None = None, async_save: bool = False):
    """Write `program`'s training state to the directory `path` (see the module docstring); returns it.

    With `async_save`, returns once the state is copied (a `concurrent.futures.Future` of the path): the
    writes go on in the background and the checkpoint is committed when they are done (see the module
    docstring); `wait_checkpoint(program)` waits. A save still in flight is waited for first.
    Every rank must call it with the same path, on a file system every rank sees."""
    wait_checkpoint(program)  # one save at a time: the previous one commits (and retains) before this one starts
    path, encoded, problem = _arguments(path, extra, keep_last, async_save)
    problem = problem or _pending_accumulation(program, f"save_checkpoint({path})")
    if problem is None and rank() == 0:
        problem = _prepare_folder(path)
    _agreed(agree(problem), f"save_checkpoint({path})", "nothing was written; the checkpoints there are as they were")
    meta = {**program.checkpoint_meta(), **_guard_meta(program)}
    state = _state(program, meta, encoded)
    marker = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(meta["step"]),
        "run": lock.run_id(),
        "world_size": world(),
        **meta.get("layout", {}),
    }
    partial = _partial(path)
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


def _guard_meta(program) -> dict:
    """The step guard's part of the meta: its count of skipped steps (a program without a guard: none)."""
    guard = getattr(program, "guard", None)
    return {"skipped_steps": int(guard.skipped_steps)} if guard is not None else {}


def _restore_guard(program, meta: dict) -> None:
    guard = getattr(program, "guard", None)
    if guard is not None:
        guard.skipped_steps = int(meta.get("skipped_steps", 0))  # a checkpoint older than the count: none


def _pending_accumulation(program, what: str) -> tuple[str, str] | None:
    """The problem of a save or load while accumulated gradients wait for their step (the same on every rank:
    every rank makes the same calls), or None."""
    guard = getattr(program, "guard", None)
    calls = guard.accumulating if guard is not None else 0
    if not calls:
        return None
    return (
        "ConfigError",
        f"the gradients of {calls} train_step(..., accumulate=True) call(s) wait for their step, and accumulated "
        f"gradients are not part of a checkpoint: call train_step without accumulate=True first (it steps on them "
        f"and its own rows), then {what.split('(')[0]}",
    )


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def _arguments(path, extra, keep_last, async_save) -> tuple[Path | None, tuple | None, tuple | None]:
    """(the resolved path, the encoded extra, None) or (..., (error class name, message)) for a bad argument:
    checked on every rank before any collective."""
    try:
        path = checkpoint_path(path, "save_checkpoint(path)").resolve()
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"keep_last must be a whole number of checkpoints, at least 1, got {keep_last!r}")
        if not isinstance(async_save, bool):
            raise ConfigError(f"async_save must be True or False, got {async_save!r}")
        return path, data.encode_extra(extra), None
    except ConfigError as e:
        return None, None, (type(e).__name__, str(e))


def _prepare_folder(path: Path) -> tuple | None:
    """On rank 0: the folder exists and is locked for this job, `<path>.partial` is empty. (class name, message)
    on a failure."""
    partial = _partial(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.hold(path.parent)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    except CheckpointLockError as e:
        return (type(e).__name__, str(e))
    except OSError as e:
        return ("ConfigError", f"rank 0 could not prepare {partial} ({type(e).__name__}: {e})")
    return None


_ERRORS = {cls.__name__: cls for cls in (ConfigError, ExtraError, CheckpointLockError, UnsafeCheckpointError)}


def _agreed(problems: list[tuple[int, tuple | None]], what: str, after: str) -> None:
    """Raise on every rank the first rank's problem, naming the rank, when any rank had one."""
    if not problems:
        return
    r, (kind, message) = problems[0]
    others = f" (and {len(problems) - 1} other rank(s))" if len(problems) > 1 else ""
    raise _ERRORS.get(kind, ConfigError)(f"{what} failed on rank {r}{others}: {message}; {after}")


def wait_checkpoint(program) -> str | None:
    """Wait for `program`'s asynchronous save in flight, if any, to be written and committed; returns its path
    (None: none was in flight). Raises what the save raised (every rank does). Every rank must call it."""
    future = _pending.pop(program, None)
    return None if future is None else future.result()


def forget(program) -> None:
    """Drop what this module keeps for `program` (its save in flight, waited for first by the caller, and its
    background writes' process group)."""
    _pending.pop(program, None)
    _groups.pop(program, None)


def _state(program, meta: dict, encoded: tuple) -> dict:
    """The DCP state dict of `program` now (collective: flat pieces travel to the rank that writes them)."""
    masters, optim = program.checkpoint_masters(), program.checkpoint_optimizer_state()
    state = _for_save(tensor_entries(masters, optim)) | buffer_entries(program)
    if rank() == 0:  # one copy of what every rank shares; every rank reads it back
        doc, tensors = encoded
        state[META] = data.json_tensor(meta)
        state[EXTRA] = data.json_tensor(doc)
        state.update(tensors)
    doc, generators = data.rng_state()
    state[f"autopar.rng.rank{rank()}"] = data.json_tensor(doc)
    state.update({f"autopar.rng.rank{rank()}.{k}": v for k, v in generators.items()})
    return state


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
    mine = ({k: rank() for k, p in flat.items() if p.flat[0] == 0}, {k: p.tensor.dtype for k, p in flat.items()})
    everyone = [mine]
    if world() > 1:
        everyone = [None] * world()
        dist.all_gather_object(everyone, mine)
    owners: dict[str, int] = {}
    dtypes: dict[str, torch.dtype] = {}
    for firsts, kinds in everyone:
        for k, r in firsts.items():
            owners.setdefault(k, r)
        for k, d in kinds.items():
            dtypes.setdefault(k, d)
    return assemble(flat, owners, dtypes)


def _checkpoint_group(program):
    """A gloo process group of every rank for the background writes (None alone): their collectives run
    beside the training's on the default group, and two threads must not interleave calls on one group.
    Created on the first asynchronous save (every rank calls it then), kept for the program."""
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
    partial = _partial(path)
    barrier(group)
    problem = None
    if rank() == 0:
        try:
            write_marker(partial, marker | {"time": time.time()})
            _replace(partial, path)
            if keep_last is not None:
                retain(path.parent, keep_last, marker["run"], path)
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


def _replace(partial: Path, path: Path) -> None:
    """Rename the written folder to `path`, replacing an older checkpoint of that name."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    partial.rename(path)
    remove(old)


# ------------------------------------------------------------------------------------------------ load


def load(program, path) -> dict:
    """Read a checkpoint written by `save` (any plan of the same model) into `program`; returns the user's
    `extra` dict. Every rank must call it. A load that fails on any rank raises on every rank and leaves the
    program as it was."""
    path = checkpoint_path(path, "load_checkpoint(path)")
    wait_checkpoint(program)  # a save of this program in flight may be the checkpoint asked for
    index, problem = _opened(path)
    problem = _pending_accumulation(program, f"load_checkpoint({path})") or problem
    metadata = index.state_dict_metadata if index is not None else {}
    _agreed(agree(problem), f"load_checkpoint({path})", "the program is as it was")
    fresh = not any(key.startswith("optim.") for key in metadata)  # saved before a first step: start afresh
    had_states = bool(program.checkpoint_optimizer_state())
    if not fresh:
        program.prepare_optimizer_state()
    backup: dict = {}

    def undo(problems) -> None:  # put back what was changed, then raise on every rank
        for key, saved in backup.items():
            plan["in_place"][key].copy_(saved)
        if not had_states and not fresh:
            program.reset_optimizer_state()
        _agreed(problems, f"load_checkpoint({path})", "the program is as it was")

    try:
        plan = _read_plan(program, metadata, fresh, path)
    except ConfigError as e:
        plan, problem = None, (type(e).__name__, str(e))
    problems = agree(problem)  # every rank reads (a collective) or none does
    if problems:
        undo(problems)
    backup = {k: v.detach().to("cpu", copy=True) for k, v in plan["in_place"].items()}
    problems = agree(_read(plan, path, index))
    if problems:
        undo(problems)
    _apply(program, plan, fresh)
    barrier()
    return plan["extra"]


def _opened(path: Path) -> tuple:
    """(DCP's index, None), or (None, the problem) when `path` is not a checkpoint this autopar reads."""
    problem = marker_problem(path)
    if problem is not None:
        message = f"{path} is not a complete autopar checkpoint: {problem}; pass autopar.latest_checkpoint(root), "
        return None, ("ConfigError", message + "which skips such folders")
    try:
        return read_index(path), None
    except ConfigError as e:
        return None, (type(e).__name__, str(e))


def _read_plan(program, metadata: dict, fresh: bool, path: Path) -> dict:
    """What to read, into what: the DCP state dict (`state`), the entries DCP writes in place (`in_place`),
    the flat pieces and buffers to copy into after the read. ConfigError when the checkpoint does not fit."""
    optim = {} if fresh else program.checkpoint_optimizer_state()
    entries = tensor_entries(program.checkpoint_masters(), optim)
    _check_against(entries, metadata, path)
    check_model_names(program.checkpoint_names.masters, metadata, path)
    state, flat, in_place = {}, {}, {}
    for key, v in entries.items():
        if isinstance(v, Piece) and v.flat is not None:
            flat[key] = v
            state[key] = torch.empty(v.shape, dtype=v.tensor.dtype)  # read whole, then the piece is copied out
        else:
            state[key] = v.as_checkpoint_value() if isinstance(v, Piece) else v
            in_place[key] = v.tensor if isinstance(v, Piece) else v
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
    plain = _plain_entries(metadata, path)
    state.update(plain)
    return {"state": state, "flat": flat, "buffers": buffers, "in_place": in_place, "plain": list(plain)}


def _plain_entries(metadata: dict, path: Path) -> dict[str, torch.Tensor]:
    """Empty tensors for the checkpoint's plain data (meta, extra and its tensors, this rank's generators), sized
    from the index after checking the sizes are ones such data has."""
    rng = f"autopar.rng.rank{rank()}"
    limits = {META: data.JSON_LIMIT_BYTES, EXTRA: data.JSON_LIMIT_BYTES}
    if rng in metadata:  # a rank the saving run did not have keeps its own generators
        limits |= {rng: data.JSON_LIMIT_BYTES}
        limits |= {k: RNG_LIMIT_BYTES for k in (f"{rng}.torch", f"{rng}.cuda") if k in metadata}
    out = {}
    for key, limit in limits.items():
        md = metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise ConfigError(f"the checkpoint {path} lacks {key} (or holds it as other than a tensor): it is damaged")
        size = tuple(md.size)
        if md.properties.dtype != torch.uint8 or len(size) != 1 or size[0] > limit:
            raise ConfigError(f"the checkpoint {path} holds {key} as a {md.properties.dtype} tensor of shape {size}")
        out[key] = torch.empty(size, dtype=torch.uint8)
    extra_keys = [k for k in metadata if k.startswith(data.TENSOR_PREFIX)]
    declared = 0
    for key in extra_keys:
        md = metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            raise ConfigError(f"the checkpoint {path} holds {key} as other than a tensor: it is damaged")
        declared += _numel(md.size) * md.properties.dtype.itemsize
    on_disk = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    if declared > on_disk:
        raise ConfigError(
            f"the checkpoint {path} declares {declared} bytes of extra tensors but its files hold {on_disk}: "
            f"it is damaged"
        )
    out.update({k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype) for k in extra_keys})
    return out


def _numel(size) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _read(plan: dict, path: Path, index) -> tuple | None:
    """Read the checkpoint into the plan's state and decode its plain data (into the plan); the problem, or None."""
    state = plan["state"]
    try:
        dcp.load(state, storage_reader=CheckpointReader(str(path), index=index), planner=TensorsOnlyPlanner())
    except CheckpointException as e:  # every rank raises it (DCP gathers the failures)
        unsafe = _unsafe(e)
        if unsafe is not None:
            return (type(unsafe).__name__, str(unsafe))
        message = f"the checkpoint {path} could not be read: {_first_failure(e)}; its shard files are missing "
        return ("ConfigError", message + "or damaged: load an earlier checkpoint")
    except ConfigError as e:
        return (type(e).__name__, str(e))
    try:
        plan["meta"] = data.check_meta(data.from_json_tensor(state[META], f"{path}: {META}"))
        doc = data.from_json_tensor(state[EXTRA], f"{path}: {EXTRA}")
        plan["extra"] = data.decode_extra(doc, {k: state[k] for k in data.extra_tensor_keys(doc) if k in state})
        rng = f"autopar.rng.rank{rank()}"
        plan["rng"] = None
        if rng in state:
            generators = {k.rsplit(".", 1)[1]: state[k] for k in state if k.startswith(f"{rng}.")}
            plan["rng"] = data.checked_rng_state(data.from_json_tensor(state[rng], f"{path}: {rng}"), generators)
    except DataError as e:
        return ("ConfigError", f"the checkpoint {path} holds damaged plain data: {e}; load an earlier checkpoint")
    return None


def _unsafe(e: CheckpointException) -> UnsafeCheckpointError | None:
    for failure in (getattr(e, "failures", {}) or {}).values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, UnsafeCheckpointError):
            return error
    return None


def _apply(program, plan: dict, fresh: bool) -> None:
    """Put what was read into the program (nothing here can fail on what the checkpoint holds)."""
    state = plan["state"]
    for key, piece in plan["flat"].items():
        piece.tensor.copy_(region_of(state[key], piece.region))
    for key, buffer in plan["buffers"].items():
        buffer.copy_(state[key])
    if fresh:
        program.reset_optimizer_state()
    program.restore_checkpoint_meta(plan["meta"])
    _restore_guard(program, plan["meta"])
    if plan["rng"] is not None:
        data.set_rng_state(plan["rng"])
    program.after_checkpoint_load()


def _first_failure(e: CheckpointException) -> str:
    failures = getattr(e, "failures", {}) or {}
    for rank_, failure in sorted(failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure  # (exception, stack summary)
        return f"rank {rank_}: {type(error).__name__}: {str(error)[:300]}"
    return str(e)[:300]


def _check_against(entries: dict, metadata: dict, path: Path) -> None:
    """Every tensor the program holds is in the checkpoint with the same full shape."""
    missing, wrong = [], []
    for key, v in entries.items():
        md = metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            missing.append(key)
            continue
        if tuple(md.size) != tuple(v.shape):
            wrong.append(f"{key}: checkpoint {tuple(md.size)}, model {tuple(v.shape)}")
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
