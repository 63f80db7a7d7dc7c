"""One rank's compute of a preset's training step, priced op by op and grouped into terms: what a calibration row's
"compute" is made of.

    python -m autopar.bench.compute_terms llama3-8b H100-96GB-500W --batch 2 --seq 8192 --fuse attention

prints, for the local batch of one rank (no parallel split), each op kind's priced forward and backward seconds,
how many times it runs in the whole model, and its FLOPs over the time as a share of the device's bf16 matrix
peak: matmuls by GEMM shape (batch, m, n, k), the attention kernel, and every elementwise, cast and reduction op the
program launches. The preset is traced with two of its identical layers standing for all of them, as planning
traces it (`autopar.tracing.trace_shortened`); an op inside the layers counts depth / 2 times. `--fuse` takes the
kinds of `autopar.plan`'s `fuse_kernels` ("all", "none", or kinds separated by commas). Recompute, communication and
the optimizer are the plan's other terms, not priced here.
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Term:
    """One op kind's share of a step: seconds forward and backward, how often it runs, FLOPs of both passes."""

    name: str
    forward_s: float
    backward_s: float
    count: float
    flops: float

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


def compute_terms(model: str, device: str, batch: int, seq: int, fuse=("attention",)) -> list[Term]:
    """The terms of one rank's forward and backward of preset `model` at `batch` x `seq` on `device`, in bf16,
    largest first (see the module docstring)."""
    from autopar import presets
    from autopar.cost_model.compute import AnalyticEstimator, estimate_node_cost
    from autopar.cost_model.devices import get_device
    from autopar.ir import OpGraph
    from autopar.passes.fused_ops import fuse_traced, fusion_kinds, fusion_knobs
    from autopar.trace import trace_model

    config = presets.load_config(model)
    depth = int(config.num_hidden_layers)
    config.num_hidden_layers = 2
    module = presets.build_model(config, device="meta", dtype=torch.bfloat16)
    args, kwargs = presets.example_batch(config, batch, seq)
    traced = trace_model(module, args, kwargs)
    kinds = fusion_kinds(fuse)
    if kinds:
        traced = fuse_traced(traced, **fusion_knobs(kinds))
    graph = OpGraph.from_traced(traced)
    estimator = AnalyticEstimator(get_device(device), "bf16")
    found: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        cost = estimate_node_cost(node)
        if cost.is_view or (cost.flops == 0 and cost.bytes_accessed == 0):
            continue
        times = depth / 2 if graph.node_layer.get(node.name, (None, None))[0] is not None else 1
        name = str(node.target).removeprefix("aten.") + (f" {cost.gemm}" if cost.gemm is not None else "")
        backward = estimator.backward_time_s(node, 1.0) if cost.backward_flops or cost.backward_bytes else 0.0
        entry = found[name]
        entry[0] += times * estimator.forward_time_s(node, 1.0)
        entry[1] += times * backward
        entry[2] += times
        entry[3] += times * (cost.flops + cost.backward_flops)
    terms = [Term(name, *values) for name, values in found.items()]
    return sorted(terms, key=lambda t: -t.seconds)


def markdown(terms: list[Term], peak_flops: float) -> str:
    """The terms as a table, with the total."""
    lines = ["| op | runs | forward s | backward s | total s | share of bf16 peak |", "|---|---|---|---|---|---|"]
    for t in terms:
        share = t.flops / t.seconds / peak_flops if t.seconds else 0.0
        lines.append(
            f"| {t.name} | {t.count:g} | {t.forward_s:.4f} | {t.backward_s:.4f} | {t.seconds:.4f} | {share:.1%} |"
        )
    forward, backward = sum(t.forward_s for t in terms), sum(t.backward_s for t in terms)
    lines.append(f"| total | | {forward:.4f} | {backward:.4f} | {forward + backward:.4f} | |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from autopar.cost_model.devices import get_device

    parser = argparse.ArgumentParser(prog="python -m autopar.bench.compute_terms", description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("device")
    parser.add_argument("--batch", type=int, required=True, help="sequences of one rank")
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--fuse", default="attention", help='"all", "none", or kinds separated by commas')
    a = parser.parse_args(argv)
    fuse = {"all": True, "none": False}.get(a.fuse, tuple(k for k in a.fuse.split(",") if k))
    terms = compute_terms(a.model, a.device, a.batch, a.seq, fuse)
    print(markdown(terms, get_device(a.device).peak_matmul_flops("bf16")))


if __name__ == "__main__":
    main()
