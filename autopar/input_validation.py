"""The checks at the API's edge: what `plan`, `compile` and `compare` accept, read once and checked here, so that
the planning behind them sees settings in one form and a user's mistake is a `ConfigError` that says what was
expected, what was found and what to do.

The solvers check the pinned values against the model and the cluster (a tp that does not divide the heads);
this module checks their kinds (a count is a positive integer) and what the call itself must hold together
(a preset needs a batch size and a sequence length, a plan handed to `compile` must be for its cluster and model).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from autopar.cluster import ClusterSpec, load_cluster, parse_bytes
from autopar.constraints import Constraints
from autopar.context_parallel.inputs import check_cp_inputs
from autopar.cost_model import AnalyticEstimator, DType, ProfiledEstimator
from autopar.errors import ConfigError
from autopar.guard_options import check_guard_options
from autopar.passes.context_parallel import CPSpec
from autopar.passes.fused_ops import FUSION_KINDS, default_fusion, fusion_kinds
from autopar.plan import Plan

PRECISIONS = ("bf16", "fp16", "fp32")


def check_constraints(constraints) -> Constraints:
    """`constraints` (None, a dict or a Constraints) as the frozen `Constraints` every layer behind the edge reads,
    after checking the keys and the kinds of their values (the solvers check the values against the model and the
    cluster); ConfigError says which key holds what."""
    return Constraints.of(constraints)


def check_precision(precision) -> None:
    """`precision` is None or one of `PRECISIONS`; ConfigError otherwise."""
    if precision is not None and precision not in PRECISIONS:
        raise ConfigError(
            f"precision={precision!r}: expected one of {', '.join(PRECISIONS)} (or None: bf16 on GPUs, fp32 on CPUs)"
        )


def as_cluster(cluster) -> ClusterSpec:
    """A ClusterSpec, a cluster string ("8xA100-80GB") or the path of a cluster file (.yaml, .yml, .json)."""
    if isinstance(cluster, (ClusterSpec, str, Path)):
        return load_cluster(cluster)
    raise ConfigError(
        f"cluster must be a ClusterSpec, a string like '8xA100-80GB' or a cluster file path, got "
        f"{type(cluster).__name__}"
    )


def default_precision(cluster: ClusterSpec) -> str:
    """The precision of a plan that names none: bf16 on GPUs, fp32 on CPUs."""
    return "bf16" if cluster.device.kind == "gpu" else "fp32"


def resolve_model(model, precision, example_inputs, example_kwargs, global_batch_size, seq_len):
    """(module, args, kwargs, name) from a preset name, a config.json path, or a module with inputs."""
    if isinstance(model, str):
        from autopar import presets  # transformers: imported when a preset is planned, not for `autopar --help`

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


def batch_size(args, kwargs) -> int:
    """The batch dimension of the example inputs: the first dimension of their first tensor that has one."""
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0:
            return int(leaf.shape[0])
    raise ConfigError("the example inputs hold no tensor with a batch dimension")


def resolve_estimator(kind, cluster: ClusterSpec, precision: str):
    """The compute estimator `plan(estimator=...)` names: "analytic" (None), "profile", or an estimator object."""
    if kind in (None, "analytic"):
        return AnalyticEstimator(cluster.device, DType(precision))
    if kind == "profile":
        return ProfiledEstimator()
    if hasattr(kind, "forward_time_s"):
        return kind
    raise ConfigError(f"estimator {kind!r}: expected 'analytic', 'profile' or a ComputeEstimator")


def count_tokens(args, kwargs) -> int:
    """Tokens per step: the size of the first integer input (input ids), else the batch size."""
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and not leaf.dtype.is_floating_point and leaf.ndim >= 1:
            return int(leaf.numel())
    return batch_size(args, kwargs)


def check_cp(constraints: dict, cluster: ClusterSpec, args, kwargs) -> int:
    """The pinned cp degree (1: none), after checking that the batch and the other settings allow it."""
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


def check_given_plan(plan, cluster: ClusterSpec, model: torch.nn.Module) -> None:
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


def check_offload(offload) -> None:
    """`offload` is None (the solver decides), True or False; ConfigError otherwise."""
    if offload not in (None, True, False):
        raise ConfigError(f"offload={offload!r}: expected None (the solver decides), True or False")


def check_compile_inputs(model, optimizer) -> None:
    """`compile` runs an nn.Module with an optimizer factory (or the default); ConfigError otherwise."""
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


def check_batch_of_plan(plan: Plan, args, kwargs) -> None:
    """The example batch `compile` runs is the one `plan` was made for: its rows and its tokens."""
    batch = batch_size(args, kwargs)
    if batch != plan.global_batch_size:
        raise ConfigError(
            f"the plan is for a global batch of {plan.global_batch_size} but the example inputs hold "
            f"{batch}; plan with the batch you will train on"
        )
    if count_tokens(args, kwargs) != plan.tokens_per_step:
        raise ConfigError(
            f"the plan is for {plan.tokens_per_step:,} tokens per step but the example inputs hold "
            f"{count_tokens(args, kwargs):,} (another sequence length); plan with the batch you will train "
            f"on"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class PlanRequest:
    """One planning call's inputs, checked: the model as it is traced, its batch, and the settings every layout
    the call prices shares (`read_plan_request` makes one from `plan`'s arguments)."""

    model: object  # what the caller named: an nn.Module, or a preset name (traced shortened where it can be)
    module: torch.nn.Module
    args: tuple
    kwargs: dict
    name: str
    cluster: ClusterSpec
    constraints: Constraints
    cp: int  # the pinned cp degree (1: none)
    precision: str
    estimator: object
    budget: float | None
    offload: bool | None
    pipeline: bool | None
    fuse: bool
    compare: tuple | list  # layouts to price next to the plan (`rationale.parse_layout`)
    alternatives: bool | None
    say: Callable[[str], None]
    t0: float  # when planning started: the plan's total planning time counts from here
    max_grad_norm: float | None = None  # the program clips to it: the step guard's passes are priced
    # the kinds of fusion that run where `fuse` is on (`passes.fused_ops.FUSION_KINDS`): all of them unless the
    # caller named some (a program that runs its attention fused and its norms and loss as eager ops)
    fuse_kinds: tuple[str, ...] = FUSION_KINDS


def read_plan_request(
    model,
    cluster,
    example_inputs=(),
    example_kwargs=None,
    *,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    constraints: dict | Constraints | None = None,
    memory_budget=None,
    offload: bool | None = None,
    precision: str | None = None,
    estimator=None,
    progress: Callable[[str], None] | None = None,
    pipeline: bool | None = None,
    fuse_kernels=None,
    compare=(),
    alternatives: bool | None = None,
    max_grad_norm: float | None = None,
) -> PlanRequest:
    """`autopar.plan`'s arguments (see there) checked and resolved: the cluster, the constraints, the precision
    (its default by device), the memory budget in bytes, the model and its batch (a preset built on the meta
    device), the pinned cp degree, the fusion default and the estimator. ConfigError says what is wrong."""
    cluster = as_cluster(cluster)
    constraints = check_constraints(constraints)
    check_precision(precision)
    check_offload(offload)
    check_guard_options(max_grad_norm, "raise")
    precision = precision or default_precision(cluster)
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    say = progress or _quiet
    t0 = time.perf_counter()
    kinds = FUSION_KINDS if fuse_kernels is None else fusion_kinds(fuse_kernels)
    module, args, kwargs, name = resolve_model(
        model, precision, example_inputs, example_kwargs, global_batch_size, seq_len
    )
    return PlanRequest(
        model=model,
        module=module,
        args=args,
        kwargs=kwargs,
        name=name,
        cluster=cluster,
        constraints=constraints,
        cp=check_cp(constraints, cluster, args, kwargs),
        precision=precision,
        estimator=resolve_estimator(estimator, cluster, precision),
        budget=budget,
        offload=offload,
        pipeline=pipeline,
        fuse=default_fusion(cluster.device.kind) if fuse_kernels is None else bool(kinds),
        compare=compare or (),
        alternatives=alternatives,
        say=say,
        t0=t0,
        max_grad_norm=max_grad_norm,
        fuse_kinds=kinds or FUSION_KINDS,
    )


def _quiet(msg: str) -> None:
    """The progress callback of a call that asked for none."""
