"""Traces kept in the process for the next model of the same structure.

``torch.export`` takes about a second for even a two-layer model, and a process traces the same structure again
and again: planning a model on several clusters, compiling the plan after planning, a preset's stand-in layers on
every mesh, and the ranks of a test run building the same tiny model test after test. A trace depends only on the
model's code and structure, never on the values of its weights (``export(strict=False)`` runs the model on fake
tensors), so the graph of a model of the same structure, called on inputs of the same shapes, is the same graph.

:func:`structure_key` says what a trace depends on, or None when it cannot tell (a module with hooks):
- every module's path, class, ``forward`` function, training flag and plain attributes (a Hugging Face config by
  value, a function or an object it cannot describe by identity), and which buffers are not persistent;
- every parameter's and buffer's name, shape, dtype, device type, tensor class and ``requires_grad``, and which
  names share one tensor (tied weights);
- the inputs' structure, and each tensor leaf's shape, dtype, device type and ``requires_grad`` (other leaves by
  value);
- the traced format, grad mode, the default dtype, autocast, and whether the trace runs on cp chunks
  (``context_parallel.inputs.sequences_are_split``: a loss traced inside reads it).

:class:`TraceCache` keeps a copy of each trace without the model's tensors (parameters, buffers, constants and the
example inputs replaced by meta stand-ins: a cached trace never keeps a model or a batch alive) and hands out a
fresh copy bound to the caller's model: its own graph (a pass may rewrite it), the caller's parameters and buffers
in its state dict, and constants taken from the caller's model the way the trace took them. Node metadata (fake
values, module stacks) is shared between copies, as ``copy.deepcopy`` of a graph module shares it; nothing in
autopar changes it in place.

What the key does not see: a function the forward calls, replaced in place where it lives (a module-level helper
of the model's library patched at run time); after such a patch call ``CACHE.clear()``, or set
``AUTOPAR_TRACE_CACHE=0`` to turn the cache off (every call exports).
"""

from __future__ import annotations

import copy
import enum
import functools
import os
import threading
import types
import warnings
from collections import OrderedDict
from collections.abc import Hashable

import torch
from torch.utils import _pytree as pytree

from autopar.context_parallel.inputs import sequences_are_split

KEEP = 16  # traces kept (least recently used dropped): a run plans a handful of structures
_MAX_ITEMS = 4096  # attribute values past which a structure is not described (the trace is not cached)
_MAX_DEPTH = 12  # nesting of attribute values (configs, closures, classes a function defines) past which not described
_PRIMITIVES = (type(None), bool, int, str, bytes)
# parts of nn.Module.__dict__ described apart (parameters, buffers, children) or that do not change the forward
_MODULE_INTERNALS = {
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_is_full_backward_hook",
    "training",
}
# hooks run code around the forward that the structure does not show: a module with any is not cached
_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


class _Undescribable(Exception):
    """A value the key cannot describe within its bounds: the trace is not cached."""


def enabled() -> bool:
    return os.environ.get("AUTOPAR_TRACE_CACHE", "1") != "0"


