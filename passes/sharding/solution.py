"""What the sharding search returns: each mesh's optimum (`MeshResult`) and the chosen layout (`ShardingSolution`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class MeshResult:
    """The optimum of one mesh's program (or why it has none)."""

    dp: int
    tp: int
    feasible: bool
    step_time_s: float
    compute_s: float
    reshard_s: float
    grad_sync_s: float
    zero_stage: int
    memory: dict[str, float]
    solve_time_s: float
    reason: str = ""
    optimizer_s: float = 0.0  # the optimizer step on the device (Opt less D_o h_o)
    num_microbatches: int = 1
    recompute: str = "none"
    # host offload: bytes on the host per device, fractions of the states, seconds it adds (empty: none)
    offload: dict = field(default_factory=dict)
    # per-layer treatment (`passes.activation_plan`): "offload"/"full"/"selective" -> how many layers
    # (empty: `recompute` applies to every layer); the offloaded activations' host bytes and seconds
    layer_modes: dict = field(default_factory=dict)
    activation_offload: dict = field(default_factory=dict)
    recompute_s: float = 0.0  # the part of compute_s that runs forwards again (and what leaving plain tensors adds)
    grad_sync_hidden_s: float = 0.0  # gradient all-reduce time hidden behind backward (grad_sync_s is what is not)
    cp_comm_s: float = 0.0  # cp attention's communication its compute does not hide (not in compute_s)
    cp_comm_hidden_s: float = 0.0  # and what it hides (not in the step)
    step_gather_s: float = 0.0  # the part of grad_sync_s that gathers weights before a pipeline's schedule starts
    sync_fixed_s: float = 0.0  # the part of grad_sync_s that is bucketed reductions' latency (never hidden)
    reshard_hidden_s: float = 0.0  # tensor-axis collectives launched early, hidden behind the ops before their use


@dataclass(frozen=True)
class ShardingSolution:
    """The chosen layout: mesh, ZeRO stage and per-node placements on the tensor axis."""

    dp: int
    tp: int
    num_microbatches: int
    zero_stage: int
    step_time_s: float
    compute_s: float
    reshard_s: float
    grad_sync_s: float
    memory: dict[str, float]
    node_output: dict[str, str]
    node_inputs: dict[str, tuple[str, ...]]
    node_strategy: dict[str, str]
    param_placements: dict[str, str]
    candidates: tuple[MeshResult, ...]
    unruled_ops: tuple[str, ...]
    num_groups: int
    solve_time_s: float
    recompute: str = "none"
    offload: dict = field(default_factory=dict)
    optimizer_s: float = 0.0
    layer_modes: dict = field(default_factory=dict)  # treatment -> layer indices (empty: uniform `recompute`)
    activation_offload: dict = field(default_factory=dict)
    recompute_s: float = 0.0  # the part of compute_s spent running forwards again
    grad_sync_hidden_s: float = 0.0  # gradient all-reduce time hidden behind backward (grad_sync_s is what is not)
    cp_comm_s: float = 0.0  # cp attention's communication its compute does not hide (not in compute_s)
    cp_comm_hidden_s: float = 0.0  # and what it hides (not in the step)
    reshard_hidden_s: float = 0.0  # tensor-axis collectives launched early, hidden behind the ops before their use
    # tp > 1: what the tensor axis splits and which parameters stay whole, and why (`tensor_split_report`)
    tensor_split: dict = field(default_factory=dict)
    # per deduplicated layer (and what runs outside the layers): its ops, placements and collectives
    # (`layer_ops_report`)
    layer_ops: tuple = ()
    # a cp plan: "degree", "algorithm" and "priced" (one line per algorithm, `CPPricing.lines`); empty without
    cp: dict = field(default_factory=dict)
