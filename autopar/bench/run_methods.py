"""The methods `autopar bench run` trains a model with: autopar (free, or with part of its plan pinned) and
PyTorch's own APIs configured by hand.

- `autopar`: `autopar.compile` with the plan the suite priced (or planned on the ranks), then `train_step`;
  `autopar-dp` pins data parallelism over every rank (ZeRO-0: the data-parallel program), `autopar-zero3`
  ZeRO stage 3 over every rank, `autopar-dp-no-overlap` the data-parallel program with its gradient
  all-reduces after backward instead of launched from it; `autopar-offload` pins host offload (the offload
  program: ZeRO-3 over chunks, optimizer states on the host) and `autopar-offload-no-overlap` the same with
  each chunk gathered where it is used and each reduce-scatter waited where it is issued; `autopar-pp-zero1` pins
  two pipeline stages with ZeRO-1 over the other axis (cpu:4 gives it one), 1F1B over two micro-batches, whose
  weights are gathered and gradients reduce-scattered once a step, and `autopar-pp-zero1-no-overlap` the same
  layout gathering and reduce-scattering for every micro-batch.
- `autopar-zero1`, `autopar-tp`, `autopar-pp`: ZeRO-1 over every rank, the tensor axis over every rank, two
  pipeline stages (1F1B over two micro-batches): the program kinds `autopar bench overhead` times.
- `eager`: the model in one process on the rank's slice, no collective (eager PyTorch's host time).
- `ddp`: `DistributedDataParallel` as users run it (25 MiB buckets whose all-reduces start from backward).
- `fsdp2`: `fully_shard` per decoder block, then the whole model.
- `tp`, for LLaMA: `parallelize_module` with Megatron's column-wise q/k/v and gate/up projections, row-wise o
  and down projections. GPT-2 gets no tensor-parallel baseline: its projections are `Conv1D` modules (weights
  stored transposed, which `ColwiseParallel`/`RowwiseParallel` do not accept) and its attention fuses q, k and
  v into one `c_attn` whose column split would cut across q, k and v.

Every method's `step()` runs one optimizer step on the global batch (DDP and FSDP2 ranks take their slice,
tensor-parallel ranks the whole batch, autopar takes its own share).
"""

from __future__ import annotations

import time

import torch

from autopar.errors import ConfigError
from autopar.rationale import COMM_TERMS

LR = 1e-3
# name -> how it is built over the parameters; "sgd" (momentum 0.9) for models whose AdamW step would dominate
# a CPU step and hide what else the methods differ in
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=LR),
    "sgd": lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9),
}


