"""The stages of a pipeline program on this rank, and how the program sets them up.

`Stage` runs one (virtual) stage's lowered graph as a `torch.nn.Module` for `torch.distributed.pipelining`;
`cut_stages`, `stage_placements`, `make_schedule` and `make_tie_groups` are steps of
`autopar.runtime.pipeline.PipelineProgram`'s construction, taking the program; `cut_stages` and the `Stage`s also run
for each other sequence length the program traces (`autopar.runtime.shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autopar.errors import LoweringError
from autopar.ir import OpGraph
from autopar.passes.pipeline_split import StageGraph, split_stages, stack_layers, values_needing_grad
from autopar.plan import StagePlan
from autopar.runtime import pipeline_schedule
from autopar.runtime.base import check_scalar_loss
from autopar.runtime.collectives import new_group

if TYPE_CHECKING:
    from autopar.runtime.pipeline import PipelineProgram
    from autopar.trace import TracedModel


@dataclass(frozen=True, slots=True)
class StageCut:
    """A trace cut into the plan's stages (every device's), with what the program reads of it.

    kind: traced placeholder name -> (kind, key): ("param", fqn), ("buffer", fqn), ("constant", name) or ("input",
        position among the flattened inputs).
    graph: the trace's `OpGraph` (its representatives name the stage plans' placements).
    grad_values: names of the values a gradient flows through.
    stages: the stage graphs in pipeline order.
    stage_params: stage index -> the parameters its graph reads (sorted).
    node_names: every node of the trace.
    """

    kind: dict[str, tuple[str, object]]
    graph: OpGraph
    grad_values: frozenset[str]
    stages: tuple[StageGraph, ...]
    stage_params: dict[int, tuple[str, ...]]
    node_names: frozenset[str]


def cut_stages(program: PipelineProgram, traced: TracedModel) -> StageCut:
    """`traced` cut into `program`'s stages (`passes.pipeline_split`): several stacks of layers (an encoder and a
    decoder) as one sequence of layers."""
    kind: dict[str, tuple[str, object]] = {}
    sig = traced.exported.graph_signature
    params, buffers, inputs = iter(traced.param_names), iter(traced.buffer_names), iter(range(10**9))
    consts = iter(s.target for s in sig.input_specs if s.kind.name in ("CONSTANT_TENSOR", "CUSTOM_OBJ"))
    source = {"param": params, "buffer": buffers, "constant": consts, "input": inputs}
    phs = [n for n in traced.exported.graph.nodes if n.op == "placeholder"]
    for ph, k in zip(phs, traced.placeholder_kinds, strict=True):
        kind[ph.name] = (k, next(source[k]))
    graph = OpGraph.from_traced(traced, frozen_params=program._frozen)
    grad_values = values_needing_grad(traced.exported.graph, {n for n, p in graph.params.items() if p.requires_grad})
    if all(c is None for c, _ in graph.node_layer.values()):
        raise LoweringError("pipeline stages need a stack of layers to cut; the model has none")
    node_layer, container, _ = stack_layers(graph.node_layer)
    stages = split_stages(
        traced.graph_module,
        node_layer,
        container,
        program._stage_layers,
        param_nodes=set(graph.params),
        loss_output=traced.num_mutated_outputs,
    )
    stage_params = {
        sg.index: tuple(sorted({kind[n][1] for n in sg.placeholders if kind[n][0] == "param"})) for sg in stages
    }
    names = frozenset(n.name for n in traced.exported.graph.nodes)
    return StageCut(kind, graph, frozenset(grad_values), tuple(stages), stage_params, names)


class Stage(torch.nn.Module):
    """One (virtual) stage on this rank: runs its lowered graph on this rank's pieces, takes and gives local
    tensors (its rows, whole over tp)."""

    def __init__(self, program: PipelineProgram, sg: StageGraph, recompute: str, placements: tuple[dict, dict]):
        super().__init__()
        self.program, self.sg = program, sg
        self.is_last = sg.index == program.num_stages - 1
        self.train_interp = program.lower_stage(sg, placements, recompute=recompute, train=True)
        self.eval_interp = program.lower_stage(sg, placements, recompute="none", train=False)
        self.interp = self.train_interp
        nodes = {n.name: n for n in sg.graph_module.graph.nodes}
        self._in_meta = [nodes[name].meta["val"] for name in sg.received]
        self._in_grad = [name in program.grad_values for name in sg.received]
        self._out_meta = [nodes[name].meta["val"] for name in sg.sends]
        self._out_grad = [name in program.grad_values for name in sg.sends]
        self.weights: list[float] = []  # loss weight of each micro-batch this step (last stage)
        self.sums: list[torch.Tensor] = []  # loss sum of each micro-batch this step (last stage, unscaled)

    # the metadata torch.distributed.pipelining needs to allocate receive buffers (static, no dry run)
    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        index = torch.zeros(1, dtype=torch.long, device=self.program.device_type)
        return (index, *(self._example(v, g) for v, g in zip(self._in_meta, self._in_grad, strict=True)))

    def example_outputs(self) -> tuple[torch.Tensor, ...]:
        if self.is_last:
            return (torch.zeros((), dtype=torch.float32, device=self.program.device_type).requires_grad_(),)
        index = torch.zeros(1, dtype=torch.long, device=self.program.device_type)
        return (index, *(self._example(v, g) for v, g in zip(self._out_meta, self._out_grad, strict=True)))

    def _example(self, val, requires_grad: bool) -> torch.Tensor:
        t = torch.zeros(tuple(val.shape), dtype=val.dtype, device=self.program.device_type)
        return t.requires_grad_(requires_grad)

    def forward(self, index: torch.Tensor, *received: torch.Tensor):
        prog = self.program
        mb = int(index.reshape(-1)[0])
        values = [*received, *(prog.placeholder_value(name, mb) for name in self.sg.placeholders)]
        out = self.interp(*values)
        if self.is_last:
            loss = out[0]
            check_scalar_loss(loss)
            self.sums.append(loss.detach().double())
            self.weights.append(float(out[-1]) if self.interp.counted else 1.0)
            return prog.scaled(loss.float())
        return (index, *(v.contiguous() for v in out))


def stage_placements(program: PipelineProgram, st: StagePlan, sg: StageGraph, graph: OpGraph) -> tuple[dict, dict]:
    """(node_inputs, node_output) of stage graph `sg` on `program`: those its stage plan was priced with, each node
    taking its representative's (a layer's nodes stand for every layer of the stage); else the plan's own."""
    if not st.node_output:
        if not program.plan.node_output:
            raise LoweringError(
                "the pipeline plan holds no per-node placements for its stages: build it with "
                "autopar.compile, which completes them"
            )
        return program.plan.node_inputs, program.plan.node_output
    names = [n.name for n in sg.graph_module.graph.nodes]
    rep = {n: graph.representative.get(n, n) for n in names}
    node_inputs = {n: st.node_inputs[rep[n]] for n in names if rep[n] in st.node_inputs}
    node_output = {n: st.node_output[rep[n]] for n in names if rep[n] in st.node_output}
    return node_inputs, node_output


