"""Kernel fusion: replace attention, normalisation and LM-head loss subgraphs by autopar's Triton ops.

`fuse_kernels_pass` rewrites the ATen training graph of `torch.export.export(..., strict=False)`
(what `autopar.trace.trace_model` returns) so that the ops below become one call each to the
custom ops of `autopar.triton_kernels`:

- attention: `aten.scaled_dot_product_attention` and the eager pattern of Hugging Face models
  (`matmul(q, kᵀ)`, scalar scale, `+ mask`, `softmax(-1)`, casts, dropout with p = 0,
  `matmul(·, v)`) become `autopar::flash_attention`;
- normalisation: the decomposed RMSNorm of Hugging Face LLaMA (`pow 2`, `mean(-1)`, `+ eps`,
  `rsqrt`, `mul`, casts, `mul weight`) and `aten.rms_norm` become `autopar::rms_norm`;
  `aten.layer_norm` and `aten.native_layer_norm` become `autopar::layer_norm`;
- loss: an LM-head `aten.linear` without bias whose output reaches `aten.cross_entropy_loss` (or
  `log_softmax` then `nll_loss`) through views, row slices and casts becomes
  `autopar::linear_cross_entropy` (mean over the kept labels, the same `ignore_index`).

Terms. A *site* is one occurrence of a pattern. A site is *expressible* when the fused op computes
the same function: no dropout, and a mask that is either absent or *provably causal*. A mask is
provably causal when it is computed inside the graph from constants only (no placeholder among
its ancestors, no random op), so the pass evaluates it once and compares it with SDPA's top-left
causal mask `ones(sq, sk).tril()`, broadcast: a boolean mask must equal it, an additive float mask
must be 0 where it is true and at most half the dtype's lowest value (or -inf) elsewhere. A mask
that is everywhere "keep" counts as no mask. Hugging Face builds its causal mask this way when no
`attention_mask` is passed; a padding mask depends on an input and is not provable, and such sites
are left alone. The mask is evaluated with real tensors on the CPU even when the graph was traced on
the meta device (its values do not depend on the device). Tensors of the mask's computation larger
than `fusion_masks.MAX_MASK_ELEMENTS` (a `batch x 1 x seq x seq` mask at planning sizes) are evaluated block by
block (query rows; one batch row per group of rows that read equal inputs), which works when they
are elementwise ops or broadcasts over smaller ones; other large masks are left alone.

`fuse_traced` applies the pass to a `TracedModel` (what `autopar.plan` and `autopar.compile` do when
fusion is on, `default_fusion`): the plan prices and names the fused graph, and the runtimes run it.

Input: an exported ATen graph with `node.meta["val"]` on every node. Output: the same graph
module, rewritten in place, every new node with `val`, `tensor_meta`, `nn_module_stack` and
`stack_trace` copied from the node it replaces (so layer detection and the cost model see it),
nodes left dead by the rewrite removed (with the `_assert_tensor_metadata` checks on them), and
`gm.meta[FUSED_META_KEY]` a `FusionReport`: the sites fused and the sites skipped with the reason.
Node names of replaced ops change; the graph's inputs and the positions of its outputs do not.

The loss op computes its gradients during the forward (see `autopar.triton_kernels.cross_entropy`)
and is emitted asking for both, since the graph cannot know whether it will run under `no_grad`.
When the model also returns the logits (Hugging Face models do), the head matmul stays for that
output; the fused loss still saves the logits-sized activations of the eager loss's backward.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, TensorArgument
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError, ConfigError
from autopar.passes.fusion_masks import CASTS, IDENTITIES, MaskValue, Skip, classify_mask
from autopar.trace import TracedModel

aten = torch.ops.aten

FUSED_META_KEY = "autopar_fused"  # gm.meta key of the FusionReport
FUSED_OPS = ("flash_attention", "rms_norm", "layer_norm", "linear_cross_entropy")
_COPIED_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn", "from_node")
_ASSERT = aten._assert_tensor_metadata.default
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


@dataclass(frozen=True, slots=True)
class FusedSite:
    """One replacement: the fused op and the graph node whose value it now computes."""

    op: str
    node: str


@dataclass(frozen=True, slots=True)
class SkippedSite:
    """A site that matched a pattern but was left alone, and why."""

    kind: str  # "attention", "norm" or "cross_entropy"
    node: str
    reason: str


@dataclass(frozen=True, slots=True)
class FusionReport:
    """What `fuse_kernels_pass` did to one graph."""

    fused: tuple[FusedSite, ...] = ()
    skipped: tuple[SkippedSite, ...] = ()

    @property
    def counts(self) -> dict[str, int]:
        """Number of replacements per fused op name (every op of `FUSED_OPS` present, zero if none)."""
        found = Counter(site.op for site in self.fused)
        return {op: found[op] for op in FUSED_OPS}


def default_fusion(device_kind: str) -> bool:
    """Whether kernel fusion is on by default for a device kind.

    Args:
        device_kind: a `DeviceSpec.kind` ("gpu", "cpu") or a torch device type ("cuda", "cuda:1").

    On by default on CUDA devices, where the kernels are compiled; off on CPU, where they only run
    in the Triton interpreter, orders of magnitude slower than ATen.
    """
    kind = device_kind.lower().partition(":")[0]
    if kind in ("gpu", "cuda"):
        return True
    if kind == "cpu":
        return False
    raise ConfigError(f"default_fusion: unknown device kind {device_kind!r}; expected 'gpu', 'cuda' or 'cpu'")


# the kinds of fusion `fuse_kernels_pass` has a switch for, by the switch's name
FUSION_KINDS = ("attention", "norms", "cross_entropy")


def fusion_kinds(setting) -> tuple[str, ...]:
    """The kinds of fusion a `fuse_kernels` setting asks for, in `FUSION_KINDS` order: True all, False none, or a
    kind's name or a collection of them (a program that runs some fused kernels and the rest as eager ops)."""
    if isinstance(setting, bool):
        return FUSION_KINDS if setting else ()
    names = (setting,) if isinstance(setting, str) else setting
    try:
        wanted = {str(n) for n in names}
    except TypeError:
        raise ConfigError(
            f"fuse_kernels: expected True, False or some of {list(FUSION_KINDS)}, got {setting!r}"
        ) from None
    unknown = sorted(wanted - set(FUSION_KINDS))
    if unknown:
        raise ConfigError(f"fuse_kernels: unknown kinds {unknown}; expected some of {list(FUSION_KINDS)}")
    return tuple(k for k in FUSION_KINDS if k in wanted)


