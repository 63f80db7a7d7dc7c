"""A pinned expert axis (`constraints={"ep": N}`, `--ep N`): what it needs of the layout, checked; its price.

Experts split over ep groups carved from the data-parallel ranks (Megatron-Core's convention): ep must divide dp
and the number of experts. A model's experts are its modules named `experts` whose own weights all stack one
tensor per expert on dim 0 (Hugging Face's Mixtral, Qwen-MoE, ...); a shared expert (Qwen-MoE's
`shared_expert`) is not among them and keeps the dense layout.

What runs it is the expert-parallel program (`autopar.runtime.experts`): the data-parallel program with its
experts split. So a pinned ep pins the layout that program runs (tp 1, pp 1, ZeRO-0, no recompute: `layout_pins`),
and a pin that contradicts it is refused. The plan is solved as that data-parallel layout, then priced with the
axis (`with_expert_parallel`, from `cost_model.experts`): the all-to-alls join the data axis's communication
(they run over its ranks) and the step; the experts' weights, gradients and optimizer states per device shrink
to 1 / ep. The experts' gradient all-reduce, which runs over dp / ep ranks on 1 / ep of the bytes, keeps its
price over the whole data axis (an overestimate); the search does not weigh ep yet.
"""

from __future__ import annotations

import dataclasses

import torch

from autopar.constraints import Constraints
from autopar.cost_model.experts import estimate_expert_parallel
from autopar.errors import ConfigError
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


def with_expert_parallel(plan: Plan, shape: MoeShape, ep: int) -> Plan:
    """`plan` (the data-parallel layout, solved) with an expert axis of `ep`, priced (module docstring)."""
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
    predicted, saved = _priced(plan, cost.all_to_all_s, shape.num_expert_elements / plan.num_parameters, ep)
    info = {
        "degree": ep,
        "num_experts": shape.num_experts,
        "top_k": shape.top_k,
        "params": list(shape.params),
        "all_to_all_bytes": cost.all_to_all_bytes,
        "all_to_alls_per_step": cost.num_all_to_alls,
        "all_to_all_s": cost.all_to_all_s,
        "memory_saved_bytes": saved,
    }
    breakdown = dict(plan.time_breakdown) | {"comm_dp": plan.time_breakdown.get("comm_dp", 0.0) + cost.all_to_all_s}
    return dataclasses.replace(plan, predicted=predicted, time_breakdown=breakdown, expert_parallel=info)


def _priced(plan: Plan, all_to_all_s: float, expert_fraction: float, ep: int):
    """(predicted figures with the all-to-alls added and the experts' states divided by ep, bytes saved)."""
    old = plan.predicted
    memory = dict(old.memory_breakdown)
    saved = 0.0
    for key in ("params", "grads", "optimizer"):
        if key in memory:
            cut = memory[key] * expert_fraction * (1 - 1 / ep)
            memory[key] -= cut
            saved += cut
    step = old.step_time_s + all_to_all_s
    speed = old.step_time_s / step
    predicted = dataclasses.replace(
        old,
        step_time_s=step,
        grad_sync_s=old.grad_sync_s + all_to_all_s,
        tflops_per_device=old.tflops_per_device * speed,
        mfu=old.mfu * speed,
        hardware_flops_utilization=old.hardware_flops_utilization * speed,
        tokens_per_s=old.tokens_per_s * speed,
        peak_memory_bytes=old.peak_memory_bytes - saved,
        memory_breakdown=memory,
    )
    return predicted, saved
