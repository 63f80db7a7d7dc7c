"""The public entry points: `plan` (price and choose a layout) and `compile` (build the parallel program)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import time
import warnings
from collections.abc import Callable

import torch

from autopar.cluster import ClusterSpec
from autopar.cp_search import cp_degrees, search_cp
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.ir import OpGraph
from autopar.plan import Plan, Predicted, ProgramKind
from autopar.trace import trace_model

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_CONSTRAINT_KEYS = {
    "tp",
    "dp",
    "zero",
    "num_microbatches",
    "micro_batch_size",
    "pp",
    "schedule",
    "virtual_stages",
    "recompute",
    "tp_min_split",
    "param_placements",
    "grad_reduce",
    "overlap",
    "prefetch_depth",
    "cp",
    "cp_attention",
}
_RECOMPUTE_MODES = ("none", "selective", "full")
_PRECISIONS = ("bf16", "fp16", "fp32")
# constraints that pin a count: a positive integer (zero: a stage, 0 to 3); None leaves it to the solver
_COUNT_KEYS = ("tp", "dp", "pp", "cp", "num_microbatches", "micro_batch_size", "virtual_stages")


def check_constraints(constraints) -> dict:
    """`constraints` as a dict after checking the keys and the kinds of their values (the solvers check the
    values against the model and the cluster); ConfigError says which key holds what."""
    if constraints is None:
        return {}
    if not isinstance(constraints, dict):
        raise ConfigError(
            f"constraints must be a dict such as {{'tp': 2, 'zero': 1}}, got {type(constraints).__name__}"
        )
    unknown = set(constraints) - _CONSTRAINT_KEYS
    if unknown:
        raise ConfigError(f"unknown constraints {sorted(map(str, unknown))}: supported are {sorted(_CONSTRAINT_KEYS)}")
    for key in _COUNT_KEYS:
        v = constraints.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(
                f"constraints[{key!r}]={v!r}: expected a positive integer (or None to let the planner choose)"
            )
    zero = constraints.get("zero")
    if zero is not None and (isinstance(zero, bool) or zero not in (0, 1, 2, 3)):
        raise ConfigError(f"constraints['zero']={zero!r}: expected 0, 1, 2 or 3")
    if constraints.get("recompute", "none") not in _RECOMPUTE_MODES:
        raise ConfigError(
            f"constraints['recompute']={constraints['recompute']!r}: expected one of {', '.join(_RECOMPUTE_MODES)}"
        )
    if "overlap" in constraints and not isinstance(constraints["overlap"], bool):
        raise ConfigError(f"constraints['overlap']={constraints['overlap']!r}: expected True or False")
    depth = constraints.get("prefetch_depth")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise ConfigError(
            f"constraints['prefetch_depth']={depth!r}: expected a count of layers, 0 (gather each "
            f"parameter when it is used) or more"
        )
    for key in ("grad_reduce", "schedule", "cp_attention"):
        v = constraints.get(key)
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"constraints[{key!r}]={v!r}: expected a name (a string)")
    split = constraints.get("tp_min_split")
    if split is not None and (isinstance(split, bool) or not isinstance(split, (int, float))):
        raise ConfigError(f"constraints['tp_min_split']={split!r}: expected a fraction between 0 and 1")
    return dict(constraints)


def check_precision(precision) -> None:
    if precision is not None and precision not in _PRECISIONS:
        raise ConfigError(
            f"precision={precision!r}: expected one of {', '.join(_PRECISIONS)} (or None: bf16 on GPUs, fp32 on CPUs)"
        )


def parse_bytes(value) -> float:
    """`20e9`, "20GB" (10^9) or "20GiB" (2^30) -> bytes."""
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    m = _SIZE.match(str(value))
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"memory size {value!r} not understood: give bytes or a string like '20GB' or '16GiB'")
    return float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()]


def _as_cluster(cluster) -> ClusterSpec:
    """A ClusterSpec, a cluster string ("8xA100-80GB") or the path of a cluster file (.yaml, .yml, .json)."""
    from pathlib import Path

    from autopar.cluster import load_cluster

    if isinstance(cluster, (ClusterSpec, str, Path)):
        return load_cluster(cluster)
    raise ConfigError(
        f"cluster must be a ClusterSpec, a string like '8xA100-80GB' or a cluster file path, got "
        f"{type(cluster).__name__}"
    )


def _default_precision(cluster: ClusterSpec) -> str:
    return "bf16" if cluster.device.kind == "gpu" else "fp32"


def _resolve_model(model, precision, example_inputs, example_kwargs, global_batch_size, seq_len):
    """(module, args, kwargs, name) from a preset name, a config.json path, or a module with inputs."""
    if isinstance(model, str):
        from autopar import presets

        if global_batch_size is None or seq_len is None:
            raise ConfigError(f"planning preset {model!r} needs global_batch_size= and seq_len=")
        config = presets.load_config(model)
        dtype = torch.bfloat16 if precision in ("bf16", "fp16") else torch.float32
        module = presets.build_model(config, device="meta", dtype=dtype)
        args, kwargs = presets.example_batch(config, global_batch_size, seq_len, device="meta")
        return module, args, kwargs, model
    if isinstance(model, torch.nn.Module):
        if not example_inputs and not example_kwargs:
            raise ConfigError("planning an nn.Module needs example_inputs= (and example_kwargs=): one global batch")
        return model, tuple(example_inputs), dict(example_kwargs or {}), type(model).__name__
    raise ConfigError(f"model must be an nn.Module, a preset name or a config.json path, got {type(model).__name__}")


def _batch_size(args, kwargs) -> int:
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0:
            return int(leaf.shape[0])
    raise ConfigError("the example inputs hold no tensor with a batch dimension")


def _estimator(kind, cluster: ClusterSpec, precision: str):
    from autopar.cost_model import AnalyticEstimator, DType

    if kind in (None, "analytic"):
        return AnalyticEstimator(cluster.device, DType(precision))
    if kind == "profile":
        from autopar.cost_model.profiler import ProfiledEstimator

        return ProfiledEstimator()
    if hasattr(kind, "forward_time_s"):
        return kind
    raise ConfigError(f"estimator {kind!r}: expected 'analytic', 'profile' or a ComputeEstimator")


# Layers of a preset traced when its layers are all alike: the trace stands for the whole depth
# (see OpGraph.edge_weight). Two is the fewest that show how one layer feeds the next.
_SHORT_TRACE_LAYERS = 2
# Model types whose layers are identical by construction (no per-layer kinds in their configs).
_UNIFORM_MODEL_TYPES = {"llama", "gpt2", "bert", "mistral", "mixtral", "qwen2", "opt", "gpt_neox", "gptj", "roberta"}


def _trace_shortened(module, args, kwargs, say, fuse: bool = False, cp: int = 1) -> OpGraph | None:
    """Trace a preset with two of its identical layers standing for all of them; None when that is not valid."""
    from autopar import presets

    config = getattr(module, "config", None)
    if config is None or config.model_type not in _UNIFORM_MODEL_TYPES:
        return None
    depth = int(getattr(config, "num_hidden_layers", 0) or 0)
    if depth <= _SHORT_TRACE_LAYERS:
        return None
    if any(isinstance(v, (list, tuple)) and len(v) == depth for v in config.to_dict().values()):
        return None  # a per-layer setting: layers may differ
    dtype = next(module.parameters()).dtype
    short_config = copy.deepcopy(config)
    short_config.num_hidden_layers = _SHORT_TRACE_LAYERS
    short = presets.build_model(short_config, device="meta", dtype=dtype)
    traced = _cp_graph(trace_model(short, args, kwargs), cp)
    if fuse:
        from autopar.passes.fused_ops import fuse_traced

        traced = fuse_traced(traced)
    probe = OpGraph.from_traced(traced)
    containers = {c for c, _ in probe.node_layer.values() if c is not None}
    if len(containers) != 1:
        return None
    try:
        graph = OpGraph.from_traced(traced, layer_repeats={containers.pop(): depth})
    except ValueError:
        return None
    say(f"traced {_SHORT_TRACE_LAYERS} of {depth} identical layers; each stands for {depth / _SHORT_TRACE_LAYERS:g}")
    return graph


def _expand_placements(graph: OpGraph, placements: dict) -> dict:
    """Parameter placements under every name of the model (a shortened trace names its first layers only)."""
    layer = {p.name: p.layer for p in graph.params.values()}
    out = {}
    for fqn, pl in placements.items():
        for name in graph.expand_param_name(fqn, layer.get(fqn, (None, None))):
            out[name] = pl
    return out


def _flops(
    graph: OpGraph, tokens: int, recompute: str = "none", layer_modes: dict | None = None, cp: int = 1
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step: 6 per parameter per token plus attention; all executed FLOPs.

    A mixture of experts' weights meet only the tokens routed to them: for those (`_routed_products`) the
    model FLOPs are their matmuls' own (the top-k of E experts per token), not 6 per parameter per token.

    Hardware FLOPs count the forward of every node the plan runs again (`recompute` in every layer, or
    each mode of `layer_modes` in its layers); model FLOPs do not. A graph traced for a cp plan holds each
    sequence as cp chunks whose attention nodes score (seq/cp)² pairs under a mask built from the chunk's
    shape: they count as the cp program runs them, over whole sequences and causal by global position
    (`passes.context_parallel.cp_attention_flops`), so model FLOPs do not depend on the layout.
    """
    from autopar.passes.activation_plan import model_layers
    from autopar.passes.recompute import recompute_segments, recomputed_nodes

    if layer_modes:  # layers are alike: a representative node counts for the share of layers recomputed
        again, scale = {}, model_layers(graph)[1]
        for mode in ("selective", "full"):
            n = len(recompute_segments(graph.graph, mode)) * scale
            if layer_modes.get(mode) and n:
                again |= {name: len(layer_modes[mode]) / n for name in recomputed_nodes(graph.graph, mode)}
    else:
        again = dict.fromkeys(recomputed_nodes(graph.graph, recompute), 1.0)
    attention = 0.0
    hardware = 0.0
    for node in graph.graph.nodes:
        times = graph.layer_count.get(node.name, 1)
        if node.op != "call_function" or not times:
            continue
        fwd, bwd = _node_flops(node, cp)
        hardware += times * (fwd + bwd + fwd * again.get(node.name, 0.0))
        if str(node.target) in _ATTENTION_TARGETS:
            attention += times * (fwd + bwd)
    routed_params, routed_flops = _routed_products(graph)
    dense = graph.num_parameters() - _lookup_only_parameters(graph) - routed_params
    return 6.0 * dense * tokens + attention + routed_flops, hardware