def fusion_knobs(kinds) -> dict[str, bool]:
    """`fuse_kernels_pass`'s switches for `kinds` (a collection of `FUSION_KINDS`)."""
    return {k: k in kinds for k in FUSION_KINDS}


def fusion_setting(fusion: dict):
    """The `fuse_kernels` setting that plans again as a plan's `fusion` record says: False, True (every kind), or the
    kinds it fused where it fused only some."""
    if not fusion.get("enabled", False):
        return False
    kinds = fusion.get("kinds")
    return True if kinds is None else tuple(kinds)


def fuse_kernels_pass(
    gm: fx.GraphModule, example_inputs, *, attention: bool = True, norms: bool = True, cross_entropy: bool = True
) -> fx.GraphModule:
    """Replace attention, norms and the LM-head loss by autopar's Triton ops (see the module docstring).

    Args:
        gm: an exported ATen training graph module (nodes carry `meta["val"]`); rewritten in place.
        example_inputs: unused; shapes come from the nodes' meta values.
        attention: fuse SDPA and eager attention into `autopar::flash_attention`.
        norms: fuse RMSNorm and LayerNorm into `autopar::rms_norm` / `autopar::layer_norm`.
        cross_entropy: fuse the LM head and its cross-entropy into `autopar::linear_cross_entropy`.

    Returns:
        `gm`, with `gm.meta[FUSED_META_KEY]` set to the `FusionReport`.
    """
    del example_inputs
    import autopar.triton_kernels  # noqa: F401  (registers the autopar:: ops)

    fuser = _Fuser(gm.graph)
    if attention:
        fuser.fuse_attention()
    if norms:
        fuser.fuse_norms()
    if cross_entropy:
        fuser.fuse_cross_entropy()
    fuser.remove_dead()
    gm.meta[FUSED_META_KEY] = FusionReport(tuple(fuser.fused), tuple(fuser.skipped))
    gm.graph.lint()
    gm.recompile()
    return gm


