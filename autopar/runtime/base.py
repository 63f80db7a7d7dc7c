"""The program base: what every emitted program shares, written once.

A program is the parallel training job of one plan on this rank. Every program kind
(`autopar.plan.ProgramKind`) subclasses `Program` and says only what makes it different:

- the constructor signature `(model, plan, traced, cluster, *, optimizer)`: `traced` is the model traced
  once by `compile` at the shape the program runs (`Program.trace_parts`) and in the plan's compute
  format; a constructor does not trace, fuse or plan;
- the step template `train_step`: the global batch is cut into the plan's micro-batches (every rank passes
  the same batch, checked at the first step, or with `local_batch` its own rows: `autopar.data`; `rank_rows`
  takes this rank's share), the program runs forward and backward (`_forward_backward`, returning the loss
  sum and the weight it was summed with), the base divides the gradients by that weight and by the loss
  scale, and the step guard (`autopar.runtime.step_guard`: accumulation across calls, the global gradient
  norm, clipping, non-finite losses and gradients, fp16 overflows, `last_step`) steps the optimizer;
- `eval_step`: the loss of a global batch, no gradients, no optimizer state touched, dropout off;
- `state_dict()` / `load_state_dict()`: full tensors under the model's own (Hugging Face) names, tied
  names included, in the dtypes the model was handed in; `parameters()`: this rank's master shards.

Mixed precision (`plan.precision` "bf16"/"fp16"): the masters (what `parameters()` returns and the
optimizer updates, with its states) are fp32 whatever dtype the model was handed in; the graph computes
in the compute format, on copies cast from the masters (a differentiable cast, so gradients reach the
masters in fp32); gradients are reduced in the compute format, as the cost model prices them; fp16
multiplies the loss by a dynamic scale (`LossScaler`) and skips steps whose gradients overflow. "fp32"
runs the model in its own dtype.

The compute formats and the loss scale are in `autopar.runtime.precision`; the checkpoint methods every
program shares (saving, loading, the checkpoint protocol) in `autopar.runtime.program_checkpoints`.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopar.checkpoint import training
from autopar.checkpoint.peft import export_info as peft_export_info
from autopar.checkpoint.protocol import ModelNames
from autopar.cluster import ClusterSpec
from autopar.data import BatchFeed, PlanSampler, local_batch_size
from autopar.errors import ConfigError, LoweringError
from autopar.plan import Plan, ProgramKind
from autopar.runtime import exits
from autopar.runtime.collectives import collective_timeout
from autopar.runtime.precision import COMPUTE_DTYPES, LossScaler, compute_dtype  # noqa: F401 - importable from here
from autopar.runtime.program_checkpoints import ProgramCheckpoints
from autopar.runtime.shapes import Lengths, planned_length, shorter_length
from autopar.runtime.step_guard import StepGuard, StepStats
from autopar.trace import TracedModel
from autopar.units import BUCKET_BYTES

# what `compile(..., compile_mode=...)` accepts: torch.compile's modes
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compiled(gm, mode: str):
    """`gm` through `torch.compile` in `mode` (checked against `COMPILE_MODES`)."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"compile_mode={mode!r} is not a torch.compile mode; use one of {', '.join(COMPILE_MODES)}")
    return torch.compile(gm, mode=mode)


def ensure_process_group(cluster: ClusterSpec) -> None:
    """Join the process group torchrun set up (or a one-rank group), and check its size against the cluster."""
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            backend = "nccl" if cluster.device.kind == "gpu" else "gloo"
            dist.init_process_group(backend, timeout=collective_timeout(), **_attempt_store())
        elif cluster.world_size == 1:
            store = dist.HashStore()
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        else:
            raise LoweringError(
                f"the cluster has {cluster.world_size} devices but no process group is running: "
                f"launch with `torchrun --nproc_per_node {cluster.world_size} ...`"
            )
    if dist.get_world_size() != cluster.world_size:
        raise LoweringError(
            f"the process group has {dist.get_world_size()} ranks but the cluster "
            f"{cluster.describe()} has {cluster.world_size}; launch one rank per device"
        )