def _node_flops(node, cp: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of one node; an attention node of a cp graph over whole sequences."""
    from autopar.cost_model.compute import estimate_node_cost
    from autopar.passes.context_parallel import cp_attention_flops

    if cp > 1 and str(node.target) in _ATTENTION_TARGETS:
        return cp_attention_flops(node, cp)
    cost = estimate_node_cost(node)
    return cost.flops, cost.backward_flops


def _lookup_only_parameters(graph: OpGraph) -> int:
    """Trainable parameters read only by embedding lookups (an untied input embedding): they cost no
    multiply-adds, so the 6 FLOPs per parameter per token of model FLOPs leave them out (as PaLM's MFU
    does); a table the output layer also multiplies by (tied weights) stays in."""
    total = 0
    for name, info in graph.params.items():
        users = list(graph.node(name).users)
        if info.requires_grad and users and all(str(u.target) == "aten.embedding.default" for u in users):
            total += info.meta.numel * graph.layer_count[name]
    return total


_ROUTED_MATMULS = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default", "aten.bmm.default")
_WEIGHT_VIEWS = (
    "aten.transpose.int",
    "aten.permute.default",
    "aten.t.default",
    "aten.view.default",
    "aten._to_copy.default",
    "aten.to.dtype",
)


def _routed_products(graph: OpGraph) -> tuple[int, float]:
    """(trainable parameters of experts, forward and backward FLOPs of the matmuls that read them) in one step.

    An expert weight [E, ...] reaches its matmul through views and casts, and either whole (a grouped matmul
    of the tokens sorted by expert) or indexed by each (token, expert) pair (Hugging Face's "batched_mm":
    `w[expert_ids]` then a bmm): each token meets k of the E experts, so it costs what those matmuls do.
    """
    from autopar.cost_model.compute import estimate_node_cost

    params, flops, seen = 0, 0.0, set()
    for name, info in graph.params.items():
        ends = _routed_uses(graph.node(name))
        if not info.requires_grad or not ends:
            continue
        params += info.meta.numel * graph.layer_count[name]
        for end in ends - seen:
            cost = estimate_node_cost(end)
            flops += graph.layer_count.get(end.name, 1) * (cost.flops + cost.backward_flops)
        seen |= ends
    return params, flops


def _routed_uses(node, indexed: bool = False) -> set | None:
    """The routed matmuls every use of `node` ends in (see `_routed_products`), or None if one use is another op."""
    ends: set = set()
    for user in node.users:
        target = str(user.target)
        if target in _ROUTED_MATMULS and (indexed or target != "aten.bmm.default"):
            ends.add(user)
            continue
        if target == "aten.index.Tensor" and user.args[0] is node:
            found = _routed_uses(user, indexed=True)
        elif target in _WEIGHT_VIEWS:
            found = _routed_uses(user, indexed)
        else:
            return None
        if not found:
            return None
        ends |= found
    return ends or None


_ATTENTION_TARGETS = ("aten.scaled_dot_product_attention.default", "autopar.flash_attention.default")


def plan(
    model,
    cluster,
    example_inputs=(),
    example_kwargs=None,
    *,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    constraints: dict | None = None,
    memory_budget=None,
    offload: bool | None = None,
    precision: str | None = None,
    estimator=None,
    progress: Callable[[str], None] | None = None,
    pipeline: bool | None = None,
    fuse_kernels: bool | None = None,
    compare=(),
    alternatives: bool | None = None,
    max_grad_norm: float | None = None,
    _traced=None,
    _against: Plan | None = None,
) -> Plan:
    """Trace `model`, price every layout on `cluster`, and return the fastest plan that fits.

    Args:
        model: an nn.Module (real, fake or meta parameters), a preset name ("llama2-70b") or a config.json path.
        cluster: a ClusterSpec or its string form ("4x8xA100-80GB", "cpu:4").
        example_inputs, example_kwargs: one global batch for a module (shapes matter, values do not).
        global_batch_size, seq_len: the batch for a preset.
        constraints: pins: "tp", "dp" (axis sizes), "zero" (0-3), "num_microbatches" (gradient accumulation
            steps per data-parallel rank), "micro_batch_size" (samples per micro-batch per rank) or
            "recompute" (activation recompute: "none", "selective" for attention internals, "full" for
            whole layers), "tp_min_split" (the fraction of the layer matmul weights' elements a tensor axis
            must split: 1 by default, 0 lets it split nothing), "param_placements" (parameter name ->
            placement on the tensor axis, "R" or "S(dim)").
        memory_budget: per-device cap, bytes or "20GB"; defaults to the device memory.
        offload: None (default) lets the solver put optimizer states (fp32 master weights and moments) and
            gradients on the host where device memory requires it; False keeps every state on the device;
            True puts all of them on the host (ZeRO-Offload). Pipeline layouts keep states on the device.
        precision: "bf16"/"fp16" (mixed precision AdamW) or "fp32"; default bf16 on GPUs, fp32 on CPUs.
        estimator: "analytic" (roofline, default), "profile" (time ops on this machine), or an estimator object.
        progress: callable told about each step of planning.
        pipeline: search pipeline layouts (stage cuts, sub-meshes, schedules). Default: on GPU clusters of
            more than one node, where links between nodes make pipelines pay; always when "pp" > 1 is
            pinned; never when "pp": 1 is.
        fuse_kernels: replace attention, norms and the LM-head loss by autopar's Triton ops before planning
            (`passes.fused_ops`), so the plan prices and names the fused graph. Default: on for GPU clusters,
            off on CPUs (where the kernels only run interpreted).
        compare: layouts to price next to the plan, for the report's "Your layout" section: strings like
            "tp=8,pp=4,zero=1" or constraint dicts (`autopar.compare` adds them to a plan afterwards).
        alternatives: price the layouts a user would pick by hand (DDP, ZeRO-3, the best Megatron-style
            tp x pp point, the search's runner-up) for the report's "Why this plan". Default: on, except for
            the plans `compile` makes for itself (`_traced` given).
        max_grad_norm: the global gradient norm the program will clip to (`compile`'s, which a plan given to it
            brings): priced as its passes over the gradients (`autopar.cost_model.step_guard`).
        _traced: the TracedModel of `model` when the caller has one already (compile does); its graph is
            fused in place when fusion is on.
        _against: a plan made before (`autopar.compare`): no search, the `compare` layouts are priced next to
            it, and it is never replaced by one of them.
    """
    cluster = _as_cluster(cluster)
    constraints = check_constraints(constraints)
    check_precision(precision)
    from autopar.runtime.step_guard import check_guard_options

    check_guard_options(max_grad_norm, "raise")
    if offload not in (None, True, False):
        raise ConfigError(f"offload={offload!r}: expected None (the solver decides), True or False")
    precision = precision or _default_precision(cluster)
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    module, args, kwargs, name = _resolve_model(
        model, precision, example_inputs, example_kwargs, global_batch_size, seq_len
    )
    cp = _check_cp(constraints, cluster, args, kwargs)
    from autopar.passes.fused_ops import default_fusion

    fuse = default_fusion(cluster.device.kind) if fuse_kernels is None else bool(fuse_kernels)
    settings = _Settings(
        name, cluster, _estimator(estimator, cluster, precision), precision, budget, offload, pipeline, fuse, t0, say
    )
    settings = dataclasses.replace(settings, clip=max_grad_norm is not None)
    degrees = cp_degrees(constraints, cluster.world_size, args, kwargs) if _traced is None and _against is None else []
    jobs = _Jobs(settings, module, model, args, kwargs, traced=_traced, traced_cp=cp)
    if len(degrees) > 1:
        chosen, runner_up, job = search_cp(functools.partial(_plan_at, jobs, constraints), degrees)
    else:
        chosen, runner_up, job = _plan_at(jobs, constraints, cp, against=_against)
    if alternatives is None:
        alternatives = _traced is None  # compile's own planning builds a program, never a report
    if alternatives or compare:
        from autopar.rationale import PINNED, with_rationale

        t_alt = time.perf_counter()
        chosen = with_rationale(
            chosen,
            runner_up,
            functools.partial(_price_layout, jobs),
            say=say,
            baselines=alternatives,
            compare=compare or (),
            adopt=not constraints and _against is None,
            kept=PLANNED_BEFORE if _against is not None else PINNED,
        )
        chosen = dataclasses.replace(
            chosen,
            stats=chosen.stats
            | {
                "alternatives_time_s": round(time.perf_counter() - t_alt, 3),
                "total_time_s": round(time.perf_counter() - t0, 3),
            },
        )
    config = getattr(module, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    stats = chosen.stats | ({"hidden_size": int(hidden)} if isinstance(hidden, int) else {})
    stats["total_time_s"] = round(time.perf_counter() - t0, 3)  # a searched plan may have been priced first
    return dataclasses.replace(
        chosen, stats=stats, assumptions=_assumptions(settings.est, cluster, budget), max_grad_norm=max_grad_norm
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Settings:
    """What every cp degree a `plan` call prices shares: the model's name, the cluster and the planning knobs."""

    name: str
    cluster: ClusterSpec
    est: object
    precision: str
    budget: float | None
    offload: bool | None
    pipeline: bool | None
    fuse: bool
    t0: float
    say: Callable[[str], None]
    clip: bool = False  # max_grad_norm given: the step guard's clipping pass is priced


class _Jobs:
    """The jobs of one `plan` call, one per cp degree (1: none), each traced the first time a degree is priced: by
    the cp search, and again by the layouts priced next to the plan (a user's "tp=2,cp=4", the hand layouts
    without cp), so that each layout is solved on the graph its degree runs."""

    def __init__(self, st: _Settings, module, model, args, kwargs, *, traced=None, traced_cp: int = 1):
        self.st, self.module, self.model, self.args, self.kwargs = st, module, model, args, kwargs
        self._traced = {traced_cp: traced} if traced is not None else {}
        self._jobs: dict[int, _Job] = {}

    def __call__(self, cp: int) -> _Job:
        if cp not in self._jobs:
            self._jobs[cp] = self._trace(cp)
        return self._jobs[cp]

    def _trace(self, cp: int) -> _Job:
        from autopar.passes.fused_ops import fuse_traced, fusion_report, fusion_summary

        st, module, args, kwargs = self.st, self.module, self.args, self.kwargs
        if cp > 1:  # traced on the cp ranks' shares stacked on the batch (`context_parallel.inputs`)
            args, kwargs = _cp_traced_batch(module, args, kwargs, cp)
        t_start = time.perf_counter()
        st.say(f"tracing {st.name}" + (f" for cp={cp}" if cp > 1 else ""))
        traced, graph = self._traced.get(cp), None
        if traced is None and isinstance(self.model, str):
            graph = _trace_shortened(module, args, kwargs, st.say, st.fuse, cp)
        if graph is None:
            traced = traced if traced is not None else _trace_in_format(module, args, kwargs, st.precision, cp)
            traced = fuse_traced(traced) if st.fuse else traced
            frozen = frozenset(n for n, p in module.named_parameters() if not p.requires_grad)
            graph = OpGraph.from_traced(traced, frozen_params=frozen)
        t_trace = time.perf_counter() - t_start
        fusion = fusion_summary(st.fuse, fusion_report(graph.traced), graph.layer_count)
        st.say(
            f"traced {len(graph.graph.nodes)} nodes, {graph.num_layers} layers ({graph.deduplicated_layers} "
            f"deduplicated)"
        )
        return _Job(
            graph,
            st.name,
            st.cluster,
            st.est,
            st.precision,
            st.budget,
            st.offload,
            st.pipeline,
            _batch_size(args, kwargs),
            args,
            kwargs,
            fusion,
            st.t0,
            t_trace,
            st.say,
            cp=cp,
            clip=st.clip,
        )


def _plan_at(jobs: _Jobs, constraints: dict, cp: int, *, against: Plan | None = None):
    """(plan, runner-up, job) of the model traced for cp degree `cp` (1: none) and solved under `constraints`;
    with `against` (a plan made before, `autopar.compare`), that plan and no search."""
    job = jobs(cp)
    if against is not None:
        return against, None, job
    chosen, runner_up = _solve(job, constraints | ({"cp": cp} if cp > 1 else {}))
    return chosen, runner_up, job


def _price_layout(jobs: _Jobs, pins: dict) -> Plan:
    """A layout priced next to the plan (`rationale.with_rationale`): solved on the job of its cp degree, none
    where it pins none (the hand layouts are without cp); a cp it cannot run is the autopar error that says why."""
    st = jobs.st
    cp = _check_cp(pins, st.cluster, jobs.args, jobs.kwargs)
    return _solve(jobs(cp), pins | ({"cp": cp} if cp > 1 else {}), quiet=True)[0]


# why a layout `compare` prices faster than the plan did not replace it (`rationale.loss_reason`)
PLANNED_BEFORE = "which was planned before this layout was priced"


@dataclasses.dataclass(frozen=True, slots=True)
class _Job:
    """What one `plan` call solves on: the traced graph and the settings every layout it prices shares."""

    graph: OpGraph
    name: str
    cluster: ClusterSpec
    est: object
    precision: str
    budget: float | None
    offload: bool | None
    pipeline: bool | None
    batch: int
    args: tuple
    kwargs: dict
    fusion: dict
    t0: float
    t_trace: float
    say: Callable[[str], None]
    # the pipeline search's stage programs, kept for the layouts priced after the search (`search_pipeline`'s
    # `pricers`): a layout the search priced is read back, not solved again
    pricers: dict = dataclasses.field(default_factory=dict)
    cp: int = 1  # the pinned cp degree: `batch` counts cp rows per sequence, the data axis dp·cp ranks
    clip: bool = False  # the step guard clips (`cost_model.step_guard`)


def _solve(job: _Job, constraints: dict, *, quiet: bool = False):
    """The fastest plan under `constraints`, and the search's runner-up: a Plan, constraints to price, or None.

    `quiet` (pricing alternatives) keeps the warnings about ignored settings to the user's own plan.
    """
    from autopar.passes.sharding_solver import solve_sharding

    graph, cluster, est, precision, batch, budget = (
        job.graph,
        job.cluster,
        job.est,
        job.precision,
        job.batch,
        job.budget,
    )
    say = (lambda msg: None) if quiet else job.say
    if _searches_pipeline(job.pipeline, cluster, constraints):
        from autopar.passes.pipeline_search import search_pipeline

        psol = search_pipeline(
            graph,
            cluster,
            estimator=est,
            precision=precision,
            constraints=constraints,
            memory_budget_bytes=budget,
            batch_size=batch,
            progress=say,
            pricers=job.pricers,
        )
        if job.offload and not quiet:
            warnings.warn("offload=True: pipeline layouts keep every state on the device", stacklevel=3)
        if psol.pp > 1:
            pplan = _pipeline_plan(
                psol,
                graph,
                job.name,
                cluster,
                precision,
                batch,
                job.args,
                job.kwargs,
                job.t0,
                job.t_trace,
                est,
                cp=job.cp,
                clip=job.clip,
            )
            pplan = dataclasses.replace(
                pplan,
                fusion=job.fusion,
                grad_reduce=constraints.get("grad_reduce") or "fp32",
                overlap=bool(constraints.get("overlap", True)),
                prefetch_depth=_prefetch_depth(constraints),
            )
            return pplan, _pipeline_runner_up(job, psol, pplan)
        sol = psol.single_stage
    else:
        ignored = sorted(k for k in ("schedule", "virtual_stages") if constraints.get(k) is not None)
        if ignored and not quiet:
            warnings.warn(
                f"constraints {ignored} apply to pipeline layouts, and this plan searches none (pp=1); "
                f"pin pp > 1 or pass pipeline=True to search one",
                stacklevel=3,
            )
        flat = {k: v for k, v in constraints.items() if k not in _PIPELINE_KEYS}
        sol = solve_sharding(
            graph,
            cluster,
            estimator=est,
            precision=precision,
            constraints=flat,
            memory_budget_bytes=budget,
            batch_size=batch,
            progress=say,
            offload=job.offload,
        )
    overlap = bool(constraints.get("overlap", True))
    chosen = dataclasses.replace(
        _sharded_plan(job, sol),
        grad_reduce=constraints.get("grad_reduce") or "fp32",
        overlap=overlap,
        prefetch_depth=_prefetch_depth(constraints),
    )
    if (
        "overlap" not in constraints
        and overlap
        and chosen.program in (ProgramKind.SHARDED, ProgramKind.OFFLOAD)
        and chosen.zero_stage >= 1
    ):
        # the overlapping program holds more than the synchronous one (ZeRO-1: whole fp32 gradients,
        # `ShardingProgram.overlap_grad_bytes`; ZeRO-2/3: the gradient buckets in flight, `in_flight_grad_bytes`;
        # from ZeRO-1 the weights gathered ahead): where that memory costs more than the overlap hides (more
        # micro-batches, recompute, offload), the synchronous program is the faster plan. A plan that offloads runs
        # the offload program, which overlaps or not as its plan says, and is priced so.
        try:
            without = _solve(job, constraints | {"overlap": False}, quiet=True)
        except InfeasiblePlanError:
            without = None
        if without is not None and without[0].predicted.step_time_s < chosen.predicted.step_time_s:
            return without
    return chosen, _sharded_runner_up(sol)


def _prefetch_depth(constraints: dict) -> int:
    """The plan's prefetch depth: the pinned one, else 1 (0 where overlap is off: gathers stay on demand)."""
    depth = constraints.get("prefetch_depth")
    if depth is None:
        return 1 if constraints.get("overlap", True) else 0
    return int(depth)


def _sharded_runner_up(sol) -> dict | None:
    """The mesh that came closest to the chosen one (solved, or its bound when it could not win), as pins."""
    others = [r for r in sol.candidates if (r.dp, r.tp) != (sol.dp, sol.tp) and r.step_time_s < float("inf")]
    if not others:
        return None
    r = min(others, key=lambda r: (not r.feasible, r.step_time_s))
    cp = sol.cp.get("degree", 1)
    return {"pp": 1, "dp": r.dp // cp, "tp": r.tp} | ({"cp": cp} if cp > 1 else {})


def _pipeline_runner_up(job: _Job, psol, chosen: Plan):
    """The next fastest layout the pipeline search priced exactly (as pins), else the best plan without one."""
    layout = (
        chosen.mesh["pp"],
        chosen.mesh["dp"],
        chosen.mesh["tp"],
        chosen.num_microbatches,
        chosen.pipeline["schedule"],
        chosen.pipeline.get("virtual_stages", 1),
    )
    priced = [
        c
        for c in (_per_dp(c, job.cp) for c in psol.candidates)
        if c["step_time_s"] is not None
        and (c["pp"], c["dp"], c["tp"], c["num_microbatches"], c["schedule"], c["virtual_stages"]) != layout
    ]
    if priced:
        c = min(priced, key=lambda c: c["step_time_s"])
        return {
            "pp": c["pp"],
            "dp": c["dp"],
            "tp": c["tp"],
            "num_microbatches": c["num_microbatches"],
            "schedule": c["schedule"],
            "virtual_stages": c["virtual_stages"],
        } | ({"cp": job.cp} if job.cp > 1 else {})
    if psol.single_stage is not None:
        return _sharded_plan(job, psol.single_stage)
    return None


def _sharded_plan(job: _Job, sol) -> Plan:
    """The Plan of a layout without a pipeline (mesh dp x tp), from the sharding solver's solution."""
    from autopar.rationale import hidden_terms, sharded_terms

    graph, cluster, precision = job.graph, job.cluster, job.precision
    tokens = _tokens(job.args, job.kwargs)
    cp = job.cp
    model_flops, hw_flops = _flops(graph, tokens, sol.recompute, sol.layer_modes, cp=cp)
    peak = cluster.device.peak_matmul_flops(_dtype_of(precision))
    world = cluster.world_size
    guard = _step_guard_s(cluster, sol.memory, precision, job.clip)
    step = sol.step_time_s + guard
    offload_s = sol.offload.get("time_s", 0.0) + sol.activation_offload.get("time_s", 0.0)
    predicted = _predicted(
        step,
        model_flops,
        hw_flops,
        tokens,
        world,
        peak,
        sol.memory,
        compute_s=sol.compute_s,
        reshard_s=sol.reshard_s,
        grad_sync_s=sol.grad_sync_s,
        grad_sync_hidden_s=sol.grad_sync_hidden_s,
        offload_s=offload_s,
        optimizer_s=sol.optimizer_s + guard,
    )
    alternatives = tuple(
        {
            "dp": r.dp // cp,
            **({"cp": cp} if cp > 1 else {}),
            "tp": r.tp,
            "num_microbatches": r.num_microbatches,
            "feasible": r.feasible,
            "step_time_s": r.step_time_s if r.feasible else None,
            "compute_s": r.compute_s,
            "reshard_s": r.reshard_s,
            "grad_sync_s": r.grad_sync_s,
            "zero_stage": r.zero_stage,
            "recompute": r.recompute,
            "layer_modes": dict(r.layer_modes),
            "memory": r.memory,
            "solve_time_s": r.solve_time_s,
            "offload_fraction": r.offload.get("optimizer_fraction", 0.0),
            "reason": r.reason,
        }
        for r in sol.candidates
    )
    stats = _stats(graph, job.est, job.t0, job.t_trace, sol.solve_time_s, decision_groups=sol.num_groups)
    terms = sharded_terms(
        step_s=step,
        compute_s=sol.compute_s,
        recompute_s=sol.recompute_s,
        reshard_s=sol.reshard_s,
        grad_sync_s=sol.grad_sync_s,
        offload_s=offload_s,
        optimizer_s=sol.optimizer_s + guard,
        cp_comm_s=sol.cp_comm_s,
    )
    return Plan(
        model_name=job.name,
        cluster=cluster,
        mesh={"dp": sol.dp // cp, "cp": cp, "tp": sol.tp} if cp > 1 else {"dp": sol.dp, "tp": sol.tp},
        context_parallel=dict(sol.cp),
        zero_stage=sol.zero_stage,
        num_microbatches=sol.num_microbatches,
        recompute=sol.recompute,
        offload=dict(sol.offload),
        layer_modes=dict(sol.layer_modes),
        activation_offload=dict(sol.activation_offload),
        tensor_split=dict(sol.tensor_split),
        layer_ops=tuple(dict(e, stages=[]) for e in sol.layer_ops),
        precision=precision,
        global_batch_size=job.batch // cp,
        tokens_per_step=tokens,
        num_parameters=graph.num_parameters(),
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        predicted=predicted,
        param_placements=_expand_placements(graph, sol.param_placements),
        node_output=sol.node_output,
        node_inputs=sol.node_inputs,
        node_strategy=sol.node_strategy,
        alternatives=alternatives,
        unruled_ops=sol.unruled_ops,
        stats=stats,
        fusion=job.fusion,
        time_breakdown=terms,
        hidden_communication=hidden_terms(
            grad_sync_hidden_s=sol.grad_sync_hidden_s,
            cp_hidden_s=sol.cp_comm_hidden_s,
            tp_hidden_s=sol.reshard_hidden_s,
        ),
    )


def _assumptions(est, cluster: ClusterSpec, budget: float | None) -> dict:
    """What the predictions rest on besides the cluster's figures: the estimator (and its profile) and the budget."""
    import os

    out = {
        "estimator": "analytic" if type(est).__name__ == "AnalyticEstimator" else type(est).__name__,
        "memory_budget_bytes": float(budget if budget is not None else cluster.device.memory_bytes),
    }
    path = getattr(est, "cache_path", None)
    if path is not None:
        out["estimator"] = "profile"
        found = os.path.exists(path)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(os.path.getmtime(path))) if found else None
        out["profile"] = {
            "path": str(path),
            "device": getattr(est, "device", None),
            "written": stamp,
            "ranks_per_core": getattr(est, "ranks_per_core", 1.0),
            "in_step": list(getattr(est, "in_step", (1.0, 1.0))),
        }
    return out


_PIPELINE_KEYS = {"pp", "schedule", "virtual_stages"}


def _searches_pipeline(pipeline: bool | None, cluster: ClusterSpec, constraints: dict) -> bool:
    pp = constraints.get("pp")
    if pp is not None and pp != 1:
        return True
    if pp == 1:
        return False
    if pipeline is not None:
        return bool(pipeline)
    return cluster.device.kind == "gpu" and cluster.num_nodes > 1


def _pipeline_plan(
    psol, graph: OpGraph, name, cluster, precision, batch, args, kwargs, t0, t_trace, est, cp: int = 1, clip=False
) -> Plan:
    """The Plan of a pipeline layout: mesh pp x dp x tp (pp x dp x cp x tp with a cp axis: the search's data axis
    is dp·cp ranks and its batch cp rows per sequence), per-stage figures in `plan.pipeline`."""

    fullest = max(psol.stages, key=lambda st: sum(st.memory.values()))
    recompute = max(
        (st.sharding.recompute for st in psol.stages if st.sharding is not None),
        key=("none", "selective", "full").index,
        default="none",
    )
    tokens = _tokens(args, kwargs)
    model_flops, hw_flops = _flops(graph, tokens, recompute, cp=cp)
    peak = cluster.device.peak_matmul_flops(_dtype_of(precision))
    guard = max(_step_guard_s(cluster, st.memory, precision, clip) for st in psol.stages)
    world, step = cluster.world_size, psol.step_time_s + guard
    # the step ends with the stage whose exposed sync and optimizer step take longest
    tail = max(psol.stages, key=lambda st: st.grad_sync_exposed_s + st.optimizer_s)
    sync, opt = tail.grad_sync_exposed_s, tail.optimizer_s + guard
    # compute: the pipelined forward and backward, bubble and transfers included
    predicted = _predicted(
        step,
        model_flops,
        hw_flops,
        tokens,
        world,
        peak,
        fullest.memory,
        compute_s=step - sync - opt,
        reshard_s=0.0,
        grad_sync_s=sync,
        optimizer_s=opt,
        grad_sync_hidden_s=tail.grad_sync_hidden_s,
    )
    layer = {p.name: p.layer for p in graph.params.values()}
    placements = {}
    for st in psol.stages:
        if st.sharding is None:
            continue
        for fqn, pl in st.sharding.param_placements.items():
            container, idx = layer.get(fqn, (None, None))
            if container is not None and container in graph.repeats and idx == 0:
                rest = fqn[len(f"{container}.0.") :]
                for a, b in st.layers:
                    placements.update({f"{container}.{i}.{rest}": pl for i in range(a, b)})
            elif container is None:
                placements[fqn] = pl
    stages = [
        {
            "index": st.index,
            "layers": [list(r) for r in st.layers],
            "num_layers": st.num_layers,
            "dp": st.dp // cp,
            **({"cp": cp} if cp > 1 else {}),
            "tp": st.tp,
            "zero_stage": st.zero_stage,
            "recompute": st.sharding.recompute if st.sharding is not None else "none",
            "time_per_microbatch_s": st.time_per_microbatch_s,
            "transfer_per_microbatch_s": st.transfer_per_microbatch_s,
            "grad_sync_s": st.grad_sync_s,
            "activation_copies": st.activation_copies,
            # what the stage waits for of its transfers, and what its dp sync hides behind its own last
            # backward and the later ones
            "transfer_exposed_per_microbatch_s": st.transfer_exposed_per_microbatch_s,
            "grad_sync_hidden_s": st.grad_sync_hidden_s,
            "memory_bytes": sum(st.memory.values()),
            "memory": dict(st.memory),
            # the placements the stage was priced with (its layer nodes stand for every layer of the stage)
            "node_output": dict(st.sharding.node_output) if st.sharding is not None else {},
            "node_inputs": {k: list(v) for k, v in st.sharding.node_inputs.items()} if st.sharding is not None else {},
        }
        for st in psol.stages
    ]
    info = {
        "schedule": str(psol.schedule),
        "virtual_stages": psol.virtual_stages,
        "bubble_fraction": psol.bubble_fraction,
        "micro_batch_size": psol.micro_batch_size,
        "stages": stages,
        "step_time_without_pipeline_s": psol.single_stage_step_time_s,
        "priced": [_per_dp(c, cp) for c in psol.candidates],
    }
    stats = _stats(graph, est, t0, t_trace, psol.solve_time_s, stage_programs=psol.num_stage_programs)
    layer_ops = _stage_layer_ops(psol.stages)
    from autopar.rationale import hidden_terms, pipeline_terms

    slowest = max(psol.stages, key=lambda st: st.time_per_microbatch_s + st.transfer_exposed_per_microbatch_s)
    # the bottleneck stage's cp attention communication per micro-batch: exposed (in its t_s) and hidden
    cp_sol = slowest.sharding
    cp_s, cp_hidden = (
        (cp_sol.cp_comm_s / cp_sol.num_microbatches, cp_sol.cp_comm_hidden_s / cp_sol.num_microbatches)
        if cp_sol is not None
        else (0.0, 0.0)
    )
    # and its tensor-axis collectives launched early, hidden behind the ops before their use (per micro-batch)
    tp_hidden = cp_sol.reshard_hidden_s / cp_sol.num_microbatches if cp_sol is not None else 0.0
    terms = pipeline_terms(
        step_s=step,
        num_microbatches=psol.num_microbatches,
        stage_s=slowest.time_per_microbatch_s,
        transfer_s=slowest.transfer_exposed_per_microbatch_s,
        grad_sync_s=sync,
        optimizer_s=opt,
        cp_s=cp_s,
    )
    transfer_hidden = slowest.transfer_per_microbatch_s - slowest.transfer_exposed_per_microbatch_s
    hidden = hidden_terms(
        grad_sync_hidden_s=tail.grad_sync_hidden_s,
        transfer_hidden_s=psol.num_microbatches * transfer_hidden,
        cp_hidden_s=psol.num_microbatches * cp_hidden,
        tp_hidden_s=psol.num_microbatches * tp_hidden,
    )
    mesh = (
        {"pp": psol.pp, "dp": psol.dp // cp, "cp": cp, "tp": psol.tp}
        if cp > 1
        else {"pp": psol.pp, "dp": psol.dp, "tp": psol.tp}
    )
    # the stages price attention alike (one algorithm per sub-mesh): the first stage's record stands for all
    cp_info = dict(next(st.sharding for st in psol.stages if st.sharding is not None).cp) if cp > 1 else {}
    return Plan(
        model_name=name,
        cluster=cluster,
        mesh=mesh,
        context_parallel=cp_info,
        zero_stage=max(st.zero_stage for st in psol.stages),
        num_microbatches=psol.num_microbatches,
        recompute=recompute,
        precision=precision,
        global_batch_size=batch // cp,
        tokens_per_step=tokens,
        num_parameters=graph.num_parameters(),
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        predicted=predicted,
        param_placements=placements,
        node_output={},
        node_inputs={},
        node_strategy={},
        alternatives=(),
        unruled_ops=(),
        stats=stats,
        pipeline=info,
        time_breakdown=terms,
        hidden_communication=hidden,
        layer_ops=layer_ops,
    )


def _step_guard_s(cluster: ClusterSpec, memory: dict, precision: str, clip: bool) -> float:
    """The step guard's passes over a device's gradients and its all-reduce (`cost_model.step_guard`), added to every
    layout a plan prices, so the plan, its baselines and comparisons carry it alike. The gradients it reads are those
    of the masters the device's optimizer steps (fp32, one per element of its optimizer states on the device; not
    the whole gradients ZeRO-1 holds in the backward)."""
    from autopar.cost_model.step_guard import estimate_step_guard_time_s
    from autopar.passes.sharding_solver import Precision

    masters = memory.get("optimizer", 0.0) / Precision.get(precision).optimizer_bytes
    return estimate_step_guard_time_s(cluster, 4.0 * masters, clip=clip)


def _per_dp(candidate: dict, cp: int) -> dict:
    """A configuration the pipeline search priced, its data axis (dp·cp ranks) given as dp and cp."""
    if cp == 1:
        return dict(candidate)
    return dict(candidate, dp=candidate["dp"] // cp, cp=cp)


def _stage_layer_ops(stages) -> tuple[dict, ...]:
    """The stages' layer tables (`ShardingSolution.layer_ops`), one entry per distinct table with the stages
    that run it (stages holding as many layers on the same sub-mesh share one)."""
    out: list[dict] = []
    for st in stages:
        for entry in st.sharding.layer_ops if st.sharding is not None else ():
            same = next((e for e in out if e["layer"] == entry["layer"] and e["ops"] == entry["ops"]), None)
            if same is not None:
                same["stages"].append(st.index)
            else:
                out.append(dict(entry, stages=[st.index]))
    return tuple(out)


def _predicted(
    step: float, model_flops: float, hw_flops: float, tokens: int, world: int, peak: float, memory: dict, **times
) -> Predicted:
    """Per-step figures from the step time; `peak` is one device's matrix peak, `times` the step's parts."""
    return Predicted(
        step_time_s=step,
        tflops_per_device=model_flops / step / world / 1e12 if step else 0.0,
        mfu=model_flops / (step * world * peak) if step else 0.0,
        hardware_flops_utilization=hw_flops / (step * world * peak) if step else 0.0,
        peak_memory_bytes=sum(memory.values()),
        memory_breakdown=dict(memory),
        tokens_per_s=tokens / step if step else 0.0,
        **times,
    )


def _stats(graph: OpGraph, est, t0: float, t_trace: float, solve_time_s: float, **extra) -> dict:
    """How planning went: times, solver, graph size, layers."""
    from autopar.passes.sharding_solver import solver_name

    return {
        "trace_time_s": round(t_trace, 3),
        "solve_time_s": round(solve_time_s, 3),
        "total_time_s": round(time.perf_counter() - t0, 3),
        "solver": solver_name(),
        "graph_nodes": len(graph.graph.nodes),
        "traced_layers": {c: k for c, (k, _) in graph.repeats.items()},
        **extra,
        "layers": graph.num_layers,
        "deduplicated_layers": graph.deduplicated_layers,
        "estimator": type(est).__name__,
    }


def _trace_in_format(model, args, kwargs, precision: str, cp: int = 1):
    """The model traced as a plan of `precision` computes it (the one trace call of plan and compile): mixed
    precision in its compute format, "fp32" in the model's own dtype. For a cp degree above 1 (`args` the cp
    traced batch) without the model's causal masks (`passes.context_parallel.drop_causal_masks`)."""
    from autopar.runtime.base import compute_dtype

    return _cp_graph(trace_model(model, args, kwargs, compute_dtype=compute_dtype(precision)), cp)


def _cp_graph(traced, cp: int):
    """`traced` as a cp program runs it: without the causal masks its chunks would build (cp above 1)."""
    if cp <= 1:
        return traced
    from autopar.passes.context_parallel import drop_causal_masks

    return drop_causal_masks(traced)


def _dtype_of(precision: str):
    """The format peak FLOP/s are read for: the compute format, fp32 for "fp32"."""
    from autopar.runtime.base import compute_dtype

    return compute_dtype(precision) or torch.float32


def _tokens(args, kwargs) -> int:
    """Tokens per step: the size of the first integer input (input ids), else the batch size."""
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and not leaf.dtype.is_floating_point and leaf.ndim >= 1:
            return int(leaf.numel())
    return _batch_size(args, kwargs)


def _check_cp(constraints: dict, cluster: ClusterSpec, args, kwargs) -> int:
    """The pinned cp degree (1: none), after checking that the batch and the other settings allow it."""
    from autopar.context_parallel.inputs import check_cp_inputs
    from autopar.passes.context_parallel import CPSpec

    spec = CPSpec.from_constraints(constraints, cluster.world_size)
    if not spec.on:
        return 1
    check_cp_inputs(args, kwargs, spec.degree)
    pp = constraints.get("pp") or 1
    if cluster.world_size % (pp * spec.degree):
        raise ConfigError(
            f"constraints pp={pp} x cp={spec.degree} need a multiple of {pp * spec.degree} devices "
            f"(each pipeline stage holds whole cp groups), and the cluster has {cluster.world_size}; "
            f"lower pp or cp"
        )
    return spec.degree


def _cp_traced_batch(model, args, kwargs, cp: int):
    """The batch a cp plan traces `model` with (`context_parallel.inputs.traced_batch`)."""
    from autopar.context_parallel.inputs import is_causal_lm, traced_batch

    return traced_batch(args, kwargs, cp, causal_lm=is_causal_lm(model))


def compile(
    model: torch.nn.Module,
    cluster,
    example_inputs=(),
    example_kwargs=None,
    *,
    optimizer=None,
    plan: Plan | None = None,
    pretrained=None,
    **plan_kwargs,
):
    """Plan (unless `plan` is given) and build the parallel program; call inside torchrun.

    Every rank must call it with the same model (same initial parameters) and inputs. The world
    size of the process group must equal the cluster's. The model is traced once for planning (at the
    global batch) and at most once more, at the shape the program runs (`Program.trace_parts`), both in the
    plan's compute format. Without a cp pin, where the sequence allows a cp axis (`cp_search.cp_degrees`),
    the cp degree is searched as `plan` searches it: one planning trace per degree priced.

    Args:
        model: the single-device model with real parameters on the CPU.
        cluster: ClusterSpec or string; its world size must match the launch.
        example_inputs, example_kwargs: one global batch, as `train_step` will get it.
        optimizer: callable(params) -> torch.optim.Optimizer over the local shards (default AdamW, lr 1e-3).
        plan: a plan from `autopar.plan` / `Plan.from_json` to use instead of planning.
        pretrained: a folder of Hugging Face safetensors weights to start from; each rank reads only its slices
            (`Program.load_pretrained`). The model may then be built on the meta device: its buffers get values
            first (`autopar.checkpoint.hf.materialize_buffers`), its parameters are made by the program.
        plan_kwargs: passed to `autopar.plan` (constraints=, memory_budget=, max_grad_norm=, ...), but for the
            training loop's options (`autopar.loop`): on_nonfinite=, local_batch=, loss_fn=, loss_reduction=,
            loss_inputs=, loss_tokens=.
    """
    from autopar import runtime
    from autopar.loop import LoopOptions

    loop = LoopOptions.take(plan_kwargs, model)

    cluster = _as_cluster(cluster)
    if optimizer is not None and not callable(optimizer):
        raise ConfigError(
            f"optimizer must be a callable that takes the parameters and returns a torch.optim "
            f"optimizer (e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)), got "
            f"{type(optimizer).__name__}"
        )
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"compile needs the model as an nn.Module, got {type(model).__name__}; plan a preset "
            f"with autopar.plan and build the module from its config to run it"
        )
    if plan is not None:
        _check_given_plan(plan, cluster, model)
    runtime.ensure_process_group(cluster)
    model, example_kwargs = loop.traced(model, dict(example_kwargs or {}))
    built = model  # what the program is built from; `model` is what is planned and traced
    if pretrained is not None:
        from autopar.checkpoint import hf

        hf.materialize_buffers(model, pretrained)  # before tracing: lifted constants take the buffers' values
        if hf.is_meta(model):
            model = hf.traceable_stand_in(model)
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    planning_trace = None
    if plan is None:
        precision = plan_kwargs.get("precision") or _default_precision(cluster)
        constraints = dict(plan_kwargs.get("constraints") or {})
        cp = _check_cp(constraints, cluster, args, kwargs)
        if len(cp_degrees(constraints, cluster.world_size, args, kwargs)) > 1:
            # the cp degree is searched as `plan` searches it (one trace per degree); the program traces its own
            plan = _plan(model, cluster, args, kwargs, **({"alternatives": False} | plan_kwargs))
        else:
            planning_trace = _trace_in_format(
                model, *(_cp_traced_batch(model, args, kwargs, cp) if cp > 1 else (args, kwargs)), precision, cp
            )
            plan = _plan(model, cluster, args, kwargs, _traced=planning_trace, **plan_kwargs)
    batch = _batch_size(args, kwargs)
    if batch != plan.global_batch_size:
        raise ConfigError(
            f"the plan is for a global batch of {plan.global_batch_size} but the example inputs hold "
            f"{batch}; plan with the batch you will train on"
        )
    if _tokens(args, kwargs) != plan.tokens_per_step:
        raise ConfigError(
            f"the plan is for {plan.tokens_per_step:,} tokens per step but the example inputs hold "
            f"{_tokens(args, kwargs):,} (another sequence length); plan with the batch you will train "
            f"on"
        )
    program = runtime.program_class(plan)
    parts = program.trace_parts(plan)
    traced = None
    if parts is not None:
        part_args, part_kwargs = runtime.micro_batches(args, kwargs, plan.global_batch_size, parts)[0]
        traced = (
            planning_trace
            if parts == 1 and planning_trace is not None
            else _program_trace(model, plan, part_args, part_kwargs)
        )
        plan = _complete_placements(plan, model, cluster, traced, part_args, part_kwargs)
    tracer = _length_tracer(model, plan, traced)
    if pretrained is None:
        pm = program(model, plan, traced, cluster, optimizer=optimizer)
        pm.expect_inputs(args, kwargs, tracer=tracer)
        loop.apply(pm, plan)
        return pm
    if plan.program == "offload" and hf.is_meta(built):  # it copies the whole model: give it parameters to copy
        built = copy.deepcopy(built)
        hf.materialize_parameters(built)
    pm = program(built, plan, traced, cluster, optimizer=optimizer)
    pm.expect_inputs(args, kwargs, tracer=tracer)
    loop.apply(pm, plan)
    pm.load_pretrained(pretrained)
    return pm


def _check_given_plan(plan, cluster: ClusterSpec, model: torch.nn.Module) -> None:
    """A plan handed to `compile` is a Plan for this cluster's shape and this model's size; ConfigError otherwise."""
    if not isinstance(plan, Plan):
        raise ConfigError(
            f"plan= must be an autopar.Plan, got {type(plan).__name__}; read a plan file with "
            f"autopar.Plan.from_json(Path(path).read_text())"
        )
    ours, theirs = cluster, plan.cluster
    shape = (ours.num_nodes, ours.devices_per_node, ours.device.name, ours.device.kind)
    if shape != (theirs.num_nodes, theirs.devices_per_node, theirs.device.name, theirs.device.kind):
        raise ConfigError(
            f"the plan is for {theirs.describe()} but compile was given {ours.describe()}; plan again "
            f"for this cluster, or pass the plan's own cluster (plan.cluster)"
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable != plan.num_parameters:
        raise ConfigError(
            f"the plan is for a model ({plan.model_name}) of {plan.num_parameters:,} trainable "
            f"parameters but this model ({type(model).__name__}) has {trainable:,}; plan this "
            f"model, or pass the model the plan was made for"
        )


def _program_trace(model, plan: Plan, args, kwargs):
    """The model traced at the program's shape in the plan's compute format, fused when the plan fuses."""
    cp = plan.mesh.get("cp", 1)
    if cp > 1:
        args, kwargs = _cp_traced_batch(model, args, kwargs, cp)
    traced = _trace_in_format(model, args, kwargs, plan.precision, cp)
    if plan.fusion.get("enabled"):  # the program runs the graph the plan priced
        from autopar.passes.fused_ops import fuse_traced

        traced = fuse_traced(traced)
    return traced


def _length_tracer(model, plan: Plan, traced):
    """What a program traces the model with at a shorter sequence length (`autopar.runtime.shapes`): `_program_trace`
    over a copy of the model without its weights; None for a program that traces nothing."""
    if traced is None:
        return None
    from autopar.runtime.shapes import fake_copy

    return functools.partial(_program_trace, fake_copy(model), plan)


def _complete_placements(plan: Plan, model, cluster: ClusterSpec, traced, args, kwargs) -> Plan:
    """The plan with per-node placements for `traced`, the graph its program runs.

    The data-parallel and offload programs need none. A sharded plan names the nodes of the graph it was
    planned on; where the program's graph (traced at one micro-batch) has other nodes (a batch of one drops
    some expands), the placements are solved again on it with the plan's mesh, ZeRO stage and memory pinned:
    the same program, so the same predictions. A pipeline plan carries its stages' placements
    (`plan.stage_plans`); only where the graph's nodes differ (or a plan file predates them) are they solved
    again on one stage's (dp, tp) block for the micro-batch graph.
    """
    from autopar.plan import ProgramKind

    if plan.program not in (ProgramKind.SHARDED, ProgramKind.PIPELINE):
        return plan
    fused = bool(plan.fusion.get("enabled", False))
    names = {n.name for n in traced.exported.graph.nodes}
    stages = plan.stage_plans
    if stages and all(st.node_output and all(n in names for n in st.node_output) for st in stages):
        return plan  # the pipeline runs the placements its stages were priced with
    if plan.node_output and all(n in names for n in plan.node_output):
        return plan
    dp, tp = plan.mesh["dp"], plan.mesh["tp"]
    # the layout the plan priced: its axes, ZeRO stage, recompute and where every parameter sits on the tensor axis
    pins = {
        "dp": dp,
        "tp": tp,
        "zero": plan.zero_stage,
        "num_microbatches": 1,
        "recompute": plan.recompute,
        "param_placements": dict(plan.param_placements),
        "grad_reduce": plan.grad_reduce,
        "overlap": plan.overlap,
        "prefetch_depth": plan.prefetch_depth,
    }
    if plan.tensor_split:
        pins["tp_min_split"] = plan.tensor_split["min_fraction"]
    if plan.mesh.get("cp", 1) > 1:
        pins |= {"cp": plan.mesh["cp"], "cp_attention": plan.context_parallel["algorithm"]}
    if plan.program == ProgramKind.PIPELINE:
        block = cluster.sub_cluster(dp * plan.mesh.get("cp", 1) * tp)  # one stage's devices
        micro = _plan(
            model,
            block,
            args,
            kwargs,
            _traced=traced,
            constraints=pins | {"pp": 1},
            memory_budget=float("inf"),
            precision=plan.precision,
            offload=False,
            fuse_kernels=fused,
        )
    else:
        try:
            micro = _plan(
                model,
                cluster,
                args,
                kwargs,
                _traced=traced,
                constraints=pins,
                memory_budget=plan.predicted.peak_memory_bytes * 1.01,
                precision=plan.precision,
                fuse_kernels=fused,
            )
        except InfeasiblePlanError:
            micro = _plan(
                model,
                cluster,
                args,
                kwargs,
                _traced=traced,
                constraints=pins,
                precision=plan.precision,
                memory_budget=float("inf"),
                fuse_kernels=fused,
            )
    return dataclasses.replace(
        plan,
        node_output=micro.node_output,
        node_inputs=micro.node_inputs,
        node_strategy=micro.node_strategy,
        param_placements=micro.param_placements,
    )


_plan = plan  # `compile` and `compare` take a `plan=` argument that hides the function


def compare(plan: Plan, layouts, model=None, example_inputs=(), example_kwargs=None, **plan_kwargs) -> Plan:
    """`plan` with `layouts` priced next to it under the same cost model (the report's "Your layout").

    Args:
        plan: a plan from `autopar.plan` or `Plan.from_json`.
        layouts: strings like "tp=8,pp=4,zero=1" or constraint dicts; one that cannot run is listed
            with the reason, never dropped.
        model: the model the plan is for; default its preset name (`plan.model_name`). A plan of an
            nn.Module needs the module and `example_inputs` / `example_kwargs` (one global batch).
        plan_kwargs: other `autopar.plan` settings (estimator=, offload=, pipeline=) when the plan used some.
    """
    if isinstance(layouts, (str, dict)):
        layouts = [layouts]
    kw = {
        "precision": plan.precision,
        "fuse_kernels": bool(plan.fusion.get("enabled", False)),
        "memory_budget": plan.assumptions.get("memory_budget_bytes"),
        "max_grad_norm": plan.max_grad_norm,
    } | plan_kwargs
    if model is None or isinstance(model, str):
        kw |= {"global_batch_size": plan.global_batch_size, "seq_len": plan.tokens_per_step // plan.global_batch_size}
    # priced next to `plan` itself, so that each layout's one line says how it compares with this plan
    priced = _plan(
        model if model is not None else plan.model_name,
        plan.cluster,
        example_inputs,
        example_kwargs,
        alternatives=False,
        compare=list(layouts),
        _against=plan,
        **kw,
    )
    return dataclasses.replace(plan, comparisons=tuple(plan.comparisons) + tuple(priced.comparisons))


__all__ = ["plan", "compile", "compare", "parse_bytes"]