def fuse_traced(traced: TracedModel, **knobs) -> TracedModel:
    """`fuse_kernels_pass` applied to a traced model: what planning and the runtimes run when fusion is on.

    Args:
        traced: from `autopar.trace.trace_model`. Its graph module is rewritten in place; the returned model
            shares it, with an exported program whose output specs name the new output nodes. A graph that
            was fused already is not fused again (only its output specs are brought up to date).
        knobs: `attention=`, `norms=`, `cross_entropy=` of `fuse_kernels_pass`.

    Returns:
        A TracedModel of the fused graph; `fusion_report(result)` says what was fused.
    """
    gm = traced.graph_module
    if FUSED_META_KEY not in gm.meta:
        fuse_kernels_pass(gm, None, **knobs)
    ep = traced.exported
    out = next(n for n in gm.graph.nodes if n.op == "output")
    specs = []
    for spec, value in zip(ep.graph_signature.output_specs, pytree.tree_leaves(out.args[0]), strict=True):
        if isinstance(spec.arg, TensorArgument) and isinstance(value, fx.Node) and value.name != spec.arg.name:
            spec = dataclasses.replace(spec, arg=TensorArgument(name=value.name))
        specs.append(spec)
    if specs == list(ep.graph_signature.output_specs):
        return traced
    signature = ExportGraphSignature(input_specs=list(ep.graph_signature.input_specs), output_specs=specs)
    exported = ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=ep.state_dict,
        range_constraints=ep.range_constraints,
        module_call_graph=ep.module_call_graph,
        example_inputs=ep.example_inputs,
        constants=ep.constants,
        verifiers=ep.verifiers,
    )
    return dataclasses.replace(traced, exported=exported)


def fusion_report(traced: TracedModel) -> FusionReport | None:
    """The FusionReport of a traced model's graph, None when the fusion pass did not run on it."""
    return traced.graph_module.meta.get(FUSED_META_KEY)


def fusion_summary(
    enabled: bool, report: FusionReport | None, layer_count: dict | None = None, kinds=FUSION_KINDS
) -> dict:
    """What a plan records of fusion: on or off, fused ops per kind, and the skipped sites with their reasons.

    Args:
        enabled: whether the fusion pass ran.
        report: its report (None when it did not run).
        layer_count: node name -> how many nodes of the whole model it stands for (`OpGraph.layer_count`; a
            trace of a few identical layers stands for all of them), so counts are the whole model's.
        kinds: the kinds of fusion the pass ran; recorded (as "kinds") only where they are not all of them.
    """
    counts = dict.fromkeys(FUSED_OPS, 0)
    skipped: list[dict] = []
    if report is not None:
        times = layer_count or {}
        for site in report.fused:
            counts[site.op] += times.get(site.node, 1)
        skipped = [{"kind": s.kind, "node": s.node, "reason": s.reason} for s in report.skipped]
    summary = {"enabled": bool(enabled), "counts": counts, "skipped": skipped}
    if enabled and tuple(kinds) != FUSION_KINDS:
        summary["kinds"] = list(kinds)
    return summary


