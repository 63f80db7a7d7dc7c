"""Tracing front end: a model and example inputs in, an ATen-level fx graph with its signature out.

:func:`trace_model` runs ``torch.export.export(..., strict=False)``: the model's Python runs as
usual while tensors are fake, so real, fake and meta inputs all work and nothing is computed or
allocated at full size. The export is of the training-IR kind (no decompositions beyond ATen,
dropout kept as ``aten.dropout``), taken in the mode the model is in: export a training model in
``model.train()`` so dropout and training-only branches are in the graph; ``model.eval()``
gives the inference graph.

What the export does not say directly, :class:`TracedModel` adds:

- *placeholder kinds*: every placeholder of the graph is a parameter, a buffer (persistent or
  not), a constant (a lifted tensor constant, script object or effect token) or a user input;
  user inputs carry where they came from (``args[0]``, ``kwargs['labels']``).
- *tied weights*: ``torch.export`` lifts one placeholder per parameter *name*, so GPT-2's
  ``transformer.wte.weight`` and ``lm_head.weight`` (one tensor) would look like two parameters
  to the planner and be counted, stored and synchronised twice. They are merged into one
  placeholder under the model's first name for the tensor (the name ``model.parameters()`` and
  the optimizer see); the other names are listed in ``param_aliases``.
- *layers*: the repeated layers (``model.layers.3``, ``transformer.h.0``,
  ``bert.encoder.layer.11``), found from ``node.meta["nn_module_stack"]`` by :func:`layer_of`.

Errors: any failure of the export becomes a :class:`~autopar.errors.TraceError` that names the
innermost submodule of the model whose ``forward`` was running when it failed, the reason
(data-dependent control flow, an unsupported operation, an output that is not a tensor pytree)
and what to do; the original exception is chained.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import linecache
import os
import re
import sysconfig
from dataclasses import dataclass
from types import TracebackType

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from autopar import compat, trace_cache
from autopar.errors import ConfigError, TraceError
from autopar.trace_cache import tensor_at

_PLACEHOLDER_KIND = {
    InputKind.PARAMETER: "param",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
    InputKind.CUSTOM_OBJ: "constant",
    # Effect tokens order side-effecting ops; they are neither trainable nor fed by the user.
    InputKind.TOKEN: "constant",
    InputKind.USER_INPUT: "input",
}


@dataclass(frozen=True, slots=True)
class TracedModel:
    """An exported model and the facts about its graph that the planner needs.

    Attributes:
        exported: the exported program; its graph is the source of truth.
        param_names: original FQNs of the parameter placeholders, in placeholder order. A tied
            tensor appears once, under the first name the model gives it.
        buffer_names: FQNs of the buffer placeholders in placeholder order (non-persistent included).
        placeholder_kinds: for every placeholder of ``exported.graph`` in order: "param", "buffer",
            "constant" or "input".
        user_input_paths: for each "input" placeholder in order, where the value comes from in the
            call: ``"args[0]"``, ``"kwargs['labels']"``, ``"args[1]['mask']"``.
        num_layers: number of distinct repeated layers ``(container, index)`` among the graph's ops.
        param_aliases: ``(other_fqn, graph_fqn)`` for every parameter or buffer name of the model that
            refers to the same tensor as a graph placeholder under another name (GPT-2:
            ``("lm_head.weight", "transformer.wte.weight")``), in the model's order.
    """

    exported: ExportedProgram
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    placeholder_kinds: tuple[str, ...]
    user_input_paths: tuple[str, ...]
    num_layers: int
    param_aliases: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        kinds = set(self.placeholder_kinds)
        if not kinds <= {"param", "buffer", "constant", "input"}:
            raise ValueError(f"unknown placeholder kinds {sorted(kinds)}")
        if self.placeholder_kinds.count("param") != len(self.param_names):
            raise ValueError("param_names must name every 'param' placeholder")
        if self.placeholder_kinds.count("buffer") != len(self.buffer_names):
            raise ValueError("buffer_names must name every 'buffer' placeholder")
        if self.placeholder_kinds.count("input") != len(self.user_input_paths):
            raise ValueError("user_input_paths must locate every 'input' placeholder")

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.exported.graph_module

    @property
    def num_mutated_outputs(self) -> int:
        """Outputs ahead of the model's own: the new values of the buffers and inputs the graph updates in
        place (export returns them first), so the model's first output (the loss) is output this index."""
        sig = self.exported.graph_signature
        return len(sig.buffers_to_mutate) + len(getattr(sig, "user_inputs_to_mutate", {}))