def make_optimizer(params, kind: str = "adamw"):
    """The optimizer `kind` (a key of `OPTIMIZERS`) over `params`."""
    return OPTIMIZERS[kind](params)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state_bytes(params, optimizer) -> int:
    """Bytes of this rank's parameter shards, their gradients and the optimizer's states."""
    total = 0
    for p in params:
        total += _local(p).nbytes
        if p.grad is not None:
            total += _local(p.grad).nbytes
    for state in optimizer.state.values():
        total += sum(_local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
    return total


def _chunk_state_bytes(store) -> int:
    """Bytes of this rank's chunk shards: master weights, gradients and the optimizer's two moments."""
    return sum(t.nbytes for c in store.chunks for t in (c.master, c.grad, c.exp_avg, c.exp_avg_sq) if t is not None)


class Method:
    """A model prepared for one method; `step()` runs one optimizer step on the global batch and sets `last_loss`."""

    name = ""

    @staticmethod
    def skip_reason(optimizer: str) -> str | None:  # noqa: ARG004 - the signature the methods share
        """Why the method cannot train a model with `optimizer` (a key of `OPTIMIZERS`); None where it can."""
        return None

    def __init__(self, model, ids, rank, world, *, optimizer: str = "adamw"):
        self.ids, self.rank, self.world = ids, rank, world
        self.optimizer_kind = optimizer
        self.model = model
        self.optimizer = None
        self.setup_time_s = 0.0
        self.last_loss = float("nan")

    def _slice(self):
        n = self.ids.shape[0] // self.world
        return self.ids[self.rank * n : (self.rank + 1) * n]

    def _torch_step(self, ids):
        loss = self.model(ids, labels=ids).loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss

    def state_bytes(self) -> int:
        return _state_bytes(list(self.model.parameters()), self.optimizer)

    def extra(self) -> dict:
        return {}


class _Autopar(Method):
    """autopar's own plan; the variants below pin part of it (`constraints`)."""

    name = "autopar"

    @staticmethod
    def constraints(world: int) -> dict | None:
        """What the method pins of the plan on `world` ranks (None: the free search)."""
        return None

    @staticmethod
    def plan_options() -> dict:
        """Other `autopar.plan` settings the method pins (offload=, say)."""
        return {}

    def __init__(self, model, ids, rank, world, *, optimizer: str = "adamw", plan_json: str | None = None):
        import autopar

        super().__init__(model, ids, rank, world, optimizer=optimizer)
        t0 = time.perf_counter()
        plan = autopar.Plan.from_json(plan_json) if plan_json else None
        cluster = plan.cluster if plan is not None else f"cpu:{world}"
        self.pm = autopar.compile(
            model,
            cluster,
            example_inputs=(ids,),
            example_kwargs={"labels": ids},
            optimizer=OPTIMIZERS[optimizer],
            plan=plan,
            constraints=None if plan is not None else self.constraints(world),
            **({} if plan is not None else self.plan_options()),
        )
        self.setup_time_s = time.perf_counter() - t0
        self.optimizer = self.pm.optimizer

    def step(self):
        self.last_loss = self.pm.train_step(self.ids, labels=self.ids)

    def state_bytes(self) -> int:
        store = getattr(self.pm, "store", None)  # the offload program keeps its states in chunks
        if store is not None:
            return _chunk_state_bytes(store)
        return _state_bytes(list(self.pm.parameters()), self.optimizer)

    def extra(self) -> dict:
        plan = self.pm.plan
        pred = plan.predicted
        return {
            "predicted_step_time_s": pred.step_time_s,
            "mesh": dict(plan.mesh),
            "zero_stage": plan.zero_stage,
            "program": str(plan.program),
            "predicted_breakdown_s": {
                "compute": pred.compute_s,
                "reshard": pred.reshard_s,
                "grad_sync": pred.grad_sync_s,
                "optimizer": pred.optimizer_s,
                "offload": pred.offload_s,
            },
            "predicted_exposed_comm_s": sum(plan.time_breakdown.get(k, 0.0) for k in COMM_TERMS),
            "predicted_hidden_comm_s": sum(plan.hidden_communication.values()),
            "overlap": plan.overlap,
            "plan_stats": dict(plan.stats),
        }


class _AutoparDP(_Autopar):
    name = "autopar-dp"

    @staticmethod
    def constraints(world: int) -> dict | None:
        return {"dp": world, "zero": 0}


class _AutoparZero3(_Autopar):
    name = "autopar-zero3"

    @staticmethod
    def constraints(world: int) -> dict | None:
        return {"dp": world, "zero": 3}


class _AutoparZero1(_Autopar):
    name = "autopar-zero1"

    @staticmethod
    def constraints(world: int) -> dict | None:
        return {"dp": world, "tp": 1, "zero": 1}


class _AutoparTP(_Autopar):
    """The tensor axis over every rank (the sharded program's tensor-parallel path)."""

    name = "autopar-tp"

    @staticmethod
    def constraints(world: int) -> dict | None:
        return {"dp": 1, "tp": world}


class _AutoparPipeline(_Autopar):
    """Two pipeline stages (data parallelism over the rest), 1F1B over two micro-batches."""

    name = "autopar-pp"

    @staticmethod
    def constraints(world: int) -> dict | None:
        return {"pp": 2, "dp": world // 2, "tp": 1, "schedule": "1f1b", "num_microbatches": 2}


class _AutoparDPNoOverlap(_Autopar):
    name = "autopar-dp-no-overlap"

    @staticmethod
    def constraints(world: int) -> dict | None:
        return {"dp": world, "zero": 0, "overlap": False}


class _AutoparPipelineZero1(_Autopar):
    """Two pipeline stages, ZeRO-1 over the rest of the ranks (a data axis from cpu:4 on): each weight gathered and
    its gradients reduce-scattered once a step."""

    name = "autopar-pp-zero1"

    @staticmethod
    def constraints(world: int) -> dict | None:
        # schedule and micro-batches pinned too, so that both variants run the same layout (unpinned, the search
        # accumulates more micro-batches where they cost no extra collectives, and picks another schedule)
        return {"pp": 2, "dp": world // 2, "tp": 1, "zero": 1, "schedule": "1f1b", "num_microbatches": 2}


class _AutoparPipelineZero1NoOverlap(_AutoparPipelineZero1):
    """The same layout without overlap: weights gathered, and gradients reduce-scattered, for every micro-batch."""

    name = "autopar-pp-zero1-no-overlap"

    @staticmethod
    def constraints(world: int) -> dict | None:
        return {**_AutoparPipelineZero1.constraints(world), "overlap": False}


class _AutoparOffload(_Autopar):
    name = "autopar-offload"

    @staticmethod
    def constraints(world: int) -> dict | None:
        return {"dp": world, "tp": 1}

    @staticmethod
    def plan_options() -> dict:
        return {"offload": True}

    @staticmethod
    def skip_reason(optimizer: str) -> str | None:
        if optimizer == "adamw":
            return None
        return f"the offload program trains with AdamW over chunks; this model trains with {optimizer}"


class _AutoparOffloadNoOverlap(_AutoparOffload):
    name = "autopar-offload-no-overlap"

    @staticmethod
    def constraints(world: int) -> dict | None:
        return {"dp": world, "tp": 1, "overlap": False}


class _Eager(Method):
    """The model in one process on this rank's slice, no collective: eager PyTorch's own host time."""

    name = "eager"

    def __init__(self, model, ids, rank, world, *, optimizer: str = "adamw"):
        super().__init__(model, ids, rank, world, optimizer=optimizer)
        self.optimizer = make_optimizer(model.parameters(), optimizer)

    def step(self):
        self.last_loss = self._torch_step(self._slice()).item()


class _DDP(Method):
    name = "ddp"

    def __init__(self, model, ids, rank, world, *, optimizer: str = "adamw"):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(model, ids, rank, world, optimizer=optimizer)
        t0 = time.perf_counter()
        # as users run it: 25 MiB buckets whose all-reduces start from backward hooks
        self.model = DistributedDataParallel(model)
        self.optimizer = make_optimizer(self.model.parameters(), optimizer)
        self.setup_time_s = time.perf_counter() - t0

    def step(self):
        self.last_loss = self._torch_step(self._slice()).item()


class _FSDP2(Method):
    name = "fsdp2"

    def __init__(self, model, ids, rank, world, *, optimizer: str = "adamw"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        super().__init__(model, ids, rank, world, optimizer=optimizer)
        t0 = time.perf_counter()
        mesh = init_device_mesh("cpu", (world,))
        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.optimizer = make_optimizer(model.parameters(), optimizer)
        self.setup_time_s = time.perf_counter() - t0

    def step(self):
        # The loss is this rank's slice; the mean over ranks is the global batch's loss.
        self.last_loss = self._torch_step(self._slice()).item()


class _TensorParallel(Method):
    name = "tp"

    def __init__(self, model, ids, rank, world, *, optimizer: str = "adamw"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        super().__init__(model, ids, rank, world, optimizer=optimizer)
        t0 = time.perf_counter()
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, megatron_tp_plan(model))
        self.optimizer = make_optimizer(model.parameters(), optimizer)
        self.setup_time_s = time.perf_counter() - t0

    def step(self):
        self.last_loss = self._torch_step(self.ids).item()


def _blocks(model) -> list:
    if hasattr(model, "model") and hasattr(model.model, "layers"):
        return list(model.model.layers)
    return list(model.transformer.h)


def megatron_tp_plan(model) -> dict:
    """Column-wise q/k/v and gate/up, row-wise o and down, in every LLaMA decoder block."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{prefix}.{name}"] = RowwiseParallel()
    return plan


def tp_skip_reason(config, world: int) -> str | None:
    """Why the hand-written tensor-parallel baseline does not apply to this model, or None."""
    if config.model_type != "llama":
        return (
            "GPT-2's Conv1D projections (transposed weights) and fused q/k/v projection do not fit "
            "ColwiseParallel/RowwiseParallel"
        )
    for attr in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(config, attr) % world:
            return f"{attr}={getattr(config, attr)} does not divide over {world} ranks"
    return None


METHODS = {
    m.name: m
    for m in (
        _Autopar,
        _AutoparDP,
        _AutoparZero3,
        _AutoparDPNoOverlap,
        _AutoparZero1,
        _AutoparTP,
        _AutoparPipeline,
        _AutoparOffload,
        _AutoparOffloadNoOverlap,
        _AutoparPipelineZero1,
        _AutoparPipelineZero1NoOverlap,
        _Eager,
        _DDP,
        _FSDP2,
        _TensorParallel,
    )
}
# what a run measures unless told (`--methods`)
DEFAULT_METHODS = ("autopar", "ddp", "fsdp2", "tp")
BASELINES = ("ddp", "fsdp2", "tp")
# (autopar method, what it is compared with on the same layout: the PyTorch baseline, or the same program without
# overlap): their paired ratio is reported
PAIRS = (
    ("autopar-dp", "ddp"),
    ("autopar-zero3", "fsdp2"),
    ("autopar-offload", "autopar-offload-no-overlap"),
    ("autopar-pp-zero1", "autopar-pp-zero1-no-overlap"),
)


def is_autopar(method: str) -> bool:
    return issubclass(METHODS[method], _Autopar)


def select(names, table: dict, what: str) -> tuple:
    """The entries of `table` named in `names` (comma-separated text or a sequence), in the order given; a
    ConfigError names an unknown one and lists the known."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown or not names:
        raise ConfigError(
            f"unknown {what} {', '.join(map(repr, unknown)) or '(none given)'}: expected a "
            f"comma-separated list of {', '.join(table)}"
        )
    return tuple(table[n] for n in dict.fromkeys(names))