def emit_fused_loss_sum(graph: fx.Graph, loss: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """For a loss computed by `autopar::linear_cross_entropy` (through casts): nodes of its sum and kept-label count.

    The sum is `mean * count`, 0 where no label is kept (the mean is 0 / 0 there and its gradient must not
    turn NaN), so that sums and counts over ranks or micro-batches give the exact mean. None for any other loss.
    """
    mean = loss
    while mean.op == "call_function" and mean.target in CASTS:
        mean = mean.args[0]
    call = mean.args[0] if mean.target is operator.getitem and mean.args[1] == 0 else None
    if not isinstance(call, fx.Node) or str(call.target) != "autopar.linear_cross_entropy.default":
        return None
    labels, ignore_index = call.args[2], call.args[3]
    with graph.inserting_after(loss):
        kept = graph.call_function(aten.ne.Scalar, (labels, ignore_index))
    with graph.inserting_after(kept):
        count = graph.call_function(aten.sum.default, (kept,))
    with graph.inserting_after(count):
        some = graph.call_function(aten.gt.Scalar, (count, 0))
    with graph.inserting_after(some):
        safe = graph.call_function(aten.where.ScalarOther, (some, loss, 0.0))
    with graph.inserting_after(safe):
        total = graph.call_function(aten.mul.Tensor, (safe, count))
    return total, count


class _Fuser:
    """Finds the sites of one graph, emits the fused calls and records what it did."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.fused: list[FusedSite] = []
        self.skipped: list[SkippedSite] = []
        self._mask_kinds: dict[tuple[fx.Node, int, int], str | Skip] = {}
        self._replaced: set[fx.Node] = set()  # removable when dead even if tagged random (SDPA with p = 0)

    # ------------------------------------------------------------------------------- attention

    def fuse_attention(self) -> None:
        for node in self._calls(aten.scaled_dot_product_attention.default):
            self._try("attention", node, self._fuse_sdpa)
        for node in self._calls(aten.softmax.int, aten._softmax.default):
            self._try("attention", node, self._fuse_eager_attention)

    def _fuse_sdpa(self, node: fx.Node) -> None:
        a = _bind(node)
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        if a["dropout_p"]:
            raise Skip(f"dropout_p={a['dropout_p']}: the flash kernel has no dropout")
        heads_q, heads_kv = _val(q).shape[-3], _val(k).shape[-3]
        if heads_q != heads_kv and not a["enable_gqa"]:
            raise Skip(f"{heads_q} query heads against {heads_kv} key heads without enable_gqa")
        causal = bool(a["is_causal"])
        if mask is not None:
            causal = self._mask_kind(mask, _val(q).shape[-2], _val(k).shape[-2]) == "causal"
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(_val(q).shape[-1])
        self._emit_attention(node, q, k, v, causal, float(scale))

    def _fuse_eager_attention(self, softmax: fx.Node) -> None:
        if not _is_softmax_last_dim(softmax):
            return
        scores, mask = _split_mask(softmax.args[0])
        qk, scale, scaling = _strip_scale(scores)
        k = _key_of(qk)
        pv = _probabilities_consumer(softmax) if k is not None else None
        if pv is None:
            return  # not the pattern: some other softmax
        between = [softmax, *([softmax.args[0]] if mask is not None else []), *scaling, qk]
        if any(len(_real_users(n)) != 1 for n in between):
            raise Skip("the attention scores or probabilities have other users (output_attentions?)")
        q, v = qk.args[0], pv.args[1]
        causal = False
        if mask is not None:
            causal = self._mask_kind(mask, _val(q).shape[-2], _val(k).shape[-2]) == "causal"
        self._emit_attention(pv, q, k, v, causal, scale)

    def _emit_attention(self, anchor: fx.Node, q, k, v, causal: bool, scale: float) -> None:
        if any(_val(t).dim() != 4 for t in (q, k, v)):
            raise Skip("q, k, v are not 4-D (batch, heads, seq, head_dim)")
        with self.graph.inserting_before(anchor):
            call = self._emit(anchor, torch.ops.autopar.flash_attention.default, (q, k, v, causal, scale))
            out = self._emit(anchor, operator.getitem, (call, 0))
        self._replace(anchor, out, "flash_attention")

    def _mask_kind(self, mask: fx.Node, seq_q: int, seq_k: int) -> str:
        """'none' or 'causal'; raises Skip for a mask the kernel cannot express or that is not provable."""
        key = (mask, seq_q, seq_k)
        if key not in self._mask_kinds:
            try:
                self._mask_kinds[key] = classify_mask(MaskValue(self.graph, mask), seq_q, seq_k)
            except Skip as e:
                self._mask_kinds[key] = e
        found = self._mask_kinds[key]
        if isinstance(found, Skip):
            raise Skip(f"attention mask {mask.name!r}: {found}")
        return found

    # ----------------------------------------------------------------------------------- norms

    def fuse_norms(self) -> None:
        for node in self._calls(aten.mean.dim):
            self._try("norm", node, self._fuse_decomposed_rms_norm)
        for node in self._calls(aten.rms_norm.default):
            self._try("norm", node, self._fuse_aten_rms_norm)
        for node in self._calls(aten.layer_norm.default, aten.native_layer_norm.default):
            self._try("norm", node, self._fuse_layer_norm)

    def _fuse_decomposed_rms_norm(self, mean: fx.Node) -> None:
        match = _match_rms_norm(mean)
        if match is None:
            return
        x, weight, eps, out = match
        self._emit_norm(out, torch.ops.autopar.rms_norm.default, (x, weight, eps), "rms_norm")

    def _fuse_aten_rms_norm(self, node: fx.Node) -> None:
        a = _bind(node)
        x, weight = a["input"], a["weight"]
        _check_last_dim_norm(a["normalized_shape"], weight)
        eps = a["eps"] if a["eps"] is not None else torch.finfo(_val(x).dtype).eps
        self._emit_norm(node, torch.ops.autopar.rms_norm.default, (x, weight, float(eps)), "rms_norm")

    def _fuse_layer_norm(self, node: fx.Node) -> None:
        a = _bind(node)
        _check_last_dim_norm(a["normalized_shape"], a["weight"])
        anchor = node
        if node.target == aten.native_layer_norm.default:
            outputs = [u for u in node.users if u.target == operator.getitem and (u.args[1] == 0 or u.users)]
            if len(outputs) != 1 or outputs[0].args[1] != 0 or len(node.users) > 3:
                raise Skip("the mean or rstd of native_layer_norm is used (the kernel's have another shape)")
            anchor = outputs[0]
        args = (a["input"], a["weight"], a["bias"], float(a["eps"]))
        self._emit_norm(anchor, torch.ops.autopar.layer_norm.default, args, "layer_norm")

    def _emit_norm(self, anchor: fx.Node, op, args: tuple, name: str) -> None:
        with self.graph.inserting_before(anchor):
            out = self._emit(anchor, operator.getitem, (self._emit(anchor, op, args), 0))
        self._replace(anchor, out, name)

    # --------------------------------------------------------------------------- cross-entropy

    def fuse_cross_entropy(self) -> None:
        losses = (aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default)
        for node in self._calls(*losses):
            self._try("cross_entropy", node, self._fuse_linear_cross_entropy)

    def _fuse_linear_cross_entropy(self, loss: fx.Node) -> None:
        a = _bind(loss)
        logits, labels = a["self"], a["target"]
        chain, head, log_probs = _logits_chain(logits)
        if head is None or (loss.target != aten.cross_entropy_loss.default and not log_probs):
            return  # not an LM head's loss (a cross-entropy of log-probabilities equals that of the logits)
        if a["weight"] is not None or a["reduction"] != 1 or a.get("label_smoothing", 0.0):
            raise Skip("only the unweighted mean loss without label smoothing is fused")
        if _val(logits).dim() != 2:
            raise Skip(f"logits of shape {tuple(_val(logits).shape)}: the class dim must be the last of a 2-D input")
        hidden, weight, bias = (_bind(head)[name] for name in ("input", "weight", "bias"))
        if bias is not None:
            raise Skip("the LM head has a bias")
        with self.graph.inserting_before(loss):
            rows = self._replay_on_hidden(loss, chain, hidden)
            args = (rows, weight, labels, int(a["ignore_index"]), 0, True, True)
            fused = self._emit(loss, torch.ops.autopar.linear_cross_entropy.default, args)
            out = self._emit(loss, operator.getitem, (fused, 0))
            if _val(out).dtype != _val(loss).dtype:
                out = self._emit(loss, aten.to.dtype, (out, _val(loss).dtype))
        self._replace(loss, out, "linear_cross_entropy")

    def _replay_on_hidden(self, anchor: fx.Node, chain: list[fx.Node], hidden: fx.Node) -> fx.Node:
        """Apply the logits' row views and slices to the hidden states (last dim hidden_dim instead of vocab)."""
        for node in chain:
            if node.target in _RESHAPES:
                shape = [*_val(node).shape[:-1], _val(hidden).shape[-1]]
                hidden = self._emit(anchor, aten.reshape.default, (hidden, shape))
            elif node.target == aten.slice.Tensor:
                hidden = self._emit(anchor, node.target, (hidden, *node.args[1:]))
        return hidden

    # ---------------------------------------------------------------------------------- common

    def _calls(self, *targets) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "call_function" and n.target in targets and n.users]

    def _try(self, kind: str, node: fx.Node, fuse) -> None:
        try:
            fuse(node)
        except Skip as e:
            self.skipped.append(SkippedSite(kind, node.name, str(e)))

    def _emit(self, anchor: fx.Node, target, args: tuple) -> fx.Node:
        """A call of `target` at the insertion point, with its fake value and `anchor`'s provenance."""
        try:
            val = _fake_call(target, args)
        except AutoparError as e:  # the kernels' own shape, dtype and head-dim checks
            raise Skip(str(e)) from None
        node = self.graph.call_function(target, args)
        node.meta.update({key: anchor.meta[key] for key in _COPIED_META if key in anchor.meta})
        node.meta["val"] = val
        if isinstance(val, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(val)
        return node

    def _replace(self, old: fx.Node, new: fx.Node, op: str) -> None:
        old.replace_all_uses_with(new)
        self._replaced.add(old)
        self.fused.append(FusedSite(op, new.name))

    def remove_dead(self) -> None:
        """Erase nodes without users and the metadata asserts on them; random ops stay unless replaced or p = 0."""
        for node in reversed(list(self.graph.nodes)):
            if node.op != "call_function" or node.target == _ASSERT or _real_users(node):
                continue
            if node.is_impure() and node not in self._replaced and not _is_identity_dropout(node):
                continue
            for user in list(node.users):
                self.graph.erase_node(user)
            self.graph.erase_node(node)


# ----------------------------------------------------------------------------------- matching


def _bind(node: fx.Node) -> dict:
    """Arguments of an OpOverload call by schema name, defaults filled in."""
    bound = {}
    positional = iter(node.args)
    for arg in node.target._schema.arguments:
        value = next(positional, _MISSING) if not arg.kwarg_only else _MISSING
        if value is _MISSING:
            value = node.kwargs.get(arg.name, arg.default_value if arg.has_default_value() else None)
        bound[arg.name] = value
    return bound


_MISSING = object()


def _val(node):
    return node.meta["val"] if isinstance(node, fx.Node) else node


def _real_users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target != _ASSERT]


