"""Hugging Face weights in and out: safetensors files that `transformers.AutoModel*.from_pretrained` reads and
writes, without any rank holding the whole model.

Out (`save_pretrained`): the tensors (the model's first name of each parameter, so a tied LM head is saved
once, under the name Hugging Face keeps; persistent buffers) are cut into files of at most
`max_shard_size` bytes in the model's order, in the dtype the model was handed in. One file is
`model.safetensors`; more are `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`.
Files are written in rounds, one per rank per round: the pieces of a file's tensors travel to the rank
writing it (`pieces.assemble`), so a rank holds at most one file's tensors. Rank 0 writes the index, the
config (naming the model's class and the weights' dtype, as transformers does) and the generation config
where the model has one (transformers gives one to models that generate only, not to encoders).

In (`load_pretrained`): every rank opens the files' headers (names, shapes, dtypes), checks them against
the model (a missing or unexpected tensor, a shape that differs, a file that is not safetensors: a
`ConfigError` naming the tensor and the file), and reads only the slices of its own pieces (safetensors
slices read only those bytes), converting the dtype (a bf16 checkpoint into fp32 masters).

A model built on the meta device (`compile(..., pretrained=dir)`): its parameters stay on meta until each
program makes its master pieces (`Program.master` gives an uninitialised tensor for a meta one; the
offload program, which copies the whole model by design, gets uninitialised parameters); its buffers get
real values before tracing: persistent ones from the files, the others (rotary tables) by the model's own
Hugging Face initialisation of the module holding them (`_init_weights`, which recomputes them from the
config), checked to have produced finite values.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch

from autopar.checkpoint.pieces import Piece, assemble, barrier, rank, world
from autopar.cluster import parse_bytes
from autopar.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
HEADER_LIMIT_BYTES = 100_000_000  # safetensors' own limit on a header
INDEX_LIMIT_BYTES = 64 * 2**20


def _bytes(value) -> int:
    return int(parse_bytes(value))


# ------------------------------------------------------------------------------------------------ out


def shard_files(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names (in order) cut into files of at most `max_bytes` (a tensor larger than that gets a file alone)."""
    files: list[list[str]] = [[]]
    size = 0
    for name, n in sizes.items():
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


def file_names(num_files: int) -> list[str]:
    if num_files == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]


def save_pretrained(program, path, *, max_shard_size="2GB", merged: bool = False) -> None:
    """See the module docstring; every rank calls it. A PEFT model's adapters (or, `merged`, its merged base
    model) go through `autopar.checkpoint.peft`."""
    from safetensors.torch import save_file

    if getattr(program, "peft", None) is not None:
        from autopar.checkpoint import peft

        if merged:
            return peft.save_merged(program, path, max_shard_size=max_shard_size)
        return peft.save_adapter(program, path)
    if merged:
        raise ConfigError("merged=True merges a PEFT model's adapters, and this model has none; drop merged=")

    path = Path(path)
    max_bytes = _bytes(max_shard_size)
    names = program.checkpoint_names
    masters = program.checkpoint_masters()
    buffers = program.checkpoint_buffers()
    shapes = {n: names.shapes[n] for n in names.masters}
    shapes |= {n: tuple(b.shape) for n, b in buffers.items()}
    dtypes = {n: names.dtypes[n] for n in shapes}
    sizes = {n: math.prod(shapes[n]) * dtypes[n].itemsize for n in shapes}
    files = shard_files(sizes, max_bytes)
    names = file_names(len(files))
    if rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        for old in [*path.glob("model*.safetensors"), path / INDEX]:
            old.unlink(missing_ok=True)
    barrier()
    ranks = world()
    for first in range(0, len(files), ranks):  # one file per rank per round
        owners = {n: (i - first) for i in range(first, min(first + ranks, len(files))) for n in files[i]}
        params = {n: r for n, r in owners.items() if n not in buffers}
        full = assemble({n: p for n, p in masters.items() if n in params}, params, dtypes, shapes=shapes)
        index = first + rank()
        if index < len(files):
            tensors = {
                n: full[n] if n in full else buffers[n].detach().to("cpu", dtypes[n]).contiguous() for n in files[index]
            }
            save_file(tensors, str(path / names[index]), metadata={"format": "pt"})
            del tensors, full
    if rank() == 0:
        if len(files) > 1:
            weight_map = {n: names[i] for i, group in enumerate(files) for n in group}
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            (path / INDEX).write_text(json.dumps(index, indent=2))
        config = config_to_write(program)
        if config is not None:
            config.save_pretrained(str(path))
        if program.generation_config is not None:
            program.generation_config.save_pretrained(str(path))
    barrier()


def config_to_write(program):
    """The model's Hugging Face config as `PreTrainedModel.save_pretrained` writes it: naming the model's class
    in `architectures` (so the folder says which head it holds) and the dtype of the weights written; a copy,
    the model's own is left alone. None when the model has no Hugging Face config."""
    config = program.hf_config
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return None
    config = copy.deepcopy(config)
    config.architectures = [program.hf_class_name]
    names = program.checkpoint_names
    floating = [d for n in names.masters if (d := names.dtypes[n]).is_floating_point]
    if floating:  # as transformers' `model.dtype`: the first floating parameter's
        config.dtype = str(floating[0]).removeprefix("torch.")
    return config