def _attempt_store() -> dict:
    """torchrun's store under a prefix of this attempt (empty outside torchrun): after a restart
    (`--max-restarts`) the store still holds the dead attempt's gloo addresses under the same keys, and a rank
    that read one would dial a dead peer."""
    env = os.environ
    if "TORCHELASTIC_RESTART_COUNT" not in env or "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return {}
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts the store; ranks are its clients
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world,
        is_master=not agent and rank == 0,
        timeout=collective_timeout(),
    )
    attempt = env["TORCHELASTIC_RESTART_COUNT"]
    return {"store": dist.PrefixStore(f"attempt{attempt}", store), "rank": rank, "world_size": world}


def device_type(cluster: ClusterSpec) -> str:
    """ "cuda" (this rank's GPU made current) for GPU clusters, "cpu" otherwise."""
    if cluster.device.kind == "gpu":
        if not torch.cuda.is_available():
            raise LoweringError(
                f"the cluster is {cluster.describe()} but this machine has no CUDA device; "
                f"plan for GPUs here, run on GPUs there, or compile for 'cpu:N'"
            )
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return "cuda"
    return "cpu"


def default_optimizer(params) -> torch.optim.Optimizer:
    """compile's optimizer when none is given: AdamW, lr 1e-3."""
    return torch.optim.AdamW(params, lr=1e-3)


def micro_batches(args, kwargs, batch: int, m: int) -> list[tuple]:
    """Cut a batch of `batch` rows into `m` micro-batches along dim 0 (every batch input alike), as (args, kwargs)."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    for t in flat:
        if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] != batch:
            raise ConfigError(
                f"the plan is for a global batch of {batch} but an input has {t.shape[0]} rows; "
                f"pass the batch the model was compiled for"
            )
    if m == 1:
        return [(tuple(args), dict(kwargs))]
    pieces = [t.chunk(m, dim=0) if isinstance(t, torch.Tensor) and t.ndim else [t] * m for t in flat]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(m)]


def input_signature(args, kwargs) -> dict:
    """{input name: (shape, dtype)} of a call's tensor inputs, {name: (None, type name)} of its other inputs: what
    `Program.check_inputs` compares (keywords in any order)."""
    leaves, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    return {
        _input_name(path): (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (None, type(v).__name__)
        for path, v in leaves
    }


def _input_name(path) -> str:
    """`args[0]` for a positional input, `labels` for a keyword one (and the key path below it)."""
    where = "args" if path[0].idx == 0 else ""
    rest = pytree.keystr(path[1:])
    return where + rest if where else rest.removeprefix("['").replace("']", "", 1)


def rank_rows(t, parts: int, index: int):
    """Rows `index` of `parts` equal shares of a batch tensor (a scalar or non-tensor as it is)."""
    if not isinstance(t, torch.Tensor) or not t.ndim or parts == 1:
        return t
    if t.shape[0] % parts:
        raise ConfigError(
            f"a batch of {t.shape[0]} rows does not divide over {parts} data-parallel ranks; "
            f"pass a global batch that is a multiple of {parts}"
        )
    return t.chunk(parts, dim=0)[index]


def call_spec(exported):
    """`exported.call_spec`, kept per program: torch builds a new NamedTuple class on every access (about a
    quarter of a millisecond, paid on every step of a small model otherwise)."""
    found = _CALL_SPECS.get(exported)
    if found is None:
        found = _CALL_SPECS[exported] = exported.call_spec
    return found


_CALL_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def flat_inputs(traced: TracedModel, args, kwargs) -> list:
    """The call's inputs flattened in placeholder order, checked against the structure the model was traced with."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    expected = call_spec(traced.exported).in_spec
    if expected is not None and spec != expected:
        raise ConfigError(
            f"the inputs do not have the structure the model was compiled with: expected {expected}, got {spec}"
        )
    return flat


def placeholder_values(traced: TracedModel, params, buffers, constant, inputs) -> list:
    """Values for the graph's placeholders in order, from parameters, buffers, `constant(name)` and user inputs."""
    params, buffers, inputs = iter(params), iter(buffers), iter(inputs)
    sig = traced.exported.graph_signature
    names = iter(spec.target for spec in sig.input_specs if spec.kind.name in ("CONSTANT_TENSOR", "CUSTOM_OBJ"))
    source = {"param": params, "buffer": buffers, "input": inputs}
    return [constant(next(names)) if kind == "constant" else next(source[kind]) for kind in traced.placeholder_kinds]


