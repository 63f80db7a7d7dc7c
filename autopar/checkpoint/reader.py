"""Reading a checkpoint's files without running code from them.

torch.distributed.checkpoint (torch 2.13) reads three things from a checkpoint folder:

- its index `.metadata`, with `pickle.load` (`FileSystemReader.read_metadata`): a pickle may name any callable,
  so a crafted index runs code on every rank that opens it;
- byte items (objects saved as bytes), with `torch.load(weights_only=False)` (`DefaultLoadPlanner.load_bytes`):
  the same;
- tensor items, with `torch.load(weights_only=True)`: safe (torch's allow-listed unpickler).

`CheckpointReader` replaces the first: `read_index` refuses a file over `INDEX_LIMIT_BYTES`, unpickles with an
`Unpickler` whose `find_class` admits only the classes DCP's index is made of (its metadata dataclasses, torch's
`Size`, dtypes and layouts, a path) and no persistent ids, then checks the shape of what it got (types, counts,
file names inside the folder) within `INDEX_LIMIT_ENTRIES` entries: no record is referred to twice (a pickle's
shared references would make a small file name millions of chunks) and a tensor's chunks hold at most its elements. It refuses byte items (autopar checkpoints
hold none: plain data travels as JSON in tensors, `autopar.checkpoint.data`), and `TensorsOnlyPlanner` refuses
them too. Each refusal is an `UnsafeCheckpointError` naming the file.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType

from autopar.errors import ConfigError

INDEX = ".metadata"
INDEX_LIMIT_BYTES = 1 << 30  # an index is about 100 bytes per chunk: ten million chunks fit
INDEX_LIMIT_ENTRIES = 20_000_000  # keys, chunks and storage records together

_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP, "Metadata"),
    (_DCP, "MetadataIndex"),
    (_DCP, "StorageMeta"),
    (_DCP, "TensorProperties"),
    (_DCP, "TensorStorageMetadata"),
    (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"),
    (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a dict lookup of torch's layouts by name
    ("pathlib", "PosixPath"),  # the checkpoint id DCP records (a pure path: no file is touched)
    ("pathlib", "PurePosixPath"),
}


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file that asks for something a checkpoint never holds (code to run, a file outside the
    folder); nothing of it was run."""


class _IndexUnpickler(pickle.Unpickler):
    """A pickle reader that builds only the classes of DCP's index (see the module docstring)."""

    def __init__(self, file, where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.where} asks for {module}.{name}, which a checkpoint index never holds: it was not "
            f"read (a crafted or foreign file); nothing from it ran. Load a checkpoint written by autopar"
        )

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.where} refers to outside objects ({str(pid)[:40]!r}): it was not read")


def read_index(folder) -> Metadata:
    """DCP's index of the checkpoint in `folder`, read without running code and checked (module docstring)."""
    path = Path(folder) / INDEX
    try:
        size = path.stat().st_size
        if size > INDEX_LIMIT_BYTES:
            raise UnsafeCheckpointError(
                f"{path} has {size} bytes, more than the {INDEX_LIMIT_BYTES} a checkpoint index is read up to"
            )
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"the checkpoint {folder} has no readable index ({path}: {e.strerror})") from e
    try:
        metadata = _IndexUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # damaged bytes make the unpickler raise anything; nothing outside the list was built
        raise ConfigError(
            f"the checkpoint {folder} has a damaged index ({path}: {type(e).__name__}: {str(e)[:200]}); "
            f"load an earlier checkpoint"
        ) from e
    problem = _index_problem(metadata)
    if problem is not None:
        raise ConfigError(
            f"the checkpoint {folder} has a damaged index ({path}: {problem}); load an earlier checkpoint"
        )
    return metadata


def _index_problem(md) -> str | None:
    """What is wrong with an unpickled index (None: it has the shape DCP writes)."""
    if type(md) is not Metadata:
        return f"a {type(md).__name__}, not DCP's Metadata"
    entries, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "no table of entries and files"
    budget = [INDEX_LIMIT_ENTRIES]
    if len(entries) > INDEX_LIMIT_ENTRIES or len({id(v) for v in entries.values()}) != len(entries):
        return "entries that are one record referred to many times (DCP writes a record per entry)"
    for key, item in entries.items():
        problem = _entry_problem(key, item, budget)
        if problem:
            return problem
    for index, info in storage.items():
        budget[0] -= 1
        if budget[0] < 0:
            return f"more than {INDEX_LIMIT_ENTRIES} entries"
        if type(index) is not MetadataIndex or not isinstance(index.fqn, str):
            return "a storage record keyed by something other than an entry"
        if type(info) is not _StorageInfo:
            return f"a storage record of {index.fqn!r} that is a {type(info).__name__}"
        problem = _storage_problem(index.fqn, info)
        if problem:
            return problem
    meta = getattr(md, "storage_meta", None)
    if meta is not None and type(meta) is not StorageMeta:
        return "storage information that is not DCP's"
    return None


