"""Plain data in a training checkpoint: what is not a model tensor is JSON or a tensor, never a Python pickle.

A checkpoint holds, beside the masters, optimizer states and buffers:

- `autopar.meta`: the program's `checkpoint_meta()` (step, loss scale, optimizer hyperparameters, layout) as JSON;
- `autopar.extra`: the user's `extra=` as JSON, its tensors as `autopar.extra.tensor<i>` entries of their own
  (the JSON lists where each tensor goes);
- `autopar.rng.rank<r>`: rank r's Python and NumPy generator states as JSON, its torch (and CUDA) generator
  states as the uint8 tensors torch gives (`autopar.rng.rank<r>.torch`, `.cuda`).

A JSON document travels as a uint8 tensor of its UTF-8 bytes (`json_tensor`), so torch.distributed.checkpoint
stores it as a tensor too, and reading it back runs no code: `json.loads`, bounded in size (`JSON_LIMIT_BYTES`)
and depth (`MAX_DEPTH`), then a check of its shape before anything uses it.

`extra=` takes a dict of JSON data (None, booleans, numbers, strings, lists, tuples, dicts with string keys) and
tensors at any place in it; tuples come back as lists, tensors on the CPU. Anything else is refused when the
save is called (`ExtraError` naming where it is), before any rank writes.
"""

from __future__ import annotations

import json
import math
import random

import torch

from autopar.errors import ConfigError

JSON_LIMIT_BYTES = 64 * 2**20  # a JSON document of a checkpoint above this is refused when read
MAX_DEPTH = 100  # nesting of lists and dicts in `extra=`
TENSOR_PREFIX = "autopar.extra.tensor"


class ExtraError(ConfigError):
    """`extra=` holds something a checkpoint does not store (a value that is neither JSON data nor a tensor)."""


class DataError(ValueError):
    """A JSON document of a checkpoint that is malformed (the caller names the file)."""


# --------------------------------------------------------------------------------------------- JSON


def json_tensor(value) -> torch.Tensor:
    """`value` (JSON data) as a uint8 tensor of its UTF-8 JSON text."""
    text = json.dumps(value, allow_nan=True, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def from_json_tensor(tensor: torch.Tensor, what: str):
    """The JSON value a `json_tensor` holds; DataError when it is not one."""
    if tensor.dtype != torch.uint8 or tensor.ndim != 1:
        raise DataError(f"{what} is a {tensor.dtype} tensor of shape {tuple(tensor.shape)}, not JSON text")
    if tensor.numel() > JSON_LIMIT_BYTES:
        raise DataError(f"{what} holds {tensor.numel()} bytes of JSON, more than the {JSON_LIMIT_BYTES} read")
    try:
        return json.loads(tensor.numpy().tobytes())
    except RecursionError as e:
        raise DataError(f"{what} is nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise DataError(f"{what} is not valid JSON ({e})") from e


def depth_within(value, limit: int = MAX_DEPTH) -> bool:
    """Whether `value`'s lists and dicts nest at most `limit` deep (iteratively: no recursion on the input)."""
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, tuple, dict)):
            if d >= limit:
                return False
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return True


# -------------------------------------------------------------------------------------------- extra


