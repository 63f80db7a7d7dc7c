"""The sharded program's overlap of gradient reductions with backward, and its prefetch of gathers.

Overlap (`plan.overlap`, with more than one rank on the data axis): gradients of dp-replicated parameters stay
partial sums on this rank (no collective in backward), and a parameter split over the data axis (ZeRO >= 1) is
gathered by `_DeferredGather`, whose backward hands the full, partial gradient to the program instead of
reduce-scattering it. A parameter's gradient is complete in a micro-batch's backward when its last use has been
differentiated (a post-accumulate hook for the replicated ones, a count of forward gathers for the split ones); the
parameters go into buckets in the order backward produces their gradients (`autopar.runtime.overlap`), and a
bucket's all-reduce or reduce-scatter is issued as soon as its last gradient is in, while backward goes on. Which
micro-batches' backwards issue them:

- the dp-replicated parameters' all-reduce buckets: the last one's (earlier ones leave partial sums in `.grad`);
- ZeRO-1's reduce-scatter buckets: the last one's; earlier ones accumulate each split parameter's whole gradient
  in fp32 on this rank (what ZeRO-1 holds anyway), and the last one's bucket sends the sum;
- ZeRO-2/3's reduce-scatter buckets: every one's, as FSDP does. A split parameter's gradient goes straight into
  its bucket's send buffer (in the compute format; the buffer is made with the bucket's first gradient and freed
  when its collective is done), so whole gradients live only there; at most `overlap.WINDOW` buckets are in
  flight (launching another first waits for the oldest and adds its pieces into the shards' `.grad`, this rank's
  fp32 accumulators over the micro-batches).

Each micro-batch's end issues the buckets its backward left unfilled (a parameter without a gradient) and waits
for every bucket it launched, so the optimizer (after the last) sees complete gradients.

Prefetch (`plan.prefetch_depth` d > 0, with overlap): the split parameters are gathered a layer group at a time
(`autopar.runtime.layer_gather`: one all-gather per group, in the order the graph first reads them). When the
forward gathers the first parameter of a group, it issues the asynchronous gathers of the next d groups; a
parameter's next gather then takes its prefetched whole instead of starting its own, so the number of gathers is
unchanged: one per group and pass. The backward gathers layers again in the reverse order (a recompute's segments,
a ZeRO-3 weight released after the forward): there the first gather of a group issues those of the d previous ones
(of the parameters a recompute or a released weight will need). At most d groups' gathered parameters are in
flight beyond the one being used: the plan's memory counts them.

`GradientOverlap` holds the buckets, the prefetch groups and the per-step state for
`autopar.runtime.sharded.ShardedProgram`, which calls `_setup_overlap` at construction and `_arm` and
`_finish_micro_batch` around each micro-batch's backward.
"""

from __future__ import annotations

import torch

from autopar.program_comm import gradient_order
from autopar.runtime import overlap


class _DeferredGather(torch.autograd.Function):
    """A data-axis piece of a parameter gathered whole; its backward hands the gradient (a partial sum over the
    data axis) to the program, which reduce-scatters it in a bucket, and returns none to the piece."""

    @staticmethod
    def forward(ctx, local, program, index):
        ctx.program, ctx.index = program, index
        return program._gather_now(index, local)

    @staticmethod
    def backward(ctx, grad):
        ctx.program._full_grad(ctx.index, grad)
        return None, None, None