def _entry_problem(key, item, budget: list[int]) -> str | None:
    budget[0] -= 1
    if not isinstance(key, str):
        return f"an entry keyed by a {type(key).__name__}"
    if type(item) is BytesStorageMetadata:
        return None  # refused when read (`CheckpointReader.read_data`), allowed to be listed
    if type(item) is not TensorStorageMetadata:
        return f"the entry {key!r} is a {type(item).__name__}"
    props, size, chunks = getattr(item, "properties", None), getattr(item, "size", None), getattr(item, "chunks", None)
    if type(props) is not TensorProperties or not isinstance(getattr(props, "dtype", None), torch.dtype):
        return f"the entry {key!r} has no dtype"
    if not _is_shape(size) or not isinstance(chunks, list):
        return f"the entry {key!r} has no shape or chunk list"
    budget[0] -= len(chunks)
    if budget[0] < 0:
        return f"more than {INDEX_LIMIT_ENTRIES} entries"
    if len({id(c) for c in chunks}) != len(chunks):
        return f"the entry {key!r} has one chunk listed many times (DCP writes a record per chunk)"
    volume = _volume(size)
    for c in chunks:
        if type(c) is not ChunkStorageMetadata or not _is_shape(c.offsets) or not _is_shape(c.sizes):
            return f"the entry {key!r} has a chunk without offsets and sizes"
        if len(c.offsets) != len(size) or len(c.sizes) != len(size):
            return f"the entry {key!r} has a chunk of another rank than the tensor"
        if any(o + s > n for o, s, n in zip(c.offsets, c.sizes, size, strict=True)):
            return f"the entry {key!r} has a chunk reaching past the tensor"
        volume -= _volume(c.sizes)
        if volume < 0:  # DCP's chunks of a tensor do not overlap: each element is read once
            return f"the entry {key!r} has chunks that hold more elements than the tensor"
    return None


def _volume(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _is_shape(value) -> bool:
    return isinstance(value, (torch.Size, tuple, list)) and all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**62 for n in value
    )


def _storage_problem(fqn: str, info) -> str | None:
    name = getattr(info, "relative_path", None)
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        return f"the storage of {fqn!r} names the file {name!r}, which is not a file of the checkpoint folder"
    for field in ("offset", "length"):
        v = getattr(info, field, None)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return f"the storage of {fqn!r} has the {field} {v!r}"
    transforms = getattr(info, "transform_descriptors", None)
    if transforms is not None and not (
        isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms)
    ):
        return f"the storage of {fqn!r} has transforms that are not names"
    return None


class CheckpointReader(FileSystemReader):
    """DCP's file system reader with the index read by `read_index` (or the one given, read by it already) and
    byte items refused."""

    def __init__(self, path, *, index: Metadata | None = None):
        super().__init__(path)
        self._index = index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError(f"{self.path}: a per-rank index is not read; load with every rank")
        metadata = self._index if self._index is not None else read_index(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        refuse_byte_items(plan.items, self.path)
        return super().read_data(plan, planner)


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner that refuses byte items (which it would read with `torch.load(weights_only=False)`)."""

    def load_bytes(self, read_item, value) -> None:  # noqa: ARG002 - the planner's signature
        raise UnsafeCheckpointError(
            f"the checkpoint holds {read_item.dest_index.fqn!r} as pickled bytes, which autopar never writes "
            f"nor reads: nothing of it ran"
        )


def refuse_byte_items(items, where) -> None:
    """UnsafeCheckpointError if any of DCP's read items is a byte item."""
    for item in items:
        if item.type == LoadItemType.BYTE_IO:
            raise UnsafeCheckpointError(
                f"{where} holds {item.dest_index.fqn!r} as pickled bytes, which autopar never writes nor reads: "
                f"it was not read; nothing of it ran"
            )
