"""The reductions of a pipeline program's step over the data axis, and its ZeRO-1 weights gathered once a step.

`StepReductions` holds, for `autopar.runtime.pipeline.PipelineProgram` (whose module docstring tells the whole
story, under "Overlap"), the step's gathers of the ZeRO-1 split weights, their fp32 gradient sums, the buckets of
the dp all-reduces and reduce-scatters launched as the backward completes them, and the sums of tied parameters
over the stages that hold them.
"""

from __future__ import annotations

import collections
import math

import torch
from torch.distributed.tensor import Replicate

from autopar.program_comm import gradient_order
from autopar.runtime import overlap
from autopar.runtime.base import sum_in_buckets
from autopar.runtime.collectives import waiting_for

R = Replicate()


class WholeWeight(torch.autograd.Function):
    """A ZeRO-1 parameter whole on the data axis, gathered once a step (`StepReductions._whole`). Its backward
    adds the gradient (this rank's partial sum over dp) to the program's fp32 sum for the step and gives the
    master shard none: the step reduce-scatters the sums once, after the last backward."""

    @staticmethod
    def forward(ctx, shard, program, key):
        ctx.program, ctx.key = program, key
        return program._whole(key)

    @staticmethod
    def backward(ctx, grad):
        ctx.program._add_whole_grad(ctx.key, grad)
        return None, None, None


