"""A pinned expert axis (`constraints={"ep": N}`, `--ep N`): what it needs of the layout, checked; its price.

Experts split over ep groups carved from the data-parallel ranks (Megatron-Core's convention): ep must divide dp
and the number of experts. A model's experts are its modules named `experts` whose own weights all stack one
tensor per expert on dim 0 (Hugging Face's Mixtral, Qwen-MoE, ...); a shared expert (Qwen-MoE's
`shared_expert`) is not among them and keeps the dense layout.

What runs it is the expert-parallel program (`autopar.runtime.experts`): the data-parallel program with its
experts split. So a pinned ep pins the layout that program runs (tp 1, pp 1, ZeRO-0, no recompute: `layout_pins`),
and a pin that contradicts it is refused. The plan is solved as that data-parallel layout with the experts split
(`expert_split`: the solver holds each device to 1 / ep of the experts' weights, gradients and optimizer states, the
rest of the model whole, and prices the experts' gradient all-reduce over the dp / ep ranks holding the same
experts, on 1 / ep of the bytes), then priced with the axis's traffic (`with_expert_parallel`, from
`cost_model.experts`): the all-to-alls join the data axis's communication (they run over its ranks) and the step.
A free search weighs ep degrees the same way (`autopar.ep_search`).
"""

from __future__ import annotations

import dataclasses

import torch

from autopar.constraints import Constraints
from autopar.cost_model.experts import ExpertSplit, estimate_expert_parallel
from autopar.errors import ConfigError
from autopar.passes.sharding.precision import Precision
from autopar.plan import Plan, ProgramKind

# the layout the expert-parallel program runs: what a pinned ep pins besides
LAYOUT_PINS = {"tp": 1, "pp": 1, "cp": 1, "zero": 0, "recompute": "none"}
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclasses.dataclass(frozen=True, slots=True)
class MoeShape:
    """What the expert axis needs to know of a model: its experts and how tokens are routed to them."""

    num_experts: int
    top_k: int
    hidden_size: int
    modules: tuple[str, ...]  # the experts modules, one per MoE layer
    params: tuple[str, ...]  # their weights, each [num_experts, ...]
    num_expert_elements: int


def moe_shape(model: torch.nn.Module) -> MoeShape | None:
    """The model's experts (module docstring), or None when it has none."""
    config = getattr(model, "config", None)
    num = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(num, int) or not isinstance(top_k, int):
        return None
    modules, params, elements = [], [], 0
    for path, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if path.rsplit(".", 1)[-1] != "experts" or not own or any(p.ndim < 2 or p.shape[0] != num for _, p in own):
            continue
        modules.append(path)
        params.extend(f"{path}.{name}" for name, _ in own)
        elements += sum(p.numel() for _, p in own)
    if not modules:
        return None
    return MoeShape(num, top_k, int(config.hidden_size), tuple(modules), tuple(params), elements)


def layout_pins(constraints: Constraints) -> Constraints:
    """`constraints` with the layout a pinned ep runs on pinned too (`LAYOUT_PINS`); ConfigError on a contrary pin."""
    contrary = {k: constraints[k] for k, v in LAYOUT_PINS.items() if k in constraints and constraints[k] != v}
    if contrary:
        wanted = ", ".join(f"{k}={v!r}" for k, v in LAYOUT_PINS.items())
        raise ConfigError(
            f"constraints ep={constraints['ep']} with {contrary}: expert parallelism runs so far on the data-parallel "
            f"layout only ({wanted}); drop those pins or ep"
        )
    return constraints | {k: v for k, v in LAYOUT_PINS.items() if k not in constraints}


def check_ep(ep: int, model: torch.nn.Module, world_size: int, dp: int | None) -> MoeShape:
    """The model's experts, after checking that `ep` splits them and the data axis (`dp`: pinned, else the world)."""
    shape = moe_shape(model)
    if shape is None:
        raise ConfigError(
            f"constraints ep={ep}: the model has no mixture of experts (no `experts` module stacking "
            f"config.num_local_experts or config.num_experts weights on dim 0); drop ep"
        )
    data = dp if dp is not None else world_size
    if data % ep:
        raise ConfigError(
            f"constraints ep={ep} does not divide the data axis (dp={data}): the expert groups are carved from the "
            f"data-parallel ranks; pick ep among the divisors of {data}"
        )
    if shape.num_experts % ep:
        raise ConfigError(
            f"constraints ep={ep} does not divide the {shape.num_experts} experts of each layer: every rank of a "
            f"group holds as many; pick ep among the divisors of {shape.num_experts}"
        )
    return shape


def expert_split(shape: MoeShape, ep: int) -> ExpertSplit:
    """The solver's view of the axis: `shape`'s expert weights, split over `ep` ranks."""
    return ExpertSplit(ep, frozenset(shape.params))