def encode_extra(extra) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the JSON document of `extra`, its tensors by checkpoint key): tensors leave the JSON as None, and the
    document lists the path (keys and indices) of each. ExtraError for anything else."""
    if extra is not None and not isinstance(extra, dict):
        raise ExtraError(f"extra must be a dict (data position, schedule state, ...), got {type(extra).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    paths: list[list] = []

    def plain(v, path: tuple, depth: int):
        if depth > MAX_DEPTH:
            raise ExtraError(f"extra{_where(path)} is nested more than {MAX_DEPTH} deep; flatten it")
        if isinstance(v, torch.Tensor):
            if type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
                raise ExtraError(
                    f"extra{_where(path)} is a {type(v).__name__}; store plain tensors (.full_tensor() of a DTensor)"
                )
            tensors[f"{TENSOR_PREFIX}{len(paths)}"] = v.detach().cpu().contiguous()
            paths.append(list(path))
            return None
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return float(v)
        if isinstance(v, (list, tuple)):
            return [plain(x, (*path, i), depth + 1) for i, x in enumerate(v)]
        if isinstance(v, dict):
            bad = next((k for k in v if not isinstance(k, str)), None)
            if bad is not None:
                raise ExtraError(
                    f"extra{_where(path)} has the key {bad!r} ({type(bad).__name__}); a checkpoint keeps string "
                    f"keys only (JSON): use str({bad!r})"
                )
            return {k: plain(x, (*path, k), depth + 1) for k, x in v.items()}
        raise ExtraError(
            f"extra{_where(path)} is a {type(v).__module__}.{type(v).__qualname__}; a checkpoint stores plain "
            f"data only (None, booleans, numbers, strings, lists, tuples, dicts with string keys) and tensors, "
            f"so that loading it runs no code: convert it (int(), float(), .tolist(), torch.as_tensor())"
        )

    value = plain(dict(extra or {}), (), 0)
    return {"value": value, "tensors": paths}, tensors


def _where(path: tuple) -> str:
    return "".join(f"[{p!r}]" for p in path)


def decode_extra(doc, tensors: dict[str, torch.Tensor]) -> dict:
    """The user's dict back from `encode_extra`'s document and the tensors read; DataError when malformed."""
    if not isinstance(doc, dict) or not isinstance(doc.get("value"), dict) or not isinstance(doc.get("tensors"), list):
        raise DataError("autopar.extra is not a document of the user's extra dict")
    value = doc["value"]
    for i, path in enumerate(doc["tensors"]):
        key = f"{TENSOR_PREFIX}{i}"
        if key not in tensors or not isinstance(path, list) or not path:
            raise DataError(f"autopar.extra places tensor {i} at {path!r}, which is not a place it holds")
        parent = value
        for step in path[:-1]:
            parent = _child(parent, step, path)
        last = path[-1]
        _child(parent, last, path)  # the place exists (a None there)
        parent[last] = tensors[key]
    return value


def _child(parent, step, path):
    ok = (isinstance(parent, dict) and isinstance(step, str) and step in parent) or (
        isinstance(parent, list) and isinstance(step, int) and not isinstance(step, bool) and 0 <= step < len(parent)
    )
    if not ok:
        raise DataError(f"autopar.extra places a tensor at {path!r}, which is not a place it holds")
    return parent[step]


def extra_tensor_keys(doc) -> list[str]:
    """The checkpoint keys of the tensors `doc` (an extra document) lists."""
    count = len(doc["tensors"]) if isinstance(doc, dict) and isinstance(doc.get("tensors"), list) else 0
    return [f"{TENSOR_PREFIX}{i}" for i in range(count)]


# ---------------------------------------------------------------------------------------------- meta


def check_meta(meta) -> dict:
    """`checkpoint_meta()`'s data as read back, its types checked; DataError when malformed."""
    if not isinstance(meta, dict):
        raise DataError("autopar.meta is not a JSON object")
    step = meta.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise DataError(f"autopar.meta gives the step as {step!r}, not a count of steps")
    skipped = meta.get("skipped_steps", 0)
    if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
        raise DataError(f"autopar.meta gives the skipped steps as {skipped!r}, not a count of steps")
    scaler = meta.get("scaler")
    if scaler is not None and not (
        isinstance(scaler, dict)
        and all(_finite_number(scaler.get(k)) for k in ("scale", "good_steps"))
        and scaler["scale"] > 0
    ):
        raise DataError(f"autopar.meta holds a loss scale that is not one: {scaler!r}"[:300])
    groups = meta.get("param_groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise DataError("autopar.meta's param_groups is not a list of JSON objects")
    return meta


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ----------------------------------------------------------------------------------------------- RNG


def rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """This rank's generators: (Python and NumPy states as JSON data, {"torch": ..., "cuda": ...} tensors)."""
    version, internal, gauss = random.getstate()
    doc: dict = {"python": [version, list(internal), gauss]}
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        doc["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return doc, tensors


def checked_rng_state(doc, tensors: dict[str, torch.Tensor]) -> dict:
    """The states to set, each tried on a generator of its own first (so that a malformed one raises DataError
    before any is set)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("python"), list) or len(doc["python"]) != 3:
        raise DataError("the RNG states are not a JSON object with a Python generator state")
    version, internal, gauss = doc["python"]
    state: dict = {}
    try:
        state["python"] = (version, tuple(internal), gauss)
        random.Random().setstate(state["python"])
        if "torch" in tensors:
            torch.Generator().set_state(tensors["torch"])
            state["torch"] = tensors["torch"]
        if "numpy" in doc:
            import numpy as np

            kind, keys, pos, has_gauss, cached = doc["numpy"]
            state["numpy"] = (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
            np.random.RandomState().set_state(state["numpy"])
    except (TypeError, ValueError, OverflowError, RuntimeError, ImportError) as e:
        raise DataError(f"the RNG states are malformed ({type(e).__name__}: {e})"[:300]) from e
    if "cuda" in tensors:
        state["cuda"] = tensors["cuda"]
    return state


def set_rng_state(state: dict) -> None:
    """Set this rank's generators to `checked_rng_state`'s states."""
    random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