class _Describer:
    """Turns the values a forward may read into hashable descriptions of what they are, so that two models built
    alike describe alike: plain data and configs by value, functions by their code (and what their closures and
    defaults hold), classes defined inside a function by their code, modules of the model by their path, other
    modules and objects by their class and attributes. What it describes by identity (a code object, a class
    defined at module level, a tensor that is not a parameter) it keeps in `refs`, so that no other object takes
    the identity while a key holding it lives."""

    def __init__(self, module_paths: dict[int, str]) -> None:
        self.refs: list[object] = []
        self.items = 0
        self.module_paths = module_paths
        self._memo: dict[int, Hashable] = {}
        self._alive: list[object] = []

    def identity(self, value) -> Hashable:
        self.refs.append(value)
        return ("id", id(value))

    def __call__(self, value, depth: int = 0) -> Hashable:
        self.items += 1
        if self.items > _MAX_ITEMS or depth > _MAX_DEPTH:
            raise _Undescribable
        if isinstance(value, _PRIMITIVES):
            return value
        if isinstance(value, float):
            return ("float", repr(value))  # nan equals itself by its text
        if isinstance(value, (torch.dtype, torch.device, torch.Size, enum.Enum)):
            return (type(value).__name__, str(value))
        if isinstance(value, torch.Tensor):
            return self.identity(value)  # its values may be traced in as a constant
        if id(value) in self.module_paths:
            return ("module", self.module_paths[id(value)])
        memo = self._memo.get(id(value))
        if memo is not None:  # a config shared by every layer: described once
            return memo
        self._alive.append(value)  # its id stays its own while the memo names it
        self._memo[id(value)] = ("cycle", len(self._memo))  # the same in two models built alike
        out = self._describe(value, depth + 1)
        self._memo[id(value)] = out
        return out

    def _describe(self, value, depth: int) -> Hashable:
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(self(v, depth) for v in value))
        if isinstance(value, (set, frozenset)):
            return (type(value).__name__, tuple(sorted((self(v, depth) for v in value), key=repr)))
        if isinstance(value, dict):
            return ("dict", tuple(sorted(((repr(k), self(v, depth)) for k, v in value.items()), key=repr)))
        if isinstance(value, type):
            return self.of_class(value, depth)
        if isinstance(value, types.FunctionType):
            cells = tuple(self(c.cell_contents, depth) if _filled(c) else "empty" for c in value.__closure__ or ())
            return ("function", self.identity(value.__code__), self(value.__defaults__, depth),
                    self(value.__kwdefaults__, depth), cells)  # fmt: skip
        if isinstance(value, types.MethodType):
            return ("method", self(value.__func__, depth), self(value.__self__, depth))
        if isinstance(value, functools.partial):
            return ("partial", self(value.func, depth), self(value.args, depth), self(value.keywords, depth))
        if isinstance(value, torch.nn.Module):  # not one of the model's: described as its own model would be
            params = tuple((n, _tensor_facts(t)) for n, t in value.named_parameters(remove_duplicate=False))
            return ("module", self.of_class(type(value), depth), self(_attributes(value), depth), params)
        if hasattr(value, "__dict__") and not isinstance(value, (types.ModuleType, types.BuiltinFunctionType)):
            return ("object", self.of_class(type(value), depth), self(dict(vars(value)), depth))
        return self.identity(value)  # builtins, modules, objects without attributes

    def of_class(self, cls: type, depth: int = 0) -> Hashable:
        """A class at module level by identity; one a function defines (a new class each call) by its code."""
        if "<locals>" not in cls.__qualname__:
            return self.identity(cls)
        body = {k: v for k, v in vars(cls).items() if not k.startswith("__") or k in ("__call__", "__init__")}
        return ("class", cls.__module__, cls.__qualname__, tuple(self.of_class(b, depth) for b in cls.__bases__),
                self(body, depth + 1))  # fmt: skip


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _attributes(module: torch.nn.Module) -> dict:
    """A module's own attributes other than its parameters, buffers, children and hooks."""
    return {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS and k not in _HOOKS}


def _tensor_facts(t: torch.Tensor) -> Hashable:
    return (type(t), tuple(t.shape), t.dtype, t.device.type, t.requires_grad)