def _only_user(node: fx.Node) -> fx.Node | None:
    users = _real_users(node)
    return users[0] if len(users) == 1 else None


def _is_identity_dropout(node: fx.Node) -> bool:
    if node.target != aten.dropout.default:
        return False
    a = _bind(node)
    return a["p"] == 0 or not a["train"]


def _is_softmax_last_dim(node: fx.Node) -> bool:
    ndim = _val(node).dim()
    if node.target == aten._softmax.default and node.args[2]:
        return False  # half_to_float changes the output dtype; not what eager attention emits
    return ndim == 4 and node.args[1] in (-1, ndim - 1)


def _split_mask(x: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """(scores, mask) of `scores + mask`, or (x, None) when no mask is added."""
    if x.target != aten.add.Tensor or len(x.args) != 2 or x.kwargs.get("alpha", 1) != 1:
        return x, None
    a, b = x.args
    if isinstance(b, fx.Node) and _key_of(_strip_scale(a)[0]) is not None:
        return a, b
    if isinstance(a, fx.Node) and isinstance(b, fx.Node) and _key_of(_strip_scale(b)[0]) is not None:
        return b, a
    return x, None


def _strip_scale(x: fx.Node) -> tuple[fx.Node, float, list[fx.Node]]:
    """Walk up multiplications and divisions by python numbers: (the node above them, their scale, the walked nodes)."""
    scale, walked = 1.0, []
    muls, divs = (aten.mul.Tensor, aten.mul.Scalar), (aten.div.Tensor, aten.div.Scalar)
    while isinstance(x, fx.Node) and x.target in muls + divs and not x.kwargs:
        a, b = x.args[:2]
        if isinstance(a, fx.Node) and isinstance(b, (int, float)):
            scale, source = (scale * b if x.target in muls else scale / b), a
        elif isinstance(b, fx.Node) and isinstance(a, (int, float)) and x.target in muls:
            scale, source = scale * a, b
        else:
            break
        walked.append(x)
        x = source
    return x, scale, walked


def _key_of(qk: fx.Node) -> fx.Node | None:
    """k of `matmul(q, k.transpose(-2, -1))` on 4-D tensors, else None."""
    if not isinstance(qk, fx.Node) or qk.target != aten.matmul.default or _val(qk).dim() != 4:
        return None
    kt = qk.args[1]
    if not isinstance(kt, fx.Node) or kt.target != aten.transpose.int:
        return None
    dims = {d % 4 for d in kt.args[1:3]}
    return kt.args[0] if dims == {2, 3} else None


def _probabilities_consumer(softmax: fx.Node) -> fx.Node | None:
    """The `matmul(probabilities, v)` reached from the softmax through casts and identity dropouts."""
    p = softmax
    while (user := _only_user(p)) is not None:
        if user.target == aten.matmul.default and user.args[0] is p:
            return user
        if user.target == aten.dropout.default and not _is_identity_dropout(user):
            raise Skip(f"attention dropout p={_bind(user)['p']}: the flash kernel has no dropout")
        if user.target not in CASTS | IDENTITIES and user.target != aten.dropout.default:
            return None
        p = user
    return None


def _match_rms_norm(mean: fx.Node) -> tuple[fx.Node, fx.Node, float, fx.Node] | None:
    """(x, weight, eps, output node) of `weight * cast(x * rsqrt(mean(x**2, -1, keepdim) + eps))`, else None."""
    a = _bind(mean)
    squared, ndim = a["self"], _val(mean).dim()
    if list(a["dim"] or ()) not in ([-1], [ndim - 1]) or not a["keepdim"] or a["dtype"] is not None:
        return None
    if squared.target == aten.pow.Tensor_Scalar and squared.args[1] == 2:
        xf = squared.args[0]
    elif squared.target == aten.mul.Tensor and squared.args[0] is squared.args[1]:
        xf = squared.args[0]
    else:
        return None
    add, eps = _only_user(mean), None
    if add is not None and add.target in (aten.add.Tensor, aten.add.Scalar) and add.args[0] is mean:
        eps = add.args[1] if isinstance(add.args[1], (int, float)) and not add.kwargs else None
    rsqrt = _only_user(add) if eps is not None else None
    normed = _only_user(rsqrt) if rsqrt is not None and rsqrt.target == aten.rsqrt.default else None
    if normed is None or normed.target != aten.mul.Tensor or set(normed.args) != {xf, rsqrt}:
        return None
    cast = _only_user(normed)
    last = cast if cast is not None and cast.target in CASTS else normed
    scaled = _only_user(last)
    if scaled is None or scaled.target != aten.mul.Tensor or len(_real_users(squared)) != 1:
        return None
    weight = next((w for w in scaled.args if w is not last), None)
    if not isinstance(weight, fx.Node) or tuple(_val(weight).shape) != (_val(xf).shape[-1],):
        return None
    return _rms_norm_input(xf, weight, scaled), weight, float(eps), scaled


def _rms_norm_input(xf: fx.Node, weight: fx.Node, out: fx.Node) -> fx.Node:
    """The normalised tensor, before or after its cast to fp32, whichever has the weight's and the output's dtype."""
    candidates = [xf] + ([xf.args[0]] if xf.target in CASTS and isinstance(xf.args[0], fx.Node) else [])
    want = _val(weight).dtype
    for x in candidates:
        if _val(x).dtype == want == _val(out).dtype:
            return x
    raise Skip(f"input {_val(xf).dtype}, weight {want} and output {_val(out).dtype}: the kernel takes one dtype")


def _check_last_dim_norm(normalized_shape, weight) -> None:
    if len(normalized_shape) != 1:
        raise Skip(f"normalises over the last {len(normalized_shape)} dims; the kernel normalises over the last one")
    if weight is None:
        raise Skip("no weight (elementwise_affine=False); the kernel needs one")


def _logits_chain(logits: fx.Node) -> tuple[list[fx.Node], fx.Node | None, bool]:
    """From the loss's input up to a linear head: (the row views, slices and casts in between, in order; the head;
    whether a log_softmax over the classes is among them), or ([], None, False)."""
    chain, x, log_probs = [], logits, False
    while isinstance(x, fx.Node) and x.op == "call_function":
        if x.target == aten.linear.default:
            return chain[::-1], x, log_probs
        source = x.args[0]
        if not isinstance(source, fx.Node) or not _keeps_classes_last(x, source):
            break
        if x.target in (aten.log_softmax.int, aten._log_softmax.default):
            log_probs = True
        elif x.target not in _RESHAPES | CASTS | IDENTITIES | {aten.slice.Tensor}:
            break
        chain.append(x)
        x = source
    return [], None, False


def _keeps_classes_last(node: fx.Node, source: fx.Node) -> bool:
    """Whether `node` maps `source`'s rows to rows and leaves its last (class) dim alone."""
    last = _val(source).dim() - 1
    if node.target in _RESHAPES:
        return _val(node).shape[-1] == _val(source).shape[-1]
    if node.target == aten.slice.Tensor:
        return (node.args[1] if len(node.args) > 1 else 0) % (last + 1) != last
    if node.target in (aten.log_softmax.int, aten._log_softmax.default):
        return node.args[1] % (last + 1) == last
    return True


# ------------------------------------------------------------------------------------ fake values


def _fake_call(target, args: tuple):
    """Run `target` on the fake values of the node arguments: the new node's `meta["val"]`."""
    vals = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], args)
    mode = detect_fake_mode(pytree.tree_leaves(vals))
    if mode is None:  # a graph whose values are real tensors: do not run the kernels on them
        mode = FakeTensorMode()
        vals = pytree.tree_map_only(torch.Tensor, mode.from_tensor, vals)
    with mode:
        return target(*vals)