class StepReductions:
    """The step's reductions over dp and its ZeRO-1 weights of a `PipelineProgram` (a mixin of it: see the module
    docstring)."""

    def _setup_reductions(self) -> None:
        """The step's ZeRO-1 gathers and its reductions over dp: the split weights' order, the buckets, the
        gradient hooks that launch them (called once the stages are built)."""
        # the step's ZeRO-1 gathers in flight, whole weights and fp32 gradient sums
        self._split_order = list(
            dict.fromkeys(
                key
                for st in sorted(self.stages, key=lambda st: st.sg.index)
                for name in st.sg.placeholders
                for kind, key in (self._kind[name],)
                if kind == "param" and key in self._step_split
            )
        )
        self._gathering: dict[str, tuple] = {}
        self._whole_weights: dict[str, torch.Tensor] = {}
        self._whole_grads: dict[str, torch.Tensor] = {}
        self._holding = False  # a training step's schedule runs: split weights are read whole
        # the step's reductions over dp, in buckets (`_make_buckets`), each launched once its gradients are in
        self._reduced, self._dims, self._buckets = self._make_buckets()
        self._bucket_of = {self._reduced[i]: b for b, bucket in enumerate(self._buckets) for i in bucket.members}
        # key -> this rank's stages that read it
        self._readers = collections.Counter(
            self._kind[name][1] for st in self.stages for name in st.sg.placeholders if self.is_param(name)
        )
        self._left: dict[str, int] | None = None  # gradients each member still awaits this step (None: not armed)
        self._launched: list[int] = []  # buckets launched this step, in launch order
        self._stages_done: set[int] = set()  # stages whose last backward of this step has run
        for key in self._reduced:
            if self._placements[key][0] == R:  # a split weight's gradients come through `_add_whole_grad`
                self._shard[key].register_post_accumulate_grad_hook(lambda _, key=key: self._gradient_done(key))

    def _stage_backward_done(self, stage_index: int) -> None:
        """The schedule ran stage `stage_index`'s last backward of the step: once every stage of this rank has,
        launch the buckets its backward left unlaunched (a member that got no gradient), so they run while other
        stages still run backward."""
        if self._left is None:
            return
        self._stages_done.add(stage_index)
        if len(self._stages_done) == len(self.stages):
            self._launch_rest()

    def _split_words(self, what: str) -> str:
        return f"the {what} of the ZeRO-1 weights of stage block {self.pp_rank} over the data axis"

    def _gather_split(self) -> None:
        """Issue the step's gathers of the split weights, in the order the stages read them; the schedule reads
        them whole (`placeholder_value`), each waited on where a forward first reads it."""
        self._holding = bool(self._step_split)
        group = self.mesh.get_group("dp")
        with waiting_for(self._split_words("all-gather")):
            for key in self._split_order:
                d = self._placements[key][0].dim
                local = self.in_compute_format(self._shard[key].detach())
                self._record("gather", key)
                self._gathering[key] = overlap.split_gather(local, d, self._shapes[key][d], group, async_op=True)

    def _whole(self, key: str) -> torch.Tensor:
        """Split weight `key` whole on the data axis for this step (its gather waited on at the first read)."""
        held = self._whole_weights.get(key)
        if held is None:
            work, finish = self._gathering.pop(key)
            with waiting_for(self._split_words("all-gather")):
                work.wait()
            self._record("gathered", key)
            held = self._whole_weights[key] = finish()
        return held.detach()

    def _add_whole_grad(self, key: str, grad: torch.Tensor) -> None:
        """One micro-batch's gradient of split weight `key`, added to the step's sum in its master's format."""
        total = self._whole_grads.get(key)
        if total is None:
            self._whole_grads[key] = grad.to(self._shard[key].dtype, copy=True)
        else:
            total.add_(grad)
        self._gradient_done(key)

    def _drop_whole_weights(self) -> None:
        """After the schedule: wait for gathers no forward read (an error cut the step short) and free the whole
        weights."""
        with waiting_for(self._split_words("all-gather")):
            for work, _ in self._gathering.values():
                work.wait()
        self._gathering.clear()
        self._whole_weights.clear()

    # the reductions over dp: buckets launched as backward completes them (see the module docstring)

    def _make_buckets(self) -> tuple[list[str], list[int], list[overlap.Bucket]]:
        """(keys, their split dims, buckets) of the step's reductions over dp: the trainable dp-replicated
        parameters' gradients all-reduced, then the ZeRO-1 split weights' fp32 sums reduce-scattered (on dim
        `dims[i]`), each kind in buckets of about `overlap.BUCKET_BYTES` in the format it sends, filled in the
        order this rank's backward completes their gradients (`_backward_order`)."""
        order = [k for k in self._backward_order() if self._shard[k].requires_grad]
        replicated = set(self._dp_summed)
        keys = [k for k in order if k in replicated] + [k for k in order if k in self._step_split]
        sizes, dims = [], []
        for k in keys:
            split = k in self._step_split
            dtype = self.compute_dtype if split or self.reduce_in_compute else None
            dtype = dtype or self._shard[k].dtype
            d = self._placements[k][0].dim if split else -1
            numel = math.prod(self._whole_on_dp(k, d) if split else self._shard[k].shape)
            sizes.append((numel * dtype.itemsize, "reduce_scatter" if split else "all_reduce", dtype))
            dims.append(d)
        return keys, dims, overlap.make_buckets(sizes, overlap.BUCKET_BYTES)

    def _whole_on_dp(self, key: str, d: int) -> list[int]:
        """The shape of split weight `key` whole on the data axis (split on dim `d`), this rank's piece of a tensor
        axis."""
        shape = list(self._shard[key].shape)
        shape[d] = self._shapes[key][d]
        return shape

    def _backward_order(self) -> list[str]:
        """This rank's parameters in about the order the step's backward completes their gradients: its stages
        latest in the pipeline first (their last backward runs first), each stage's by `gradient_order`;
        a parameter several of its stages read where the earliest of them puts it (its gradient is complete last
        there)."""
        order = []
        for st in sorted(self.stages, key=lambda st: -st.sg.index):
            names = [n for n in st.sg.placeholders if self._kind[n][0] == "param"]
            order += [self._kind[n][1] for n in gradient_order(st.sg.graph_module.graph, names)]
        last = {key: i for i, key in enumerate(order)}
        return [key for i, key in enumerate(order) if last[key] == i]

    def _arm(self) -> None:
        """Before a training step's schedule: with overlap, each bucket launches once the step's last gradient of
        each member is in (a member's gradient comes once per micro-batch from each of this rank's stages that
        read it)."""
        self._launched, self._stages_done = [], set()
        if not self.plan.overlap:
            self._left = None
            return
        m = self.num_microbatches
        self._left = {k: m * self._readers[k] for k in self._reduced}
        for bucket in self._buckets:
            bucket.pending = len(bucket.members)

    def _gradient_done(self, key: str) -> None:
        """A gradient of `key` is in (accumulated, or added to its fp32 sum): launch its bucket if that was the
        last one the bucket awaited this step."""
        if self._left is None or key not in self._left:
            return
        self._left[key] -= 1
        if self._left[key] == 0:
            b = self._bucket_of[key]
            self._buckets[b].pending -= 1
            if self._buckets[b].pending == 0:
                self._launch_bucket(b)

    def _launch_rest(self) -> None:
        """Launch, in bucket order, the buckets not launched yet this step; disarm the gradient hooks."""
        self._left = None
        for b in range(len(self._buckets)):
            if b not in self._launched:
                self._launch_bucket(b)

    def _launch_bucket(self, b: int) -> None:
        """Start bucket `b`'s collective over dp: the all-reduce of its members' gradients (zeros where this rank's
        stages gave none: every rank sends the same members), or the reduce-scatter of their fp32 sums (freed once
        packed)."""
        bucket = self._buckets[b]
        group = self.mesh.get_group("dp")
        self._launched.append(b)
        self._record(bucket.kind, b)
        full: list = [None] * len(self._reduced)
        if bucket.kind == "all_reduce":
            for i, grad in zip(bucket.members, self._grads_of([self._reduced[i] for i in bucket.members]), strict=True):
                full[i] = grad
            with waiting_for(self._dp_words()):
                overlap.launch_all_reduce(bucket, full, group)
            return
        for i in bucket.members:
            k, d = self._reduced[i], self._dims[i]
            total = self._whole_grads.pop(k, None)
            full[i] = total if total is not None else self._shard[k].new_zeros(self._whole_on_dp(k, d))
        with waiting_for(self._split_words("reduce-scatter")):
            overlap.launch_reduce_scatter(bucket, full, self._dims, group)

    def _finish_reductions(self) -> None:
        """Wait for the step's buckets: an all-reduce's sums go back into its gradients, a reduce-scatter's piece
        of each member becomes its master shard's gradient."""
        group = self.mesh.get_group("dp")
        pieces: list = [None] * len(self._reduced)
        grads = [self._shard[k].grad for k in self._reduced]  # an all-reduce's members: given at its launch
        for b in self._launched:
            bucket = self._buckets[b]
            if bucket.kind == "all_reduce":
                with waiting_for(self._dp_words()):
                    overlap.finish_all_reduce(bucket, grads)
                continue
            with waiting_for(self._split_words("reduce-scatter")):
                overlap.finish_reduce_scatter(bucket, self._dims, group, pieces)
            for i in bucket.members:
                shard = self._shard[self._reduced[i]]
                piece = pieces[i].to(shard.dtype)
                shard.grad = piece if shard.grad is None else shard.grad.add_(piece)
        self._record("reduced", len(self._launched))
        self._launched = []

    def _dp_words(self) -> str:
        return f"the all-reduce of the dp-replicated gradients of stage block {self.pp_rank} over the data axis"

    def _grads_of(self, names: list[str]) -> list[torch.Tensor]:
        """The gradients of the trainable `names`, zeros where this rank's stages gave none: a collective over
        them then has the same members on every rank whatever the graph of each stage differentiated (a
        rank that skipped one would leave its peers waiting)."""
        out = []
        for fqn in names:
            shard = self._shard[fqn]
            if not shard.requires_grad:  # the same on every rank: the model's flag
                continue
            if shard.grad is None:
                shard.grad = torch.zeros_like(shard)
            out.append(shard.grad)
        return out

    def _sum_tied(self) -> None:
        """Sum the gradients of parameters held on several devices' stages over those devices, so the copies
        take the same step."""
        for names, group, devices in self._tie_groups:
            with waiting_for(f"the all-reduce tying {', '.join(names)} over the stages of pp ranks {list(devices)}"):
                sum_in_buckets(self._grads_of(names), group)


__all__ = ["StepReductions", "WholeWeight"]
