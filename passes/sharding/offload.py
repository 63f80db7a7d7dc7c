"""Prices of host offload: what keeping optimizer states, gradients and weights on the host adds to a step
(`offload_prices`), what the offload program's chunks send over the data axis (`ChunkPricing`), and what a solution
keeps on the host (`offload_result`).

    C_o   per byte of optimizer state on the host, its parameter's share of: the gradient down and the updated 16-bit
          (or fp32) weight up the host link, and the CPU AdamW update: ((B_grad + B_param) / host_bw + 1 /
          cpu_adamw_rate) / B_opt
    C_g   per byte of gradient on the host: with m micro-batches every micro-batch's gradient goes down (accumulated
          on the host) instead of the last one only: (m - 1) / host_bw
    C_p   per byte of weights on the host: they come up for every gather, forward and backward of each micro-batch,
          instead of once after the step: (2m - 1) / host_bw

The offload program runs ZeRO-3 over chunks of many parameters (`autopar.memory.layout.pack`): per chunk one
reduce-scatter of its fp32 gradient staging and two gathers of its payload (forward and backward) each micro-batch,
each paying one latency. `ChunkPricing` packs the model as the program does and prices a parameter's share of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.devices import LinkSpec
from autopar.ir import OpGraph
from autopar.memory.layout import ALIGN_NUMEL, ParamSpec, offload_chunk_numel, pack
from autopar.passes.sharding.precision import Precision
from autopar.units import FP32_BYTES

RS, AG = Collective.REDUCE_SCATTER, Collective.ALL_GATHER


def offload_prices(
    precision: Precision, host_link: LinkSpec, host_adamw_params_per_s: float, num_microbatches: int
) -> tuple[float, float, float]:
    """(C_o, C_g, C_p): seconds per byte of optimizer state, of gradient and of weights kept on the host (see the
    module docstring), with `num_microbatches` micro-batches a step."""
    pr, m = precision, num_microbatches
    per_param = (pr.grad_bytes_at(3) + pr.param_bytes) / host_link.bandwidth_bytes_per_s
    per_param += 1.0 / host_adamw_params_per_s
    # weights on the host come up for every gather (forward and backward of each micro-batch), not once
    c_p = (2 * m - 1) / host_link.bandwidth_bytes_per_s
    return per_param / pr.optimizer_bytes, (m - 1) / host_link.bandwidth_bytes_per_s, c_p


def offload_result(
    host_bytes: tuple[float, float, float],
    device_bytes: dict[str, float],
    offload_s: float,
    *,
    host_capacity: float,
    devices_per_node: int,
    budget: float,
) -> dict:
    """What a solution keeps on the host, for the plan: `host_bytes` (h_o, h_g, h_p: optimizer states, gradients
    and weights on the host per device), as fractions of each state (`device_bytes`: what stays on the device), per
    device and node, and the seconds it adds; empty where nothing is."""
    h_o, h_g, h_p = host_bytes
    if h_o <= 0.5:
        return {}
    host = h_o + h_g
    return {
        "optimizer_fraction": min(1.0, h_o / max(device_bytes.get("optimizer", 0.0) + h_o, 1.0)),
        "grad_fraction": min(1.0, h_g / max(device_bytes.get("grads", 0.0) + h_g, 1.0)),
        "param_fraction": min(1.0, h_p / max(device_bytes.get("params", 0.0) + h_p, 1.0)),
        "optimizer_bytes_per_device": h_o,
        "grad_bytes_per_device": h_g,
        "param_bytes_per_device": h_p,
        "host_bytes_per_device": host,
        "host_bytes_per_node": host * devices_per_node,
        "host_capacity_bytes_per_device": host_capacity,
        "time_s": offload_s,
        "device_budget_bytes": budget,
    }


def model_param_specs(graph: OpGraph) -> list[ParamSpec]:
    """The model's parameters in the order it uses them, as the offload program packs them: a deduplicated layer's
    parameters (a run of them with the same layer and multiplicity) repeated as often as it occurs, where its copies
    were."""
    specs: list[ParamSpec] = []
    run: list = []
    key = None

    def flush() -> None:
        for r in range(key[1] if run else 0):
            specs.extend(ParamSpec(f"{i.name}#{r}", tuple(i.meta.shape), requires_grad=i.requires_grad) for i in run)

    for node, info in graph.params.items():
        count = graph.layer_count.get(node, 1)
        if not count:  # a copy of a deduplicated layer: its representative stands for it
            continue
        if (info.layer, count) != key:
            flush()
            run, key = [], (info.layer, count)
        run.append(info)
    flush()
    return specs


@dataclass(frozen=True)
class ChunkPricing:
    """The offload program's chunks on a data axis and their collectives' prices.

    Args:
        specs: the model's parameters as the program packs them (`model_param_specs`).
        data_ranks: ranks on the data axis; `link` its link.
        precision: the bytes of each state (the payload is in the compute format, gradients staged in fp32).
        budget_bytes: the device memory budget the chunk size is chosen under (`offload_chunk_numel`).
    """

    specs: tuple[ParamSpec, ...]
    data_ranks: int
    link: LinkSpec
    precision: Precision
    budget_bytes: float

    @functools.cached_property
    def chunks(self) -> tuple:
        """The chunks (`ChunkLayout`s) the offload program packs the model into, in its order."""
        numel = offload_chunk_numel(
            [sp.numel for sp in self.specs],
            dp=self.data_ranks,
            budget_bytes=self.budget_bytes,
            compute_itemsize=int(self.precision.param_bytes),
        )
        return pack(list(self.specs), numel, multiple=ALIGN_NUMEL * self.data_ranks)

    def latency(self, kind: Collective) -> float:
        """A chunk collective's fixed cost (one of no bytes)."""
        return estimate_collective_time(kind, 0.0, self.data_ranks, self.link)

    def bandwidth(self, kind: Collective, nbytes: float) -> float:
        """The bandwidth part of one chunk's collective of `nbytes` (its latency apart)."""
        return estimate_collective_time(kind, nbytes, self.data_ranks, self.link) - self.latency(kind)

    @functools.cached_property
    def totals(self) -> tuple[tuple[float, float, float, float], int]:
        """((RS_bw, RS_fix, AG_bw, AG_fix), trainable elements) over `chunks`: a reduce-scatter of each trainable
        chunk's fp32 gradient staging and a gather of each chunk's payload (the compute format), the fixed part one
        latency per chunk."""
        trainable = [c for c in self.chunks if c.requires_grad]
        totals = (
            sum(self.bandwidth(RS, c.capacity * FP32_BYTES) for c in trainable),
            self.latency(RS) * len(trainable),
            sum(self.bandwidth(AG, c.capacity * self.precision.param_bytes) for c in self.chunks),
            self.latency(AG) * len(self.chunks),
        )
        return totals, sum(sp.numel for sp in self.specs if sp.requires_grad)

    def collectives(self, numel: float) -> tuple[float, float, float, float]:
        """(RS_bw, RS_fix, AG_bw, AG_fix): a parameter of `numel` elements' share (by its elements, of the trainable
        ones) of one reduce-scatter of every trainable chunk's gradients and one all-gather of every chunk's payload,
        frozen chunks included, each split into bandwidth and latency (`totals`)."""
        totals, trainable = self.totals
        return tuple(t * numel / trainable for t in totals) if trainable else (0.0, 0.0, 0.0, 0.0)

    def last_bucket_bw_s(self, prefetch: bool) -> float:
        """The bandwidth the backward cannot hide: the first trainable chunk's reduce-scatter (its gradients come
        last), and with prefetch the gather that starts the backward (of the last chunk), which no compute precedes
        (without prefetch the backward's gathers are exposed whole, `SyncPricing.sharded_parts`)."""
        first = next((c for c in self.chunks if c.requires_grad), None)
        if first is None:
            return 0.0
        rs = self.bandwidth(RS, first.capacity * FP32_BYTES)
        if not prefetch:
            return rs
        return rs + self.bandwidth(AG, self.chunks[-1].capacity * self.precision.param_bytes)

    def first_gather_bw_s(self) -> float:
        """The bandwidth part of a micro-batch's first gather (the first chunk's), which no compute precedes."""
        nbytes = self.chunks[0].capacity * self.precision.param_bytes if self.chunks else 0.0
        return self.bandwidth(AG, nbytes)

    def prefetch_bytes(self) -> float:
        """Payload gathered ahead of use: the program prefetches one chunk ahead, so the largest chunk's (none with
        one chunk)."""
        chunks = self.chunks
        return max(c.capacity for c in chunks) * self.precision.param_bytes if len(chunks) > 1 else 0.0