def trace_model(
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
) -> TracedModel:
    """Export ``model`` called as ``model(*example_inputs, **example_kwargs)`` into a :class:`TracedModel`.

    Args:
        model: any ``nn.Module``; its parameters may be real, fake or on the meta device. It is
            exported in the mode it is in (``model.training``): use ``model.train()`` for the
            training graph.
        example_inputs: positional arguments (a single tensor is taken as a one-element tuple).
        example_kwargs: keyword arguments, e.g. ``{"labels": ids}``.
        compute_dtype: trace the graph ``model.to(compute_dtype)`` would give (floating parameters and
            buffers in that format), without converting or copying ``model``: mixed precision computes in
            this format whatever dtype the model was handed in, and the graph differs by format (a norm
            that upcasts to fp32 casts back to the input's format). None: the model's own dtypes.

    Raises:
        ConfigError: example inputs of the wrong container type.
        TraceError: the export failed; the message names the submodule and the reason, and the
            exception from ``torch.export`` is its ``__cause__``.
    """
    args, kwargs = _normalize_inputs(example_inputs, example_kwargs)
    described = trace_cache.structure_key(model, args, kwargs, compute_dtype) if trace_cache.enabled() else None
    if described is not None:
        found = trace_cache.CACHE.get(described[0], model, (args, kwargs))
        if found is not None:
            exported, facts = found
            return TracedModel(exported=exported, **facts)
    traced = _export(model, args, kwargs, compute_dtype)
    if described is not None:
        facts = {f.name: getattr(traced, f.name) for f in dataclasses.fields(traced) if f.name != "exported"}
        trace_cache.CACHE.put(described[0], described[1], traced.exported, model, (args, kwargs), facts)
    return traced


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, compute_dtype: torch.dtype | None) -> TracedModel:
    """`trace_model` without the cache."""
    subject = _in_format(model, compute_dtype) if compute_dtype is not None else model
    try:
        with compat.without_stack_traces():  # no node's stack is read; recording them is a quarter of an export
            exported = torch.export.export(subject, args, kwargs, strict=False)
    except Exception as e:
        # the traced code's own word on bad input (a user's loss, `autopar.loss`) says more than a trace failure
        said = next((c for c in _exception_chain(e) if isinstance(c, ConfigError)), None)
        if said is not None:
            raise said from said.__cause__  # its own cause kept (a KeyError of the loss)
        raise TraceError(_describe_failure(e, model)) from e
    compat.inline_grad_mode_regions(exported.graph_module)
    if subject is not model:
        _take_real_constants(exported, model, compute_dtype)
    exported, aliases = _merge_tied_placeholders(exported, subject)
    specs = exported.graph_signature.input_specs
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(specs), "export gives one placeholder per input spec"
    layers = {layer_of(n) for n in exported.graph.nodes if n.op == "call_function"}
    layers.discard((None, None))
    return TracedModel(
        exported=exported,
        param_names=tuple(s.target for s in specs if s.kind == InputKind.PARAMETER),
        buffer_names=tuple(s.target for s in specs if s.kind == InputKind.BUFFER),
        placeholder_kinds=tuple(_PLACEHOLDER_KIND[s.kind] for s in specs),
        user_input_paths=_user_input_paths(exported),
        num_layers=len(layers),
        param_aliases=aliases,
    )