def sum_in_buckets(
    grads: list[torch.Tensor], group, bucket_bytes: int = BUCKET_BYTES, dtype: torch.dtype | None = None
) -> None:
    """All-reduce (sum) `grads` in place over `group`, packed into flat buckets of one dtype (sent in `dtype`
    when given)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in [*grads, None]:
        if bucket and (g is None or g.dtype != bucket[0].dtype or size >= bucket_bytes):
            flat = torch.cat([b.reshape(-1) for b in bucket])
            if dtype is not None and flat.dtype != dtype:
                sent = flat.to(dtype)
                dist.all_reduce(sent, group=group)
                flat = sent.to(flat.dtype)
            else:
                dist.all_reduce(flat, group=group)
            for b, piece in zip(bucket, flat.split([b.numel() for b in bucket]), strict=True):
                b.copy_(piece.view_as(b))
            bucket, size = [], 0
        if g is not None:
            bucket.append(g)
            size += g.numel() * g.element_size()


def check_scalar_loss(loss) -> None:
    """The model's first output must be a scalar loss."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise LoweringError("the model's first output is not a scalar loss: pass labels so the model computes one")


def _names(tensors) -> str:
    return ", ".join(tensors) or "no tensors"


class Program(ProgramCheckpoints, torch.nn.Module):
    """The parallel program of one plan on this rank (see the module docstring).

    Subclasses set `kind`, build their layout in `__init__` (after calling this one) and end it with
    `self._build_optimizer(masters)`; they implement `_forward_backward`, `_evaluate` and `_full_parameters`,
    and override `_zero_grads`, `_scale_gradients`, `_gradients` or `_optimizer_step` where they hold
    gradients their own way.
    """

    kind: ClassVar[ProgramKind]
    # the attributes that depend on the trace, kept per sequence length (`autopar.runtime.shapes`, `_bind_trace`);
    # none for a program that runs the model eagerly
    _per_length: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        model: torch.nn.Module,
        plan: Plan,
        traced: TracedModel | None,
        cluster: ClusterSpec,
        *,
        optimizer: Callable | None = None,
    ):
        super().__init__()
        if not self.runs(plan):
            raise LoweringError(f"a {plan.program} plan cannot run as the {self.kind} program")
        size = 1
        for v in plan.mesh.values():
            size *= v
        if size != cluster.world_size:
            raise LoweringError(f"plan mesh {plan.mesh} does not match the cluster's {cluster.world_size} devices")
        self.plan, self.cluster, self.traced = plan, cluster, traced
        self.device_type = device_type(cluster)
        self.compute_dtype = compute_dtype(plan.precision)
        # ZeRO-0 gradients all-reduced in the compute format (pinned) rather than in fp32
        self.reduce_in_compute = self.compute_dtype is not None and plan.grad_reduce != "fp32"
        self.scaler = LossScaler() if plan.precision == "fp16" else None
        state = model.state_dict(keep_vars=True)
        self._state_names = list(state)
        self._state_dtypes = {k: v.dtype for k, v in state.items()}
        self._aliases = dict(traced.param_aliases) if traced is not None else {}
        self._make_optimizer = optimizer or default_optimizer
        self.checkpoint_names = ModelNames.of(model)  # what checkpoints and Hugging Face weights key tensors by
        self.num_steps = 0
        # a list (a test sets one): (event, what) of the program's data-axis collectives, in the order they happen
        self.comm_events: list | None = None
        self._input_signature: dict | None = None  # set by `expect_inputs`
        self.lengths = Lengths(None)  # the sequence lengths run (`autopar.runtime.shapes`), from `expect_inputs`
        # the training loop around the graph (`configure_loop`): clipping and the non-finite policy, how batches
        # come in, the user's loss; what the last train_step did
        self.guard, self.feed, self.loss_spec = StepGuard(), BatchFeed(plan, self.device_type), None
        self.last_step: StepStats | None = None
        self.hf_config = getattr(model, "config", None)
        self.peft = peft_export_info(model)  # a PEFT model: what saving its adapters needs
        self.hf_class_name = type(model).__name__  # the `architectures` a Hugging Face config names
        self.generation_config = getattr(model, "generation_config", None)  # transformers sets it on generators only
        exits.track(self)  # closed at interpreter exit (autopar.runtime.exits)

    @classmethod
    def runs(cls, plan: Plan) -> bool:
        """Whether this program can run `plan` (the one `plan.program` names always can)."""
        return plan.program == cls.kind

    @classmethod
    def trace_parts(cls, plan: Plan) -> int | None:
        """Into how many equal parts the global batch is cut for the shape this program's graph runs at (None:
        the program runs the model eagerly and needs no trace)."""
        return plan.num_microbatches

    # ------------------------------------------------------------------------------- precision

    def master(self, tensor: torch.Tensor) -> torch.Tensor:
        """A detached copy of a model parameter as this program's master holds it: fp32 under mixed precision."""
        mixed = self.compute_dtype is not None and tensor.is_floating_point()
        dtype = torch.float32 if mixed else tensor.dtype
        if tensor.is_meta:  # a model built on meta: the values come from load_pretrained
            return torch.empty(tensor.shape, dtype=dtype, device=self.device_type)
        return tensor.detach().to(self.device_type, dtype=dtype, copy=True)

    def in_compute_format(self, tensor):
        """A floating tensor (buffer, constant, master) in the format the graph computes in; differentiable."""
        if self.compute_dtype is None or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            return tensor
        return tensor.to(self.compute_dtype)

    def _record(self, event: str, what) -> None:
        """Append (event, what) to `comm_events` when a test has set it."""
        if self.comm_events is not None:
            self.comm_events.append((event, what))

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward from: times the loss scale under fp16."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    # ------------------------------------------------------------------------------------ step

    def expect_inputs(self, args, kwargs, *, tracer: Callable | None = None) -> None:
        """Remember the inputs the program was planned and built for (`compile` calls it with its example
        batch); `train_step` and `eval_step` then refuse others, but for shorter sequences, which `tracer(args,
        kwargs)` traces (`autopar.runtime.shapes`)."""
        self._input_signature = input_signature(args, kwargs)
        self.lengths = Lengths(planned_length(args, kwargs), tracer)

    def _at_length(self, length: int | None, args, kwargs) -> None:
        """Run batches of sequences of `length` from now on (traced the first time: `autopar.runtime.shapes`)."""
        if length is None or length == self.lengths.current:
            return
        parts = self.trace_parts(self.plan) or 1
        self.lengths.use(self, length, lambda: micro_batches(args, kwargs, self.plan.global_batch_size, parts)[0])

    def _bind_trace(self, traced) -> None:
        """Run the model as `traced`, a trace at another sequence length (programs with `_per_length`)."""
        raise NotImplementedError

    def check_inputs(self, args, kwargs, where: str = "train_step") -> int | None:
        """ConfigError naming the first input whose structure, shape or dtype differs from the planned ones, but
        for sequences shorter than planned: returns the batch's sequence length (None: the batch has none)."""
        if self._input_signature is None:
            return None
        expected, got = self._input_signature, input_signature(args, kwargs)
        length = shorter_length(expected, got, self.lengths.planned, where)
        if length is not None:
            return length
        if set(got) != set(expected):
            raise ConfigError(
                f"{where} was given the inputs ({_names(got)}) but the program was compiled for "
                f"({_names(expected)}); pass the same arguments and keywords as the example batch "
                f"given to compile"
            )
        for name, (shape, dtype) in expected.items():
            g_shape, g_dtype = got[name]
            if shape is None and g_shape is None:
                continue  # a value other than a tensor (a flag, a count) may change between calls
            if (g_shape, g_dtype) != (shape, dtype):
                what = f"has shape {g_shape} and dtype {g_dtype}" if g_shape is not None else f"is a {g_dtype}"
                planned = f"shape {shape} and dtype {dtype}" if shape is not None else f"a {dtype}"
                raise ConfigError(
                    f"{where}: input {name} {what}, but the program was planned for {planned}; pass "
                    f"batches of the planned shape and dtype (pad or cut sequences, cast with .to()), "
                    f"or compile again with an example batch of the shape you train on"
                )
        return self.lengths.planned

    def compile_graphs(self, mode: str) -> None:
        """Hand the graphs this program runs to `torch.compile` (`mode` one of `COMPILE_MODES`); programs that run
        no graph of their own refuse."""
        raise ConfigError(
            f"compile_mode={mode!r}: the {self.kind} program runs the model eagerly, with no graph of its own to "
            f"compile; leave compile_mode unset for this plan"
        )

    def _build_optimizer(self, masters) -> None:
        self.optimizer = self._make_optimizer(list(masters))

    def configure_loop(
        self, *, max_grad_norm=None, on_nonfinite: str = "raise", local_batch: bool = False, loss=None
    ) -> None:
        """The training loop's settings (`compile` passes its own): clip to `max_grad_norm` (global norm),
        "raise" or "skip" on a non-finite loss or gradient (`autopar.runtime.step_guard`), each data-parallel
        rank passing its own rows (`local_batch`, `autopar.data`), the user's loss (`autopar.loss.LossSpec`)."""
        self.guard = StepGuard(max_grad_norm=max_grad_norm, on_nonfinite=on_nonfinite)
        self.feed = BatchFeed(self.plan, self.device_type, local_batch=local_batch)
        self.loss_spec = loss

    def train_step(self, *args, accumulate: bool = False, **kwargs) -> float:
        """One optimizer step on a global batch (every rank passes the same batch, or with `local_batch` its own
        rows); returns the loss. `accumulate=True` keeps the gradients for the next call, which steps on both
        as on one batch of their rows (`autopar.runtime.step_guard`). `last_step` says what the call did.

        Micro-batch i contributes its loss times its weight w_i (the labels its mean cross-entropy kept, or
        1 for other losses); the gradients are divided by sum w_i before the step, so the step equals one
        over the whole batch.
        """
        args, kwargs, tokens, loss_weight = self._step_batch(args, kwargs, check=True)
        self._at_length(self.check_inputs(args, kwargs), args, kwargs)
        micro = micro_batches(args, kwargs, self.plan.global_batch_size, self.plan.num_microbatches)
        self._zero_grads()
        loss_sum, weight = self._forward_backward(micro)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self._scale_gradients(weight, scale)
        loss = loss_sum / weight if weight > 0 else loss_sum / len(micro)
        if loss_weight is not None:  # the user's loss: calls weigh as their loss tokens
            weight = loss_weight
        return self.guard.finish(self, loss, weight, tokens, accumulate=accumulate, summed=loss_weight == 0)

    def _step_batch(self, args, kwargs, *, check: bool) -> tuple[tuple, dict, float, float | None]:
        """(args, kwargs) as the program reads a global batch, this rank's share of its input tokens, and the
        step's loss tokens under a user's loss (0 for a summed one; None without one)."""
        from autopar import loss

        n = loss.global_tokens(self.loss_spec, self.feed, kwargs) if self.loss_spec is not None else None
        args, kwargs, tokens = self.feed.inputs(args, kwargs, check=check)
        if self.loss_spec is not None:
            kwargs[loss.LOSS_SCALE] = self.loss_spec.scale(self._loss_shards(), n).to(self.device_type)
            n = 0.0 if self.loss_spec.reduction == "sum" else n
        return args, kwargs, tokens, n

    def _loss_shards(self) -> int:
        """Into how many equally weighted parts the program averages a loss it does not recognise (`autopar.loss`):
        the micro-batches here; a program running each data-axis rank's rows on its own says so (its ranks times
        them)."""
        return self.plan.num_microbatches

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel index: with `local_batch`, the rows it passes are its share (`autopar.data`)."""
        return self.feed.index

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks of the plan (ranks of one data-parallel group pass the same rows)."""
        return self.plan.mesh.get("dp", 1)

    @property
    def local_batch_size(self) -> int:
        """Rows one `train_step` call takes on this rank: the global batch, or with `local_batch` its share."""
        return local_batch_size(self.plan) if self.feed.local_batch else self.plan.global_batch_size

    def data_loader(self, dataset, *, shuffle: bool = True, seed: int = 0, **loader_kwargs):
        """A `torch.utils.data.DataLoader` of `dataset` giving this rank what `train_step` takes: its rows of
        each global batch with `local_batch` (`autopar.data.PlanSampler`), else the whole global batch, drawn
        the same way on every rank (the same `seed`). Call `loader.sampler.set_epoch(e)` each epoch;
        `loader_kwargs` (collate_fn, num_workers, ...) go to the DataLoader."""
        index = self.feed.index if self.feed.local_batch else None
        sampler = PlanSampler(len(dataset), self.plan, index, shuffle=shuffle, seed=seed)
        return torch.utils.data.DataLoader(
            dataset, batch_size=self.local_batch_size, sampler=sampler, drop_last=True, **loader_kwargs
        )

    def _zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _forward_backward(self, micro: list[tuple]) -> tuple[float, float]:
        """Forward and backward over the micro-batches (gradients reduced over the data axis as the plan says);
        returns (sum of w_i * loss_i, sum of w_i), the gradients being those of the first sum (times the loss
        scale)."""
        raise NotImplementedError

    def _gradients(self) -> list[torch.Tensor]:
        """This rank's gradients of the masters the optimizer steps."""
        return [p.grad for p in self.parameters() if p.grad is not None]

    def _scale_gradients(self, weight: float, scale: float) -> None:
        """Divide the gradients by the weight their loss was summed with and by the loss scale."""
        divisor = (weight if weight > 0 and self.plan.num_microbatches > 1 else 1.0) * scale
        if divisor != 1.0:
            for g in self._gradients():
                g.div_(divisor)

    def _gradient_shares(self) -> list[tuple[torch.Tensor, int]]:
        """(gradient, copies) for each gradient tensor this rank steps, `copies` the ranks holding an identical
        one (replicated over tp, the data axis, pipeline stages): the step guard's norm counts each element
        once. Called after `_scale_gradients`; every program says its own."""
        raise NotImplementedError

    def _gradient_divisor(self) -> float:
        """What the optimizer step still divides `_gradient_shares`' gradients by (1: they are final)."""
        return 1.0

    def _scale_gradients_by(self, factor: float) -> None:
        """Multiply the step's gradients by `factor` (clipping)."""
        torch._foreach_mul_([g for g, _ in self._gradient_shares()], factor)

    def _discard_gradients(self) -> None:
        """Forget the step's gradients (a skipped step, an accumulating call: the guard holds a copy)."""
        self._zero_grads()

    def _optimizer_step(self) -> None:
        self.optimizer.step()

    # ------------------------------------------------------------------------------ evaluation

    def eval_step(self, *args, **kwargs) -> float:
        """The loss of a global batch (every rank passes the same batch) with dropout off, computing no gradient
        and touching no optimizer state; every rank returns it."""
        args, kwargs, _, _ = self._step_batch(args, kwargs, check=False)
        self._at_length(self.check_inputs(args, kwargs, "eval_step"), args, kwargs)
        micro = micro_batches(args, kwargs, self.plan.global_batch_size, self.plan.num_microbatches)
        with torch.no_grad():
            return self._evaluate(micro)

    def _evaluate(self, micro: list[tuple]) -> float:
        raise NotImplementedError

    # ---------------------------------------------------------------------------------- states

    def _full_parameters(self) -> dict[str, torch.Tensor]:
        """Full master tensors on the CPU under their graph names (collective: every rank calls it)."""
        raise NotImplementedError

    def _named_buffers(self) -> dict[str, torch.Tensor]:
        """This program's buffers under the model's names."""
        raise NotImplementedError

    def state_dict(self, *args, **kwargs) -> dict:  # noqa: ARG002 - the nn.Module signature
        """Full tensors under the model's names (tied names included), in the dtypes the model was handed in;
        parameters are gathered from every rank, so every rank must call it."""
        params = self._full_parameters()
        buffers = self._named_buffers()
        out = {}
        for name in self._state_names:
            key = self._aliases.get(name, name)
            value = params.get(key)
            if value is None:
                value = buffers.get(name)
            if value is not None:
                out[name] = value.detach().cpu().to(self._state_dtypes[name], copy=True)
        return out

    # ---------------------------------------------------------------------------------- exits

    def release_pending_work(self) -> None:
        """Wait for every collective this program still has in flight between calls (a kind that prefetches says
        which); the program runs on after it."""

    def close(self) -> None:
        """Release what this program holds of torch.distributed: wait for its asynchronous save and its
        collectives in flight, then drop its state (groups, meshes, schedules, buffers), so that no collective of it
        is left in a backend's threads when the process group is destroyed or the interpreter exits
        (`autopar.runtime.exits`). The program cannot run after; every live program is closed at exit."""
        if "plan" not in vars(self):
            return  # closed already
        try:
            training.wait_checkpoint(self)
        finally:
            self.release_pending_work()
            training.forget(self)
            vars(self).clear()