# ------------------------------------------------------------------------------------------------ in


class WeightFiles:
    """The tensors of a Hugging Face weights folder: name -> (file, shape, dtype), read from the headers only."""

    def __init__(self, path):
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            weight_map = _weight_map(index)
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            found = sorted(p.name for p in self.path.glob("*.safetensors")) if self.path.is_dir() else []
            if len(found) != 1:
                raise ConfigError(
                    f"{self.path} holds no {SINGLE} and no {INDEX} (found {found or 'nothing'}): pass a "
                    f"folder written by save_pretrained"
                )
            weight_map, files = None, found
        self.tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for name in files:
            for key, (shape, dtype) in self._header(name).items():
                if weight_map is not None and weight_map.get(key) != name:
                    raise ConfigError(
                        f"{self.path / name} holds {key!r}, which the index {INDEX} puts in {weight_map.get(key)!r}"
                    )
                self.tensors[key] = (name, shape, dtype)
        if weight_map is not None:
            absent = sorted(k for k in weight_map if k not in self.tensors)
            if absent:
                raise ConfigError(
                    f"the index {self.path / INDEX} lists {len(absent)} tensor(s) its files do not "
                    f"hold, e.g. {absent[:3]} in {weight_map[absent[0]]}"
                )

    def _header(self, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype) from a file's header, checked against the file's size: the header's length
        before it is read (at most HEADER_LIMIT_BYTES, safetensors' own limit, and within the file), then every
        entry's dtype, shape and byte range."""
        file = self.path / name
        try:
            size = file.stat().st_size
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 2 <= n <= min(HEADER_LIMIT_BYTES, size - 8):
                    raise ConfigError(
                        f"{file} is not a safetensors file: it declares a header of {n} bytes in a file of {size} "
                        f"(at most {HEADER_LIMIT_BYTES})"
                    )
                header = json.loads(f.read(n))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{file} is not a readable safetensors file ({type(e).__name__}: {str(e)[:200]})") from e
        if not isinstance(header, dict):
            raise ConfigError(f"{file} has a corrupt safetensors header (a {type(header).__name__}, not an object)")
        out, end = {}, 0
        for key, info in header.items():
            if key == "__metadata__":
                continue
            problem = _entry_problem(info)
            if problem:
                raise ConfigError(f"{file} has a corrupt safetensors header: {key[:100]!r} {problem}")
            out[key] = (tuple(info["shape"]), info["dtype"])
            end = max(end, info["data_offsets"][1])
        if 8 + n + end > size:
            raise ConfigError(
                f"{file} is cut short: its header places tensors up to byte {8 + n + end} but the file has {size} bytes"
            )
        return out

    def file_of(self, key: str) -> Path:
        return self.path / self.tensors[key][0]


_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2}
_DTYPE_BYTES |= {"I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _entry_problem(info) -> str | None:
    """What is wrong with one tensor's header entry (None: a dtype safetensors knows, a shape of whole numbers,
    a byte range that holds exactly that many elements)."""
    if not isinstance(info, dict):
        return "is not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        return "names no dtype"
    if not isinstance(shape, list) or len(shape) > 64 or not all(_whole(d) for d in shape):
        return "has no shape of whole numbers"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole(o) for o in offsets):
        return "has no byte range"
    if offsets[1] < offsets[0]:
        return f"has the byte range {offsets}, which ends before it starts"
    # a dtype this table lacks (a newer safetensors') has only its range checked
    if dtype in _DTYPE_BYTES and offsets[1] - offsets[0] != math.prod(shape) * _DTYPE_BYTES[dtype]:
        return f"places {math.prod(shape)} elements of {dtype} in {offsets[1] - offsets[0]} bytes"
    return None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> file map, read within INDEX_LIMIT_BYTES; every file a name inside the folder."""
    try:
        with open(index, "rb") as f:
            raw = f.read(INDEX_LIMIT_BYTES + 1)
        if len(raw) > INDEX_LIMIT_BYTES:
            raise ConfigError(f"{index} is larger than {INDEX_LIMIT_BYTES} bytes, which no safetensors index is")
        weight_map = json.loads(raw)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {e}") from e
    bad = (
        "not an object"
        if not isinstance(weight_map, dict)
        else next(
            (
                repr(v)[:80]
                for v in weight_map.values()
                if not isinstance(v, str) or not v or "/" in v or "\\" in v or v in (".", "..")
            ),
            None,
        )
    )
    if bad is not None:
        raise ConfigError(f"{index} maps tensors to {bad}, which is not a file of the folder {index.parent}")
    return weight_map


def _name_in_files(canonical: str, names_of: dict[str, list[str]], files: WeightFiles) -> str | None:
    return next((n for n in names_of[canonical] if n in files.tensors), None)


def check_files(program, files: WeightFiles) -> dict[str, str]:
    """canonical master name -> the key holding it in the files; raises on a missing, unexpected or misshapen
    tensor."""
    model = program.checkpoint_names
    names_of: dict[str, list[str]] = {}
    for name, first in model.first_names.items():
        names_of.setdefault(first, []).append(name)
    known = set(model.first_names) | set(model.persistent_buffers)
    unexpected = sorted(k for k in files.tensors if k not in known)
    if unexpected:
        k = unexpected[0]
        raise ConfigError(
            f"{files.file_of(k)} holds {len(unexpected)} tensor(s) the model does not have, e.g. "
            f"{unexpected[:3]}: these weights are of another model"
        )
    keys = {}
    for name in model.masters:
        key = _name_in_files(name, names_of, files)
        if key is None:
            raise ConfigError(
                f"the weights in {files.path} lack {name!r} (shape {model.shapes[name]}): "
                f"they are of another model, or the files are incomplete"
            )
        shape = files.tensors[key][1]
        if tuple(shape) != tuple(model.shapes[name]):
            raise ConfigError(
                f"{key!r} in {files.file_of(key)} has shape {tuple(shape)} but the model's "
                f"{name!r} has {tuple(model.shapes[name])}"
            )
        keys[name] = key
    return keys


def _read_piece(handle, key: str, piece: Piece) -> torch.Tensor:
    """The slice of `key` a piece holds, read from an open safetensors file (only those bytes, flat pieces the
    rows that cover them)."""
    shape = piece.shape
    if not shape:
        return handle.get_tensor(key)
    sl = handle.get_slice(key)
    if piece.flat is None:
        return sl[tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.tensor.shape, strict=True))]
    row = math.prod(shape[1:])
    start, stop = piece.flat
    lo, hi = start // row, -(-stop // row)
    rows = sl[lo:hi].reshape(-1)
    return rows[start - lo * row : stop - lo * row]


def load_pretrained(program, path) -> int:
    """Read the weights in `path` into `program`'s master pieces; returns the bytes this rank read."""
    from safetensors import safe_open

    files = WeightFiles(path)
    keys = check_files(program, files)
    masters = program.checkpoint_masters()
    by_file: dict[Path, list[str]] = {}
    for name in masters:
        by_file.setdefault(files.file_of(keys[name]), []).append(name)
    read = 0
    for file, names in sorted(by_file.items()):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in names:
                    piece = masters[name]
                    value = _read_piece(handle, keys[name], piece)
                    read += value.numel() * value.element_size()
                    with torch.no_grad():
                        piece.tensor.copy_(value.reshape(piece.tensor.shape))
        except ConfigError:
            raise
        except Exception as e:  # safetensors' own errors carry no common base class
            raise ConfigError(f"reading {file}: {type(e).__name__}: {e}") from e
    program.after_checkpoint_load()
    program.pretrained_bytes_read = read
    barrier()
    return read