def expert_state_bytes(plan: Plan, shape: MoeShape) -> float:
    """Bytes of the experts' weights, gradients and optimizer states a device would hold whole under `plan`'s
    precision at ZeRO-0 (the layout ep runs on): 1 / ep of them is what it holds with ep."""
    pr = Precision.get(plan.precision, plan.grad_reduce)
    return shape.num_expert_elements * (pr.param_bytes + pr.grad_bytes_at(0) + pr.optimizer_bytes)


# why a pinned (or searched) ep does not fit: what the memory it was checked against holds
EP_MEMORY_NOTE = (
    "with ep={ep}, the layout is the one the expert-parallel program runs: data parallelism with ZeRO-0 and no "
    "recompute, each device holding 1/{ep} of every MoE layer's experts with their gradients and optimizer states "
    "and the rest of the model whole; expert parallelism does not run with ZeRO, recompute, offload or a tensor or "
    "pipeline axis yet"
)


def ep_memory_advice(ep: int, num_experts: int):
    """What an ep layout that does not fit can do instead (`passes.sharding.report.infeasible_message`'s `advice`):
    not host offload or ZeRO, which the expert-parallel program does not run, but less memory per device within
    the layout, or a layout without ep where the search may use them."""

    def advice(parts: dict, budget: float) -> str:
        options = ["raise memory_budget"]
        if ep < num_experts:  # at ep = num_experts each rank already holds one expert
            options.append("use a larger ep where the devices allow one (each device then holds fewer experts)")
        options.append("plan without ep (drop the pin), where ZeRO, host offload and recompute are open to the search")
        remedies = ", ".join(options[:-1]) + ", or " + options[-1]
        if parts["states"] >= budget:  # no batch or sequence makes the states smaller
            return (
                f"the model states alone exceed the budget at ep={ep}, which a shorter sequence or a smaller batch "
                f"does not change: {remedies}"
            )
        return f"use a shorter sequence or a smaller batch, {remedies}"

    return advice


def with_expert_parallel(plan: Plan, shape: MoeShape, ep: int) -> Plan:
    """`plan` (the data-parallel layout, solved with `expert_split`) with an expert axis of `ep`, priced (module
    docstring): its all-to-alls added to the step and the data axis's communication."""
    if plan.program != ProgramKind.DATA_PARALLEL:
        raise ConfigError(
            f"constraints ep={ep}: the plan came out {plan.program} (mesh {plan.mesh}, ZeRO-{plan.zero_stage}, "
            f"layer modes {plan.layer_modes}); expert parallelism runs on the data-parallel program only so far: "
            f"give it more memory or drop ep"
        )
    dp, m = plan.mesh["dp"], plan.num_microbatches
    if dp % ep:  # the world when dp was not pinned: checked by `check_ep` against the mesh the solver chose
        raise ConfigError(f"constraints ep={ep} does not divide the plan's data axis (dp={dp})")
    cost = estimate_expert_parallel(
        ep=ep,
        tokens=plan.tokens_per_step // (dp * m),
        top_k=shape.top_k,
        hidden_size=shape.hidden_size,
        bytes_per_element=_BYTES[plan.precision],
        num_moe_layers=len(shape.modules),
        num_microbatches=m,
        link=plan.cluster.link_for_axis(ep, 1),
    )
    info = {
        "degree": ep,
        "num_experts": shape.num_experts,
        "top_k": shape.top_k,
        "params": list(shape.params),
        "all_to_all_bytes": cost.all_to_all_bytes,
        "all_to_alls_per_step": cost.num_all_to_alls,
        "all_to_all_s": cost.all_to_all_s,
        "memory_saved_bytes": expert_state_bytes(plan, shape) * (1 - 1 / ep),
    }
    breakdown = dict(plan.time_breakdown) | {"comm_dp": plan.time_breakdown.get("comm_dp", 0.0) + cost.all_to_all_s}
    return dataclasses.replace(
        plan, predicted=_with_all_to_alls(plan, cost.all_to_all_s), time_breakdown=breakdown, expert_parallel=info
    )


def _with_all_to_alls(plan: Plan, all_to_all_s: float):
    """`plan`'s predicted figures with the all-to-alls added to the step (the memory is the solver's, split)."""
    old = plan.predicted
    step = old.step_time_s + all_to_all_s
    speed = old.step_time_s / step
    return dataclasses.replace(
        old,
        step_time_s=step,
        grad_sync_s=old.grad_sync_s + all_to_all_s,
        tflops_per_device=old.tflops_per_device * speed,
        mfu=old.mfu * speed,
        hardware_flops_utilization=old.hardware_flops_utilization * speed,
        tokens_per_s=old.tokens_per_s * speed,
    )
