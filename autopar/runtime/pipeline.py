"""PipelineProgram: a plan with pipeline stages, run with `torch.distributed.pipelining`.

The world is one DeviceMesh (pp, dp, tp): stage block d holds ranks d*dp*tp ... (d+1)*dp*tp - 1,
as the pipeline search laid them out. On each rank:

- the traced graph (at the shape one rank of the data axis runs: its rows of one micro-batch) is cut
  into the plan's stages (`passes.pipeline_split`); this rank runs stage d, or with interleaving the
  virtual stages d, d + pp, ...;
- every stage is its graph lowered to plain local tensors and explicit collectives over the tensor
  axis of the (dp, tp) sub-mesh (`passes.lower`), with the placements of a plan solved for that
  sub-mesh, its parameters this rank's shards, exactly as in the sharded program;
- the stages are `PipelineStage`s over the pp process group, driven by the plan's schedule
  (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`).

What crosses a stage boundary is this rank's piece of each value: its rows, whole over tp. The first
value sent is the micro-batch index: every rank holds the whole global batch (every rank passes the
same batch to `train_step`), so a stage takes the inputs it reads (labels on the last stage, masks,
positions) from its own copy, and only activations travel.

Loss and gradients. The last stage's mean cross-entropy becomes its sum with the count of kept labels
(`program_graph.sum_loss_pass`): it returns micro-batch i's loss sum over this rank's rows (another
loss: its mean, weight 1); the gradients accumulate over the micro-batches and the data axis and are
divided by the global count (the sum of the weights over ranks and micro-batches) before the optimizer
step, so the step equals one over the whole batch.
Parameters used on two stages on different ranks (GPT-2's token embedding, tied to its LM head)
have a copy on each; their gradients are summed over the stages that hold them before the step,
so the copies stay equal (a copy its stage gave no gradient joins with zeros: every rank of a group
calls its collectives in the same order, or its peers wait). Gradients of parameters replicated over
dp stay partial through the micro-batches and are all-reduced over dp once per step, in buckets, as the
plan prices them.

Overlap (`plan.overlap`, on by default). The schedules run on `autopar.runtime.pipeline_schedule`: the receive of
micro-batch i+1's input (output gradient) is posted before micro-batch i's forward (backward), sends are
asynchronous and waited on at the end of the step, so transfers run while the stage computes. The dp reduction of
this rank's gradients goes out in buckets (`overlap.BUCKET_BYTES`, in the order the last backward of the step
produces the gradients, the last stage's first), each launched (asynchronously) during that backward as soon as the
last gradient of its members is in: a post-accumulate hook counts, per parameter, the micro-batches' gradients of
every local stage that reads it. So it runs behind the rest of that backward and then behind the stages before this
one, which still run their cooldown backwards; the step waits for it before the tie sums and the optimizer. A
parameter is made what the stage computes with (its cast to the compute format) where the stage's forward first
reads it (the lowered graph's `enter` hook): made before the forward, those autograd nodes would run only at the
very end of the backward (the engine runs the latest-made ready node first), and with them every hook. A parameter
split over dp by ZeRO-1 (`zero_stage` 1 on every stage that reads it) is gathered once a step: the gathers of all of
them go out (asynchronously, in the order the stages read them) before the schedule starts, and each is waited on
where a forward first reads it; every micro-batch then computes on the whole weight (in the compute format), and its
gradient (this rank's partial sum over dp) accumulates in fp32 over the micro-batches; the reduce-scatter of those
sums goes out bucket by bucket in the same way (its buckets apart from the all-reduced ones). That is ZeRO-1 as
the plan prices it for a pipeline stage (`ShardingProgram.step_gathers`): one gather and one reduce-scatter a step,
whole weights and whole fp32 gradients held for the step. With overlap off, torch's own schedules run (each
transfer waited on where it is posted), the same buckets go out after the whole schedule, and a split weight is
gathered wherever a micro-batch reads it (its gradient reduce-scattered by that gather's backward). Stages run
ZeRO 0 or 1 only: at 2 or 3 every micro-batch would gather and reduce-scatter each weight, waited on where issued,
so plans (`Plan`) and pins (`passes.pipeline`) with stages at ZeRO-2/3 are refused.

A cp axis (mesh pp x dp x cp x tp, tp innermost, then cp): the stage graphs are cut from the graph traced for cp
(`autopar.context_parallel.inputs.traced_batch`, the causal masks dropped, one rank's rows of it), in which each
sequence's zig-zag chunks are rows of the batch; as in the sharded program, the data axis is dp·cp ranks, with
attention across the cp group by the plan's algorithm. What
crosses a stage boundary is this rank's piece: its dp rows' cp chunk. A stage takes the inputs it reads (labels,
positions) from `context_parallel.inputs.local_batch` for its dp and cp rank. The loss is the global sum over the
dp·cp ranks divided by the global count of kept labels; gradients are reduced over dp·cp.

The stages and the steps of construction that set them up are in `autopar.runtime.pipeline_stages`; the
step's reductions over dp and its ZeRO-1 weights in `autopar.runtime.pipeline_reductions`.

No silent hang: the mesh's groups and the tie groups wait at most `collective_timeout()`
(`autopar.runtime.collectives`), and a wait past it raises a `LoweringError` naming the stage and the
collective this rank waited in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils import _pytree as pytree

from autopar import compat
from autopar.checkpoint.pieces import contiguous_stride, dtensor_piece
from autopar.cluster import ClusterSpec
from autopar.context_parallel.inputs import is_causal_lm, local_batch
from autopar.errors import LoweringError
from autopar.passes.lower import TensorAxis, lower_pass
from autopar.passes.parallelize import dp_placement, local_shard
from autopar.passes.pipeline_split import StageGraph
from autopar.passes.program_graph import copy_graph_module, eval_pass, sum_loss_pass
from autopar.passes.sharding_rules import parse_placement, placement_str
from autopar.plan import Plan, ProgramKind
from autopar.program_comm import ProgramComm
from autopar.runtime import overlap
from autopar.runtime.base import (
    Program,
    flat_inputs,
    rank_rows,
)
from autopar.runtime.collectives import device_mesh, waiting_for
from autopar.runtime.pipeline_reductions import StepReductions, WholeWeight
from autopar.runtime.pipeline_stages import (
    Stage,
    StageCut,
    cut_stages,
    make_schedule,
    make_tie_groups,
    stage_placements,
)
from autopar.runtime.sharded import LoweredRun
from autopar.trace import TracedModel

R = Replicate()


class PipelineProgram(StepReductions, Program):
    """The parallel program of a pipeline plan on this rank (see the module docstring).

    Args:
        model: the single-device model with real parameters.
        plan: the pipeline plan (`plan.pipeline` holds the stages' layers, the schedule, the micro-batches),
            its per-node and parameter placements those of one stage's (dp, tp) sub-mesh for `traced`
            (compile completes them), used on every stage.
        traced: the model traced at one micro-batch of the global batch.
        cluster: the cluster (its world size must equal pp x dp x cp x tp).
    """

    kind = ProgramKind.PIPELINE

    @classmethod
    def trace_parts(cls, plan: Plan) -> int:
        # one rank's sequences of one micro-batch; with a cp axis the rank traces its share of them
        # (`tracing.program_trace`), so a batch of fewer sequences than dp·cp ranks still cuts
        return plan.num_microbatches * plan.mesh["dp"]

    def __init__(
        self, model: torch.nn.Module, plan: Plan, traced: TracedModel, cluster: ClusterSpec, *, optimizer=None
    ):
        super().__init__(model, plan, traced, cluster, optimizer=optimizer)
        info = plan.pipeline
        pp, tp, cp = plan.mesh["pp"], plan.mesh["tp"], plan.mesh.get("cp", 1)
        # the data axis: dp·cp ranks (with a cp axis each sequence is cp rows of the traced batch)
        dp = plan.mesh["dp"] * cp
        self.pp, self.dp, self.tp, self.cp = pp, dp, tp, cp
        self.comm = ProgramComm.of_plan(plan, self.kind)  # what it does over the data axis (and how it is priced)
        self.num_microbatches = plan.num_microbatches
        self.micro_rows = plan.global_batch_size // plan.num_microbatches  # rows of one micro-batch
        self.micro_batch = self.micro_rows * cp // dp  # rows of the traced graph: this rank's share
        self.world: DeviceMesh = device_mesh(self.device_type, (pp, dp, tp), ("pp", "dp", "tp"))
        self.mesh: DeviceMesh = self.world["dp", "tp"]
        self.cp_mesh: DeviceMesh | None = None
        self.cp_knobs: dict = {}
        self._causal_lm = is_causal_lm(model)
        if cp > 1:
            self.cp_mesh = device_mesh(self.device_type, (pp, dp // cp, cp, tp), ("pp", "dp", "cp", "tp"))
            self.cp_knobs = dict(cp_group=self.cp_mesh.get_group("cp"), cp_algorithm=plan.context_parallel["algorithm"])
        self.pp_group = self.world.get_group("pp")
        self.pp_rank = self.world.get_local_rank("pp")
        if traced.num_mutated_outputs:
            raise LoweringError(
                "the model updates buffers or inputs in place, which pipeline stages do not "
                "support; plan with constraints={'pp': 1}"
            )

        # the stages: layer ranges in pipeline order (virtual stage j = chunk j // pp on device j % pp)
        v = int(info.get("virtual_stages", 1) or 1)
        stage_plans = plan.stage_plans
        per_device = [st.layers for st in stage_plans]
        if len(per_device) != pp or any(len(r) != v for r in per_device):
            raise LoweringError(f"the plan's pipeline does not list {v} layer ranges on each of {pp} stages")
        self._stage_layers = [[tuple(per_device[j % pp][j // pp])] for j in range(pp * v)]
        self.num_stages = pp * v
        self._frozen = frozenset(n for n, p in model.named_parameters() if not p.requires_grad)
        cut = cut_stages(self, traced)
        self._kind = cut.kind
        self.param_nodes = frozenset(cut.graph.params)  # the stages' interpreters gather those split by ZeRO-3
        # what a trace at another length must have: the same operations, each stage reading the same parameters
        self._node_names, self._stage_params = cut.node_names, cut.stage_params

        # this rank's parameter shards: one per name, shared by its stages
        named = dict(model.named_parameters(remove_duplicate=False))
        buffers_by_name = dict(model.named_buffers(remove_duplicate=False))
        zero = {st.index: st.zero_stage for st in stage_plans}
        holders: dict[str, set[int]] = {}  # parameter -> devices (pp ranks) whose stages read it
        for index, keys in cut.stage_params.items():
            for key in keys:
                holders.setdefault(key, set()).add(index % pp)
        self._param_names = sorted(k for k, devs in holders.items() if self.pp_rank in devs)
        self._placements: dict[str, tuple] = {}
        # ZeRO-1 with overlap: split weights gathered once a step, gradients reduce-scattered once (module docstring)
        self._step_split: set[str] = set()
        shards = {}
        for fqn in self._param_names:
            p = named[fqn]
            stage = max(zero.get(d, plan.zero_stage) for d in holders[fqn])
            tp_pl = parse_placement(plan.param_placements.get(fqn, "R"))
            pl = (dp_placement(tuple(p.shape), dp, stage >= 1, tp_pl), tp_pl)
            self._placements[fqn] = pl
            if self.comm.at_stage(stage).gathers_once_a_step and pl[0] != R:
                self._step_split.add(fqn)
            shards[fqn] = torch.nn.Parameter(local_shard(self.master(p), self.mesh, pl), requires_grad=p.requires_grad)
        self.shards = torch.nn.ParameterDict({k.replace(".", "/"): v for k, v in shards.items()})
        self._shard = shards
        self._shapes = {k: tuple(named[k].shape) for k in self._param_names}
        self._buffers = {k: b.detach().to(self.device_type) for k, b in buffers_by_name.items()}
        self._run_buffers = {k: self.in_compute_format(b) for k, b in self._buffers.items()}
        self._tie_groups = make_tie_groups(self, holders)
        self._dp_summed = [k for k in self._param_names if dp > 1 and self._placements[k][0] == R]

        self._compile_mode: str | None = None  # `compile_graphs`: applied to the stages of every length
        self._bind_cut(traced, cut)
        self._setup_reductions()
        self._build_schedule()
        self._micro_inputs: list[list] = []
        self._build_optimizer([shards[k] for k in self._param_names])

    # what depends on the trace: kept per sequence length (`autopar.runtime.shapes`); the parameters, buckets, tie
    # groups and hooks are the program's and stay
    _per_length = ("traced", "_kind", "grad_values", "_constants", "stages")

    def _bind_trace(self, traced: TracedModel) -> None:
        """Run the model as `traced`, a trace at another sequence length: its stages cut and lowered as at the
        planned one; their send and receive buffers are the next schedule's (`_at_length`)."""
        cut = cut_stages(self, traced)
        if cut.stage_params != self._stage_params or cut.node_names != self._node_names:
            raise LoweringError(
                "the model traced at this sequence length cuts into stages that read other parameters, or holds "
                "other operations, than at the planned one; compile with an example batch of this length"
            )
        self._bind_cut(traced, cut)

    def _bind_cut(self, traced: TracedModel, cut: StageCut) -> None:
        """This rank's stages of `cut` (the stage graphs of `traced`), lowered with their stage plans' placements."""
        self.traced, self._kind, self.grad_values = traced, cut.kind, cut.grad_values
        self._constants = {
            k: self.in_compute_format(c.to(self.device_type)) if isinstance(c, torch.Tensor) else c
            for k, c in traced.exported.constants.items()
        }
        by_device = {st.index: st for st in self.plan.stage_plans}
        self.stages = [
            Stage(
                self,
                sg,
                by_device[sg.index % self.pp].recompute,
                stage_placements(self, by_device[sg.index % self.pp], sg, cut.graph),
            )
            for sg in cut.stages
            if sg.index % self.pp == self.pp_rank
        ]
        if self._compile_mode is not None:
            self.compile_graphs(self._compile_mode)

    def _build_schedule(self) -> None:
        """The `PipelineStage`s of the current stages over the pp group, their receive buffers shaped (at the first
        step) by the current sequence length, and the schedule running them."""
        from autopar.compat import PipelineStage

        self._pipe_stages = [
            PipelineStage(
                st,
                st.sg.index,
                self.num_stages,
                torch.device(self.device_type),
                input_args=st.example_inputs(),
                output_args=st.example_outputs(),
                group=self.pp_group,
            )
            for st in self.stages
        ]
        self.schedule = make_schedule(self, str(self.plan.pipeline.get("schedule", "1f1b")), self.num_stages // self.pp)

    def _at_length(self, length: int | None, args, kwargs) -> None:
        # every rank of a pp group has the same batch, so every stage switches at the same step and a sender's
        # activations have the shape its receiver's new buffers take; only the current length's buffers are held
        before = self.lengths.current
        super()._at_length(length, args, kwargs)
        if self.lengths.current != before:
            self._build_schedule()

    # -------------------------------------------------------------------------------- execution

    def is_param(self, name: str) -> bool:
        return self._kind[name][0] == "param"

    def placeholder_value(self, name: str, mb: int):
        """The value of a traced placeholder on this rank for micro-batch `mb`, as the lowered graph takes it: a
        parameter's master shard (the graph's `enter` hook makes what it computes with), a buffer, a constant, or this
        rank's rows of an input."""
        kind, key = self._kind[name]
        if kind == "param":
            return self._shard[key]
        if kind == "buffer":
            return self._run_buffers[key]
        if kind == "constant":
            return self._constants[key]
        return self._micro_inputs[mb][key]

    # the parameter hooks the lowered stage graphs call (`passes.lower.ParamHooks`)

    def enter(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Parameter i as the stage computes with it, made where the stage's forward first reads it (see the module
        docstring): a ZeRO-1 weight whole for the step (gathered once), a split one cast (gathered at each use), a
        replicated one cast, its gradient this rank's partial sum until the step's bucket sums it over dp."""
        key = self._param_names[i]
        if self._holding and key in self._step_split:
            return WholeWeight.apply(x, self, key)
        if self._placements[key][0] == R and self.reduce_in_compute:
            x = self.in_compute_format(x)  # the dp reduction in the compute format
        return self.in_compute_format(x)

    def gather(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Split parameter i whole for one op that reads it (a ZeRO-1 weight of this step is whole already)."""
        key = self._param_names[i]
        if self._holding and key in self._step_split:
            return x
        d = self._placements[key][0].dim
        return overlap.gather_split(x, d, self._shapes[key][d], self.mesh.get_group("dp"))

    def lower_stage(self, sg: StageGraph, placements: tuple[dict, dict], *, recompute: str, train: bool) -> LoweredRun:
        """Stage graph `sg` lowered to local ops and tensor-axis collectives (`passes.lower`); the last stage's loss
        made a sum with its kept-label count (`program_graph.sum_loss_pass`)."""
        gm = copy_graph_module(sg.graph_module)
        if not train:
            gm = eval_pass(gm, None)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        last = not sg.sends
        if last:  # the loss alone: as a tuple, so that its count can join it
            out.args = ((out.args[0],),)
            gm.recompile()
            gm = sum_loss_pass(gm, None, loss_index=0)
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        node_inputs, node_output = placements
        index = {
            name: self._param_names.index(key)
            for name in sg.placeholders
            for kind, key in [self._kind[name]]
            if kind == "param"
        }
        tp = self.tp
        axis = TensorAxis(self.mesh.get_group("tp") if tp > 1 else None, tp, self.mesh.get_local_rank("tp"))
        split = frozenset(n for n, i in index.items() if self._placements[self._param_names[i]][0] != R)
        lowered = lower_pass(
            gm,
            None,
            axis=axis,
            node_inputs=node_inputs,
            node_output=node_output,
            param_placements={n: placement_str(self._placements[self._param_names[i]][1]) for n, i in index.items()},
            params=index,
            split_params=split,
            hooks=self,
            replicated_outputs=tuple(range(len(outputs))),
            recompute=recompute,
            launch_early=self.comm.launches_early,
            **self.cp_knobs,
        )
        return LoweredRun(lowered, None, counted=last and gm.meta["autopar_loss_count"])

    def _set_micro_inputs(self, micro: list[tuple]) -> None:
        """This rank's rows of each micro-batch's inputs, flattened in placeholder order."""
        self._micro_inputs = []
        if self.cp > 1:
            micro = [self._cp_share(a, k) for a, k in micro]
        rank = self.mesh.get_local_rank("dp")
        for a, k in micro:
            flat = [
                t.to(self.device_type) if isinstance(t, torch.Tensor) else t for t in flat_inputs(self.traced, a, k)
            ]
            if self.cp == 1:  # this rank's rows (a cp share is this rank's already)
                flat = [
                    rank_rows(t, self.dp, rank).contiguous()
                    if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == self.micro_rows
                    else t
                    for t in flat
                ]
            self._micro_inputs.append(flat)

    def _cp_share(self, args, kwargs) -> tuple[tuple, dict]:
        """This rank's share of a micro-batch on a cp plan: its dp rows, then its cp chunk of each of them (positions
        and pre-shifted labels included), as the sharded program feeds it."""
        dp, dp_rank = self.plan.mesh["dp"], self.cp_mesh.get_local_rank("dp")
        rows = [pytree.tree_map(lambda t: rank_rows(t, dp, dp_rank), x) for x in (args, kwargs)]
        return local_batch(*rows, self.cp, self.cp_mesh.get_local_rank("cp"), causal_lm=self._causal_lm)

    def _run_schedule(self, micro: list[tuple], backward: bool) -> tuple[float, float]:
        """Run the schedule over the micro-batches (forward only unless `backward`); (loss sum, weight sum) on
        every stage, the loss sum without the loss scale."""
        self._set_micro_inputs(micro)
        for st in self.stages:
            st.weights, st.sums = [], []
            st.interp = st.train_interp if backward else st.eval_interp
        index = torch.arange(self.num_microbatches, device=self.device_type)
        has_first = any(st.sg.index == 0 for st in self.stages)
        has_last = any(st.is_last for st in self.stages)
        losses: list = []
        step_args = (index,) if has_first else ()
        run = self.schedule.step if backward else self.schedule.eval
        mine = [st.sg.index for st in self.stages]
        with waiting_for(
            f"the pipeline schedule of stage(s) {mine} (pp rank {self.pp_rank} of {self.pp}): a "
            f"send or receive of activations or gradients between neighbouring stages"
        ):
            run(
                *step_args,
                target=index if has_last else None,
                losses=losses if has_last else None,
                return_outputs=False,
            )
        # loss sum and weight sum over the last stage's data axis, then from the last stage to every stage
        del losses  # scaled: the last stage kept the sums
        totals = torch.zeros(2, dtype=torch.float64, device=self.device_type)
        if has_last:
            last = next(st for st in self.stages if st.is_last)
            totals[0] = torch.stack(last.sums).sum() if last.sums else 0.0
            totals[1] = sum(last.weights)
            last.sums = []
            if self.dp > 1:
                with waiting_for(self._dp_words()):
                    totals = compat.funcol_all_reduce(totals, self.mesh.get_group("dp"))
                    totals = totals.wait() if hasattr(totals, "wait") else totals
        last_rank = dist.get_global_rank(self.pp_group, self.pp - 1)
        with waiting_for(f"the broadcast of the loss from the last stage (rank {last_rank}) over the pp axis"):
            dist.broadcast(totals, src=last_rank, group=self.pp_group)
        return float(totals[0]), float(totals[1])

    def _forward_backward(self, micro: list[tuple]) -> tuple[float, float]:
        self._arm()
        self._gather_split()
        try:
            loss_sum, weight = self._run_schedule(micro, backward=True)
        finally:
            self._holding = False
            self._drop_whole_weights()
        self._launch_rest()  # without overlap every bucket goes out here; with it, those no stage reported
        self._finish_reductions()
        self._sum_tied()
        return loss_sum, weight

    def compile_graphs(self, mode: str) -> None:
        self._compile_mode = mode
        for st in self.stages:
            st.train_interp.compile(mode)
            st.eval_interp.compile(mode)

    def _loss_shards(self) -> int:
        return self.dp * self.num_microbatches  # each rank's last stage runs its rows on local tensors

    def _scale_gradients(self, weight: float, scale: float) -> None:
        """Divide the gradients (of the loss summed over ranks and micro-batches) by the weight and the loss scale."""
        divisor = (weight if weight > 0 else 1.0) * scale
        if divisor != 1.0:
            for g in self._gradients():
                g.div_(divisor)

    def _gradient_shares(self) -> list[tuple[torch.Tensor, int]]:
        stages = {name: len(devices) for names, _, devices in self._tie_groups for name in names}
        out = []
        for key in self._param_names:
            grad, pl = self._shard[key].grad, self._placements[key]
            if grad is not None:
                out.append((grad, (self.dp if pl[0] == R else 1) * (self.tp if pl[1] == R else 1) * stages.get(key, 1)))
        return out

    def _evaluate(self, micro: list[tuple]) -> float:
        loss_sum, weight = self._run_schedule(micro, backward=False)
        return loss_sum / weight if weight > 0 else loss_sum / len(micro)

    def forward(self, *args, **kwargs):
        """The loss of a global batch, as `eval_step` computes it (a pipeline's outputs stay on its last stage)."""
        return self.eval_step(*args, **kwargs)

    # ---------------------------------------------------------------------------------- states

    def _full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter on every rank (each stage block contributes its own)."""
        mine = {}
        for fqn in self._param_names:
            shape = self._shapes[fqn]
            dt = DTensor.from_local(
                self._shard[fqn].detach(),
                self.mesh,
                self._placements[fqn],
                run_check=False,
                shape=torch.Size(shape),
                stride=contiguous_stride(shape),
            )
            with waiting_for(f"the all-gather of {fqn}'s shards within its stage for state_dict"):
                full = dt.full_tensor().cpu()
            if self.mesh.get_local_rank("dp") == 0 and self.mesh.get_local_rank("tp") == 0:
                mine[fqn] = full
        gathered: list = [None] * dist.get_world_size()
        with waiting_for("the gather of every stage's parameters for state_dict"):
            dist.all_gather_object(gathered, mine)
        params = {}
        for part in gathered:
            params.update(part)
        return params

    def _named_buffers(self) -> dict[str, torch.Tensor]:
        return self._buffers

    def after_checkpoint_load(self) -> None:
        self._run_buffers = {k: self.in_compute_format(b) for k, b in self._buffers.items()}  # buffers just read

    def checkpoint_masters(self) -> dict:
        return {
            n: dtensor_piece(
                self._shard[n].detach(), self._shapes[n], self.mesh, self._placements[n], param=self._shard[n]
            )
            for n in self._param_names
        }