# ------------------------------------------------------------------------------------------------ meta models


def is_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def materialize_buffers(model: torch.nn.Module, path) -> None:
    """Give a meta model's buffers real values on the CPU: persistent ones from the weights in `path`, the others
    by the model's Hugging Face initialisation of the module holding them (see the module docstring)."""
    files = WeightFiles(path)
    persistent = set(model.state_dict())
    made: list[tuple[str, torch.nn.Module, str]] = []
    for prefix, module in model.named_modules():
        for attr, buf in list(module._buffers.items()):
            if buf is None or not buf.is_meta:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            if name in persistent and name in files.tensors:
                from safetensors import safe_open

                with safe_open(str(files.file_of(name)), framework="pt") as f:
                    module._buffers[attr] = f.get_tensor(name).to(buf.dtype)
                continue
            fill = float("nan") if buf.is_floating_point() else 0
            module._buffers[attr] = torch.full(buf.shape, fill, dtype=buf.dtype)
            made.append((name, module, attr))
    init = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for _, module in {id(m): (n, m) for n, m, _ in made}.values():
            if init is not None:
                init(module)
    for name, module, attr in made:
        value = module._buffers[attr]
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ConfigError(
                f"the buffer {name!r} of the meta model is not in {path} and the model's initialisation "
                f"does not compute it: build the model on the CPU, or give that buffer a value "
                f"before compile"
            )


def materialize_parameters(model: torch.nn.Module, device="cpu") -> None:
    """Replace meta parameters by uninitialised ones on `device` (tied ones stay tied), for a program that holds
    the whole model per rank; load_pretrained then fills them."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
                )
            module._parameters[attr] = made[id(p)]


def traceable_stand_in(model: torch.nn.Module, device="cpu") -> torch.nn.Module:
    """A copy of a meta model whose parameters are fake tensors on `device` (buffers copied as they are), for
    planning and tracing: traced as it is, a meta model would put `device="meta"` into the graph's factory ops
    (`arange(..., device=embeds.device)`), which then could not run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        if p.is_meta and id(p) not in memo:
            with mode:
                fake = torch.empty(p.shape, dtype=p.dtype, device=device)
            memo[id(p)] = torch.nn.Parameter(fake, p.requires_grad)
    import copy

    return copy.deepcopy(model, memo)