def structure_key(model: torch.nn.Module, args: tuple, kwargs: dict, compute_dtype) -> tuple[tuple, list] | None:
    """What a trace of ``model(*args, **kwargs)`` in ``compute_dtype`` depends on (see the module's doc), and the
    objects it names by identity; None when it cannot be described (hooks, values past the bounds)."""
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return None
    named_modules = list(model.named_modules(remove_duplicate=False))
    describe = _Describer({id(m): path for path, m in reversed(named_modules)})  # a shared module: its first path
    try:
        modules = []
        for path, module in named_modules:
            if any(getattr(module, h, None) for h in _HOOKS):
                return None
            modules.append(
                (
                    path,
                    describe.of_class(type(module)),
                    describe(type(module).forward),  # a forward replaced on the class is another function
                    module.training,
                    tuple(sorted(module._non_persistent_buffers_set)),
                    describe(_attributes(module)),  # an instance's own `forward` among them
                )
            )
        first_name: dict[int, str] = {}
        tensors = []
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        for name, t in named:
            tensors.append((name, first_name.setdefault(id(t), name), _tensor_facts(t)))
        leaves, spec = pytree.tree_flatten((args, kwargs))
        inputs = tuple(_tensor_facts(v) if isinstance(v, torch.Tensor) else describe(v) for v in leaves)
    except _Undescribable:
        return None
    context = (
        compute_dtype,
        torch.is_grad_enabled(),
        torch.get_default_dtype(),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
        sequences_are_split(),
    )
    return (tuple(modules), tuple(tensors), str(spec), inputs, context), describe.refs


class TraceCache:
    """Traces by structure key, least recently used dropped past `keep`; safe to share between threads."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        """Forget every trace (and the counts of hits and misses)."""
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple, model: torch.nn.Module, inputs: tuple):
        """A copy of the trace stored under `key` bound to `model` and `inputs` (the normalized call's `(args,
        kwargs)`), with what was stored beside it; None when there is none."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        template, slots, extra, _refs = entry
        memo = {}
        leaves = pytree.tree_leaves(inputs)
        for standin_id, (where, name, dtype) in slots.items():
            if where == "input":  # an example input, by its place among the leaves
                memo[standin_id] = leaves[name]
                continue
            tensor = tensor_at(model, name)
            memo[standin_id] = tensor if dtype is None else tensor.detach().to(dtype)
        return _copied(template, memo), extra

    def put(self, key: tuple, refs: list, exported, model: torch.nn.Module, inputs: tuple, extra) -> None:
        """Keep a copy of `exported` (traced from `model` on `inputs`) without the model's tensors or the inputs."""
        memo: dict[int, object] = {}
        slots: dict[int, tuple] = {}

        def standin(value: torch.Tensor, slot: tuple | None) -> None:
            meta = _meta_like(value)
            memo[id(value)] = meta
            if slot is not None:
                slots[id(meta)] = slot

        for name, value in [*exported.state_dict.items(), *exported.constants.items()]:
            if not isinstance(value, torch.Tensor) or id(value) in memo:
                continue
            own = tensor_at(model, name)
            if own is value:  # the model's parameter or buffer
                standin(value, ("path", name, None))
            elif own is not None and _is_real(value):  # a constant the trace took from it in the traced format
                standin(value, ("path", name, value.dtype))
            elif not _is_real(value):  # the compute-format stand-in's fake: its shape is all it says
                standin(value, None)
        for i, leaf in enumerate(pytree.tree_leaves(inputs)):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in memo:
                standin(leaf, ("input", i, None))
        template = _copied(exported, memo)
        with self._lock:
            self._entries[key] = (template, slots, extra, refs)
            self._entries.move_to_end(key)
            while len(self._entries) > self.keep:
                self._entries.popitem(last=False)


def _meta_like(value: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `value`'s shape and dtype, a parameter where it is one (the program's verifier checks)."""
    meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
    return torch.nn.Parameter(meta, value.requires_grad) if isinstance(value, torch.nn.Parameter) else meta


def _copied(exported, memo: dict):
    with warnings.catch_warnings():  # copying the program's call specs warns of a deprecated spec class
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return copy.deepcopy(exported, memo)


def tensor_at(model: torch.nn.Module, path: str) -> torch.Tensor | None:
    """The tensor at the dotted `path` of `model` (a parameter, buffer or plain attribute), or None."""
    owner, _, attr = path.rpartition(".")
    try:
        value = getattr(model.get_submodule(owner) if owner else model, attr)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None


def _is_real(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor) and t.device.type != "meta"


CACHE = TraceCache()

__all__ = ["CACHE", "KEEP", "TraceCache", "enabled", "structure_key", "tensor_at"]