def _in_format(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` as ``model.to(dtype)`` would make it, with fake tensors for its parameters and buffers (a
    shallow stand-in for tracing: nothing allocated, ``model`` untouched, tied tensors still tied).
    The model itself when it is in that format already."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(not t.is_floating_point() or t.dtype == dtype for t in tensors):
        return model
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}
    for t in tensors:
        if id(t) in memo:
            continue
        with mode:
            fake = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=t.device)
        memo[id(t)] = torch.nn.Parameter(fake, t.requires_grad) if isinstance(t, torch.nn.Parameter) else fake
    return copy.deepcopy(model, memo)


def _take_real_constants(exported: ExportedProgram, model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Lifted constants that are the stand-in's fake buffers (export lifts some non-persistent buffers as
    constants) get the model's real values, in the traced format."""
    from torch._subclasses.fake_tensor import FakeTensor

    for name, value in list(exported.constants.items()):
        if not isinstance(value, FakeTensor):
            continue
        real = tensor_at(model, name)
        if real is None:
            raise TraceError(
                f"the traced constant {name!r} has no value in the model: trace the model in its own "
                f"format (precision matching its dtype)"
            )
        exported.constants[name] = real.detach().to(dtype) if real.is_floating_point() else real.detach()


@functools.lru_cache(maxsize=65536)
def normalize_module_path(path: str) -> str:
    """The plain dotted module path of an ``nn_module_stack`` entry.

    Export versions spell paths as ``"model.layers.0"``, ``"L['self'].model.layers.0"``,
    ``"L['self']._modules['model']._modules['layers']._modules['0']"`` or
    ``"getattr(L['self'].model.layers, '0')"``; all become ``"model.layers.0"``. The root is ``""``.
    """
    previous = None
    while previous != path:
        previous = path
        path = re.sub(r"getattr\(([^()]*), '([^']*)'\)", r"\1.\2", path)
    path = re.sub(r"^(L\['self'\]|L__self__|self)(?=$|[.\[])", "", path)
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^]'\"]*)['\"]?\]", r".\1", path)
    return path.strip(".")


def module_path_of(node: fx.Node) -> str:
    """Path of the innermost module whose forward produced ``node`` ("" for the root or no module)."""
    stack = _module_paths(node)
    return stack[-1] if stack else ""


def layer_of(node: fx.Node) -> tuple[str | None, int | None]:
    """The repeated layer ``node`` belongs to, as ``(container path, index)``.

    ``"model.layers.3"`` gives ``("model.layers", 3)``, ``"transformer.h.0"`` ``("transformer.h", 0)``,
    ``"bert.encoder.layer.11"`` ``("bert.encoder.layer", 11)``. Nodes outside repeated layers
    (embeddings, final norm, head, loss, placeholders) give ``(None, None)``.

    The layer is the *outermost* module on the node's stack whose path ends in an integer: indexed
    modules nested inside a layer (a ``Sequential`` MLP, a list of experts) belong to that layer,
    which is what pipeline cuts and layer deduplication need. For the usual one-level case this is
    also the innermost such path.
    """
    for path in _module_paths(node):
        container, _, last = path.rpartition(".")
        if container and last.isdigit():
            return container, int(last)
    return None, None


def layer_of_param(fqn: str) -> tuple[str | None, int | None]:
    """The repeated layer the parameter named ``fqn`` belongs to, as ``(container path, index)``: :func:`layer_of`'s
    rule applied to the modules on the parameter's path, so that a parameter is in the layer of the ops that read
    it. The planner prices a layer's weights as one gather (``OpGraph`` parameters' ``layer``) and the sharded
    program gathers them as one (``autopar.runtime.layer_gather``) by this function alone.

    The layer is the *outermost* module on the path whose path ends in an integer:
    ``"encoder.block.0.layer.1.DenseReluDense.wi.weight"`` gives ``("encoder.block", 0)`` (T5's numbered sub-layers
    are part of their block), ``"model.layers.0.block_sparse_moe.experts.3.w1.weight"`` ``("model.layers", 0)`` (an
    expert is part of its layer). The last part names the tensor, not a module, so a ``ParameterList`` entry
    (``"w.3"``) is not a layer. Names outside repeated layers (embeddings, final norm, head) give ``(None, None)``.
    """
    modules = fqn.split(".")[:-1]
    for i in range(1, len(modules)):
        if modules[i].isdigit():
            return ".".join(modules[:i]), int(modules[i])
    return None, None


def _module_paths(node: fx.Node) -> list[str]:
    """Normalised module paths of the node's stack, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else value
        paths.append(normalize_module_path(str(path)))
    return paths


def _normalize_inputs(example_inputs, example_kwargs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    elif isinstance(example_inputs, list):
        example_inputs = tuple(example_inputs)
    if not isinstance(example_inputs, tuple):
        raise ConfigError(
            f"example_inputs must be a tuple of positional arguments; got {type(example_inputs).__name__}. "
            "Wrap a single tensor as (ids,)."
        )
    if example_kwargs is None:
        example_kwargs = {}
    if not isinstance(example_kwargs, dict):
        raise ConfigError(f"example_kwargs must be a dict of keyword arguments; got {type(example_kwargs).__name__}")
    return example_inputs, dict(example_kwargs)


def _user_input_paths(exported: ExportedProgram) -> tuple[str, ...]:
    """Where each user-input placeholder comes from, read off the exported call's input pytree spec."""
    specs = [s for s in exported.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    in_spec = exported.call_spec.in_spec
    if in_spec is None or in_spec.num_leaves != len(specs):
        # Not expected of torch.export; the placeholder names still say which argument is which.
        return tuple(f"<{s.arg.name}>" for s in specs)
    tree = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    paths = []
    for key_path, _ in pytree.tree_flatten_with_path(tree)[0]:
        root = "args" if key_path[0].idx == 0 else "kwargs"
        paths.append(root + pytree.keystr(key_path[1:]))
    return tuple(paths)


def _merge_tied_placeholders(
    exported: ExportedProgram, model: torch.nn.Module
) -> tuple[ExportedProgram, tuple[tuple[str, str], ...]]:
    """Give every tied tensor one placeholder, under the model's first name for it; list the other names."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    first_name: dict[int, str] = {}
    for name, tensor in tensors.items():
        first_name.setdefault(id(tensor), name)
    specs = exported.graph_signature.input_specs
    lifted = {InputKind.PARAMETER, InputKind.BUFFER}
    kept_targets = {s.target for s in specs if s.kind in lifted}
    output_targets = {s.target for s in exported.graph_signature.output_specs if s.target is not None}
    drop: dict[str, str] = {}
    for spec in specs:
        if spec.kind not in lifted or spec.target not in tensors:
            continue
        canonical = first_name[id(tensors[spec.target])]
        # A mutated or gradient-producing alias would need its output spec rewritten too; leave those as exported.
        if canonical != spec.target and canonical in kept_targets and spec.target not in output_targets:
            drop[spec.target] = canonical
    if drop:
        exported = _without_placeholders(exported, drop)
    graph_targets = {s.target for s in exported.graph_signature.input_specs if s.kind in lifted}
    aliases = []
    for name, tensor in tensors.items():
        canonical = first_name[id(tensor)]
        if name not in graph_targets and canonical in graph_targets:
            aliases.append((name, canonical))
    return exported, tuple(aliases)


def _without_placeholders(exported: ExportedProgram, drop: dict[str, str]) -> ExportedProgram:
    """A copy of ``exported`` in which each placeholder of a target in ``drop`` is replaced by the one it maps to."""
    gm = exported.graph_module
    node_of = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    placeholder_of = {s.target: node_of[s.arg.name] for s in exported.graph_signature.input_specs if s.target}
    kept_specs: list[InputSpec] = []
    for spec in exported.graph_signature.input_specs:
        if spec.target in drop:
            node = placeholder_of[spec.target]
            node.replace_all_uses_with(placeholder_of[drop[spec.target]])
            gm.graph.erase_node(node)
        else:
            kept_specs.append(spec)
    gm.graph.lint()
    gm.recompile()
    signature = ExportGraphSignature(input_specs=kept_specs, output_specs=list(exported.graph_signature.output_specs))
    state_dict = {k: v for k, v in exported.state_dict.items() if k not in drop}
    constants = {k: v for k, v in exported.constants.items() if k not in drop}
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=state_dict,
        range_constraints=exported.range_constraints,
        module_call_graph=exported.module_call_graph,
        example_inputs=exported.example_inputs,
        constants=constants,
        verifiers=exported.verifiers,
    )


# Frames inside torch and the standard library are machinery; the frame that explains a failure is
# the deepest one in the model's own code (its file or a library such as transformers).
_MACHINERY_DIRS = tuple(
    os.path.normcase(os.path.realpath(d)) + os.sep
    for d in (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"])
)


def _describe_failure(error: BaseException, model: torch.nn.Module) -> str:
    """The TraceError message: what failed, where in the model, and what to do."""
    chain = _exception_chain(error)
    module_names: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        module_names.setdefault(id(module), name)
    path, module = _innermost_module(chain, module_names)
    if module is None or module is model:
        where = f"the root module ({type(model).__name__})"
    else:
        where = f"`{path}` ({type(module).__name__})"
    at = _user_location(chain)
    at_text = f" It happens at {at}." if at else ""
    summary = _summary(chain)
    prefix = f"torch.export could not trace {type(model).__name__}: "
    if any(_is_data_dependent(e) for e in chain):
        return (
            prefix + f"data-dependent control flow (a Python `if`/loop on tensor values) in {where}: "
            f"rewrite it with torch.where/torch.cond or make it static.{at_text} [torch.export: {summary}]"
        )
    if any(_is_unknown_output_type(e) for e in chain):
        return (
            prefix + f"an output of {where} that is not a tensor or a pytree of tensors. Return tensors "
            "(or tuples, lists, dicts, dataclasses or ModelOutputs of them), or register the type with "
            f"torch.utils._pytree.register_pytree_node.{at_text} [torch.export: {summary}]"
        )
    if any(_is_unsupported_op(e) for e in chain):
        return (
            prefix + f"an unsupported operation in {where}.{at_text} Replace it with a traceable ATen op, give a "
            "custom op a fake kernel (torch.library.register_fake), or, if it only fails with meta tensors, "
            f"trace with real or fake tensors. [torch.export: {summary}]"
        )
    return (
        prefix + f"{type(chain[-1]).__name__} in {where}.{at_text} Check that the model runs eagerly on these "
        f"inputs and that the inputs are tensors or pytrees of tensors. [torch.export: {summary}]"
    )


def _exception_chain(error: BaseException) -> list[BaseException]:
    """The error and what caused it, outermost first, without cycles."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        chain.append(current)
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return chain


def _frames(tb: TracebackType | None):
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _innermost_module(chain: list[BaseException], module_names: dict[int, str]) -> tuple[str, torch.nn.Module | None]:
    """(path, module) of the deepest submodule of the model running in any traceback of the chain."""
    best_depth = -1
    best: tuple[str, torch.nn.Module | None] = ("", None)
    for error in chain:
        for frame, _ in _frames(error.__traceback__):
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and id(owner) in module_names:
                path = module_names[id(owner)]
                # A submodule's path extends its parent's, so the longest path is the innermost.
                depth = len(path.split(".")) if path else 0
                if depth >= best_depth:
                    best_depth, best = depth, (path, owner)
    return best


def _user_location(chain: list[BaseException]) -> str | None:
    """'file:line (`source`)' of the deepest frame outside torch and the standard library."""
    location = None
    for error in reversed(chain):
        for frame, lineno in _frames(error.__traceback__):
            filename = frame.f_code.co_filename
            # "<string>" and the like are generated code (dataclass and namedtuple methods) with no source to show.
            if filename.startswith("<") or filename == __file__:
                continue
            if os.path.normcase(os.path.realpath(filename)).startswith(_MACHINERY_DIRS):
                continue
            source = linecache.getline(filename, lineno).strip()
            location = f"{filename}:{lineno}" + (f" (`{source}`)" if source else "")
        if location:
            return location
    return None


def _summary(chain: list[BaseException]) -> str:
    """First line of the most specific message in the chain, cut to a readable length."""
    for error in reversed(chain):
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        if lines:
            text = f"{type(error).__name__}: {lines[0]}"
            return text if len(text) <= 300 else text[:297] + "..."
    return type(chain[-1]).__name__


def _is_data_dependent(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, GuardOnDataDependentSymNode) or "data-dependent" in text or "data dependent" in text


def _is_unknown_output_type(error: BaseException) -> bool:
    text = str(error)
    return "which is not a known type" in text or ("pytree" in text and "output" in text)


def _is_unsupported_op(error: BaseException) -> bool:
    if isinstance(error, NotImplementedError):
        return True
    text = str(error).lower()
    markers = ("not supported", "could not run", "unsupported operator", "no fake", "meta tensor", "does not support")
    return any(marker in text for marker in markers)