def make_schedule(program: PipelineProgram, name: str, v: int):
    """The schedule running `program`'s stages: `name` (`plan.pipeline["schedule"]`) over `v` virtual stages per
    device; with overlap on `autopar.runtime.pipeline_schedule`, else torch's own."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    def loss_fn(output, target):  # the last stage already returns the weighted loss
        del target
        return output

    m = program.num_microbatches
    if program.plan.overlap:
        hook = dict(loss_fn=loss_fn, scale_grads=False, on_last_backward=program._stage_backward_done)
        if name == "interleaved_1f1b" or v > 1:
            return pipeline_schedule.interleaved(program._pipe_stages, m, **hook)
        if name not in ("gpipe", "1f1b"):
            raise LoweringError(f"pipeline schedule {name!r} is not one this runtime knows")
        return pipeline_schedule.OverlappedSchedule(program._pipe_stages[0], m, name, **hook)
    if name == "interleaved_1f1b" or v > 1:
        return ScheduleInterleaved1F1B(program._pipe_stages, m, loss_fn=loss_fn, scale_grads=False)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(name)
    if cls is None:
        raise LoweringError(f"pipeline schedule {name!r} is not one this runtime knows")
    return cls(program._pipe_stages[0], m, loss_fn=loss_fn, scale_grads=False)


def make_tie_groups(
    program: PipelineProgram, holders: dict[str, set[int]]
) -> list[tuple[list[str], dist.ProcessGroup, tuple]]:
    """Process groups of `program` joining the copies of parameters read on several devices' stages (every rank
    creates all)."""
    by_devices: dict[tuple[int, ...], list[str]] = {}
    for fqn in sorted(holders):
        if len(holders[fqn]) > 1:
            by_devices.setdefault(tuple(sorted(holders[fqn])), []).append(fqn)
    block = program.dp * program.tp
    me = dist.get_rank() % block
    out = []
    for devices, names in sorted(by_devices.items()):
        for pos in range(block):
            group = new_group([d * block + pos for d in devices])
            if pos == me and program.pp_rank in devices:
                out.append((names, group, devices))
    return out


__all__ = ["Stage", "StageCut", "cut_stages", "make_schedule", "make_tie_groups", "stage_placements"]