class GradientOverlap:
    """The overlap of a `ShardedProgram` (a mixin of it: see the module docstring)."""

    def _setup_overlap(self, placeholders: list[str], kinds) -> None:
        """Buckets over the trainable parameters in the order backward completes their gradients
        (`gradient_order`), hooks on the replicated ones, and the per-step state."""
        n = len(self._param_names)
        names = [p for p, kind in zip(placeholders, kinds, strict=True) if kind == "param"]
        order = [
            self._index_of[p]
            for p in gradient_order(self.traced.graph_module.graph, names)
            if self.shards[self._index_of[p]].requires_grad
        ]
        sizes = []
        for i in order:
            dtype = self.shards[i].dtype
            if self._split_dim[i] is not None:  # reduce-scattered in the compute format (as priced)
                kind, dtype = "reduce_scatter", self.compute_dtype or dtype
            else:
                kind, dtype = "all_reduce", self.compute_dtype if self.reduce_in_compute else dtype
            local = self.shards[i].numel() * (self.data_ranks if self._split_dim[i] is not None else 1)
            sizes.append((local * dtype.itemsize, kind, dtype))
        self._buckets = overlap.make_buckets(sizes, overlap.BUCKET_BYTES)
        for bucket in self._buckets:
            bucket.members = [order[j] for j in bucket.members]
        self._per_micro = self.comm.reduces_every_microbatch  # reduce-scatter buckets from every micro-batch's backward
        if self._per_micro:  # gradients go straight into their bucket's send buffer: its members' whole shapes
            whole = {}
            for i in order:
                if self._split_dim[i] is not None:
                    shape = list(self.shards[i].shape)
                    shape[self._split_dim[i]] = self._shapes[i][self._split_dim[i]]
                    whole[i] = torch.Size(shape)
            for bucket in self._buckets:
                if bucket.kind == "reduce_scatter":
                    overlap.lay_out(bucket, whole, self._split_dim, self.data_ranks)
        self._bucket_of = {i: b for b, bucket in enumerate(self._buckets) for i in bucket.members}
        for i in order:
            if self._split_dim[i] is None:
                self.shards[i].register_post_accumulate_grad_hook(lambda _, i=i: self._grad_ready(i))
        self._launched: list[int] = []  # buckets launched in this micro-batch's backward
        self._in_flight: list[int] = []  # reduce-scatter buckets launched and not yet waited for, oldest first
        self._setup_prefetch()
        self._uses = [0] * n  # forward gathers of a split parameter not yet differentiated
        # whole gradients of split parameters, this rank's sums (until their bucket is launched)
        self._full: list[torch.Tensor | None] = [None] * n

    def _setup_prefetch(self) -> None:
        """The prefetch depth and the per-step state of the prefetch (the layer groups: `LayerGathers`)."""
        self.prefetch_depth = self.comm.prefetch_depth
        self._ahead_done: set[int] = set()  # groups whose backward gathers have issued the previous groups'

    def _prefetch_after(self, i: int) -> None:
        """Parameter i is being gathered, the first of its group in this forward (in this backward, the first of the
        group gathered again, in whatever order the backward needs them): issue the gathers of the next groups (in
        backward the previous ones: the parameters a recompute or a released saved weight will need)."""
        g = self._group_of.get(i)
        if not self.prefetch_depth or g is None:
            return
        if self._in_backward:
            if g in self._ahead_done:
                return
            self._ahead_done.add(g)
        elif self._groups[g][0] != i:
            return
        step = -1 if self._in_backward else 1
        for k in range(1, self.prefetch_depth + 1):
            h = g + step * k
            if not 0 <= h < len(self._groups):
                break
            members = self._group_members(h)
            if members:
                self._issue_gather(members, "prefetch", async_op=True)

    def _gather(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """The graph's gather of a parameter split over the data axis: deferred reduce-scatter."""
        if not local.requires_grad or not torch.is_grad_enabled():
            return self._gather_sync(i, local)
        if not self._in_backward:  # a recompute in backward gathers again but adds no gradient
            self._uses[i] += 1
        full = _DeferredGather.apply(local, self, i)
        self._released(i, full, self._sources[i])
        return full

    def _gather_now(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """Parameter i whole on the data axis: from its group's gather (issued ahead, or now); then the gathers of the
        next groups go out, while this one's layer computes. ZeRO-1 and 2 gather a weight once a step and keep it."""
        held = self._held.get(i)
        if held is not None:
            return held.detach()
        full = self._whole(i, local)
        self._record("gathered", self._param_names[i])
        if self._hold:
            self._held[i] = full.detach()
        self._prefetch_after(i)
        return full

    def _full_grad(self, i: int, grad: torch.Tensor) -> None:
        """One use's gradient of split parameter i; the last use's makes it ready. At ZeRO-1 accumulated whole in its
        master's format (summed over the micro-batches); at ZeRO-2/3 written (added, for a next use) into its
        bucket's send buffer, in the format the bucket sends, the only whole copy the program keeps."""
        if self._per_micro:
            bucket = self._buckets[self._bucket_of[i]]
            overlap.put_gradient(bucket, i, grad, self._split_dim[i], self.data_ranks)
            self._uses[i] -= 1
            if self._uses[i] == 0:
                self._grad_ready(i)
            return
        dtype = self.shards[i].dtype
        if self._full[i] is None:
            self._full[i] = grad.to(dtype, copy=True)
        else:
            self._full[i].add_(grad.to(dtype))
        self._uses[i] -= 1
        if self._uses[i] == 0:
            self._grad_ready(i)

    def _grad_ready(self, i: int) -> None:
        """Parameter i's gradient is complete: if this micro-batch's backward launches its bucket, the bucket goes
        out when it was the last."""
        b = self._bucket_of[i]
        bucket = self._buckets[b]
        if not bucket.armed:
            return
        self._record("grad", self._param_names[i])
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(b)

    def _launch(self, b: int) -> None:
        """Issue bucket b's collective. ZeRO-1 packs its members' whole gradients into the bucket's send buffer and
        drops them; at ZeRO-2/3 the send buffer is filled already, and at most `overlap.WINDOW` buckets are in flight
        (the oldest is waited for, and its pieces added to the shards' gradients, before another goes out)."""
        bucket = self._buckets[b]
        if bucket.kind == "all_reduce":
            self._record(bucket.kind, b)
            self._launched.append(b)
            overlap.launch_all_reduce(bucket, [p.grad for p in self.shards], self._dp_group)
            return
        while self._per_micro and len(self._in_flight) >= overlap.WINDOW:
            self._settle_oldest()
        self._record(bucket.kind, b)
        self._launched.append(b)
        if self._per_micro:
            overlap.launch_packed(bucket, self._dp_group)
        else:
            overlap.launch_reduce_scatter(bucket, self._full, self._split_dim, self._dp_group)
            for i in bucket.members:
                self._full[i] = None
        self._in_flight.append(b)

    def _settle_oldest(self) -> None:
        """Wait for the oldest reduce-scatter bucket in flight and add its pieces into the shards' gradients (this
        rank's fp32 accumulators, summed over micro-batches)."""
        b = self._in_flight.pop(0)
        pieces: list[torch.Tensor | None] = [None] * len(self.shards)
        overlap.finish_reduce_scatter(self._buckets[b], self._split_dim, self._dp_group, pieces)
        self._record("waited", b)
        for shard, piece in zip(self.shards, pieces, strict=True):
            if piece is None:
                continue
            if shard.grad is None:
                shard.grad = piece.to(shard.dtype)
            else:
                shard.grad.add_(piece)

    def _arm(self, last: bool) -> None:
        """Before a micro-batch's backward: the buckets it launches await all their gradients. Every bucket on the
        last micro-batch; at ZeRO-2/3 the reduce-scatter buckets on every one (ZeRO-1 accumulates whole gradients,
        what it holds anyway, and reduces them once; dp-replicated gradients stay partial until the last)."""
        self._launched = []
        self._ahead_done.clear()
        for bucket in self._buckets:
            bucket.armed = last or (self._per_micro and bucket.kind == "reduce_scatter")
            bucket.pending = len(bucket.members)

    def _finish_micro_batch(self, last: bool) -> None:
        """After a micro-batch's backward: issue the armed buckets backward left unfilled (a parameter without a
        gradient) and wait for every bucket launched; after the last, forget the step's gathers and counts."""
        for b, bucket in enumerate(self._buckets):
            if bucket.armed and b not in self._launched:
                self._launch(b)
            bucket.armed = False
        if self._launched:
            self._record("wait", len(self._launched))
        grads = [p.grad for p in self.shards]
        for b in self._launched:
            if self._buckets[b].kind == "all_reduce":
                overlap.finish_all_reduce(self._buckets[b], grads)
        while self._in_flight:
            self._settle_oldest()
        self._launched = []
        self._handles.clear()  # saved weights of this micro-batch the backward did not need
        self._regathered.clear()
        if last:
            self._full = [None] * len(self.shards)
            self._uses = [0] * len(self.shards)
            self._drop_prefetched()
            self._forget_gathers()


__all__ = ["GradientOverlap"]
