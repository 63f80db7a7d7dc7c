"""Expert parallelism: what splitting a mixture of experts' experts over an `ep` group costs and saves.

An ep group is carved from the data-parallel ranks (Megatron-Core's convention): each of its `ep` ranks holds
E / ep of the E experts of every MoE layer, whole. A rank's tokens go to the ranks holding their experts by an
all-to-all and come back by another (dispatch and combine); backward runs both again in reverse. With T tokens on
a rank in one micro-batch, each routed to k experts, of hidden size h, in a format of b bytes, one all-to-all
re-splits (over the group, every rank's share together, as `cost_model.comm` counts an all-to-all's size)

    S = ep · T · k · h · b    bytes,

and a step runs 4 · L · m of them (L MoE layers, m micro-batches): 2 forward, 2 backward. Routing is taken as
balanced over the experts (each rank receives as many routed tokens as it sends); the runtime is dropless, so a
skewed batch moves more to some ranks than this prices.

Memory: the experts' weights, gradients and optimizer states per device are divided by ep (each rank holds its
E / ep experts); the rest of the model keeps its layout. The experts' gradients are all-reduced over the dp / ep
ranks that hold the same experts, not over the whole data axis. `ExpertSplit` names the weights so split and the
degree: the sharding solver's prices read it (`passes.sharding.prices.MeshPrices`), so that the memory a plan is
checked against and the gradient sync it pays are those of the program that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.devices import LinkSpec
from autopar.cost_model.nccl import GroupLink
from autopar.errors import ConfigError

# all-to-alls per MoE layer and micro-batch: dispatch and combine, forward and backward
ALL_TO_ALLS_PER_LAYER = 4

# the axis the report names for an expert weight's gradient sync: the dp / ep ranks holding the same experts
EXPERT_SYNC_AXIS = "dp/ep"


@dataclass(frozen=True, slots=True)
class ExpertSplit:
    """The weights an ep group splits (`params`: their names, each stacking one tensor per expert on dim 0) and
    the group's size (`degree`): a rank holds 1 / degree of each, and sums its gradient with the dp / degree ranks
    holding the same experts (stride `degree` on the data axis: one rank of each ep group)."""

    degree: int
    params: frozenset[str]

    def __post_init__(self):
        if self.degree < 1:
            raise ConfigError(f"expert parallelism needs ep >= 1, got {self.degree}")

    def replicas(self, data_ranks: int) -> int:
        """Ranks holding the same experts on a data axis of `data_ranks`: data_ranks / degree."""
        if data_ranks % self.degree:
            raise ConfigError(f"ep={self.degree} does not divide the data axis (dp={data_ranks})")
        return data_ranks // self.degree


@dataclass(frozen=True, slots=True)
class ExpertParallelCost:
    """What one step with an ep group adds and saves, per device."""

    all_to_all_bytes: int  # the whole tensor one all-to-all re-splits, S of the module docstring
    num_all_to_alls: int  # per step: 4 · L · m
    all_to_all_s: float  # all of them, per step, unoverlapped
    expert_state_fraction: float  # of the experts' weights, gradients and optimizer states one device holds: 1 / ep


def all_to_all_bytes(*, ep: int, tokens: int, top_k: int, hidden_size: int, bytes_per_element: int) -> int:
    """S = ep · tokens · top_k · hidden_size · bytes_per_element: the routed tokens of every rank of the group
    (`tokens` per rank per micro-batch), each sent once per expert it is routed to."""
    return ep * tokens * top_k * hidden_size * bytes_per_element


def estimate_expert_parallel(
    *,
    ep: int,
    tokens: int,
    top_k: int,
    hidden_size: int,
    bytes_per_element: int,
    num_moe_layers: int,
    num_microbatches: int,
    link: LinkSpec | GroupLink,
) -> ExpertParallelCost:
    """The all-to-all traffic and time of one step, and the share of expert states a device keeps.

    Args:
        ep: ranks the experts are split over (1: none, nothing moves).
        tokens: tokens one rank runs in one micro-batch.
        top_k: experts each token is routed to.
        hidden_size: elements of one token's hidden state.
        bytes_per_element: of the format the tokens move in (the compute format).
        num_moe_layers: MoE layers the rank runs.
        num_microbatches: micro-batches per step.
        link: the link the ep group's ranks cross (`ClusterSpec.link_for_axis`).
    """
    for name, value in (("ep", ep), ("tokens", tokens), ("top_k", top_k), ("num_microbatches", num_microbatches)):
        if value < 1:
            raise ConfigError(f"expert parallelism needs {name} >= 1, got {value}")
    size = all_to_all_bytes(
        ep=ep, tokens=tokens, top_k=top_k, hidden_size=hidden_size, bytes_per_element=bytes_per_element
    )
    count = ALL_TO_ALLS_PER_LAYER * num_moe_layers * num_microbatches if ep > 1 else 0
    each = estimate_collective_time(Collective.ALL_TO_ALL, size, ep, link)
    return ExpertParallelCost(
        all_to_all_bytes=size if ep > 1 else 0,
        num_all_to_alls=count,
        all_to_all_s=count * each,
        expert_state_fraction=1.0 / ep,
    )
