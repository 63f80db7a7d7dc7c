"""The offload program: what a plan that keeps optimizer states and gradients on the host compiles to.

The model's parameters are packed into chunks (`autopar.memory.ChunkStore`), sharded over the
data axis when dp > 1 (ZeRO-3 over chunks: one all-gather per chunk for forward and one for
backward, one reduce-scatter of its gradients), and the model computes with views into the
chunks' payloads, gathered as each module runs and freed after (`ChunkScheduler`). With the plan's
overlap on, the communication overlaps the compute: the next chunk's all-gather is issued while the
current one computes (one chunk ahead, where the plan's prefetch depth is not 0), and a chunk's
reduce-scatter is issued as soon as its last gradient is in and completed while backward goes on (one in
flight at a time); with it off, each chunk is gathered where it is used and each reduce-scatter completes
where it is issued, as the solver prices the plan without overlap. The first
chunks, enough to cover the plan's offloaded fraction of the optimizer states, keep their master
weights, gradients and AdamW moments on the host; the others on the device. `ChunkAdamW` updates
each chunk where it lives: host chunks by the CPU AdamW over whole chunks (ZeRO-Offload), device
chunks on the device.

The plan's activation treatment (one recompute mode for every layer, or `layer_modes`) is applied to
the model's repeated layers eagerly (`apply_layer_treatments`): checkpointed layers or attention
modules, and layers whose saved tensors go to the host.

Every plan's states run as ZeRO-3 chunks: the leanest layout, so the device holds no more than the
plan counted for any ZeRO stage (its time is that of ZeRO-3's collectives, which the plan may not
have priced). The `MemoryTracker` counts the bytes the store holds on the device at each point of
the step (payloads, device-resident states, gradient staging) and, through `ActivationTracker`, the
tensors autograd saves for backward on the device (not those an offloaded layer keeps on the host,
nor the values a checkpointed layer makes again inside backward, which live one layer at a time);
on a CPU device and host are the same RAM, and the tracker is what tells them apart.

The loss is exact with unevenly ignored labels: while the model runs, a mean cross-entropy is
computed as a sum and the labels it kept are counted; the step divides the summed gradients by
the count over all ranks and micro-batches. A loss that is not a cross-entropy is taken as a mean
over samples, which equal shares make exact.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from autopar.checkpoint import chunks
from autopar.cluster import ClusterSpec
from autopar.errors import LoweringError
from autopar.memory import ChunkAdamW, ChunkScheduler, ChunkStore, MemoryTracker, pack
from autopar.memory.activations import ActivationOffload, ActivationTracker
from autopar.memory.layout import ALIGN_NUMEL, offload_chunk_numel
from autopar.memory.store import module_params
from autopar.plan import Plan, ProgramKind
from autopar.program_comm import ProgramComm
from autopar.runtime.base import COMPUTE_DTYPES, Program, check_scalar_loss, rank_rows
from autopar.runtime.collectives import new_group, waiting_for
from autopar.trace import TracedModel

_CROSS_ENTROPY_ARGS = (
    "input",
    "target",
    "weight",
    "size_average",
    "ignore_index",
    "reduce",
    "reduction",
    "label_smoothing",
)


class _SumCrossEntropy(TorchFunctionMode):
    """Turns the first mean cross-entropy a forward computes into its sum and counts the labels it kept."""

    def __init__(self, enabled: bool = True):
        super().__init__()
        self.count: torch.Tensor | None = None
        self.enabled = enabled  # off under a user's loss (`autopar.loss`), which is global already

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.cross_entropy and self.count is None and self.enabled:
            bound = dict(zip(_CROSS_ENTROPY_ARGS, args, strict=False)) | kwargs
            target = bound.get("target")
            plain = all(bound.get(k) is None for k in ("weight", "size_average", "reduce"))
            integer = target is not None and not target.is_floating_point()  # class indices, not probabilities
            if plain and integer and bound.get("reduction", "mean") == "mean":
                self.count = (target != bound.get("ignore_index", -100)).sum()
                return func(**(bound | {"reduction": "sum"}))
        return func(*args, **kwargs)


def _loss_of(out) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = out[0] if isinstance(out, (tuple, list)) else out
    check_scalar_loss(loss)
    return loss


def _adamw_hyperparameters(optimizer) -> dict:
    """lr, betas, eps and weight_decay of the AdamW `optimizer(params)` builds (compile's default: lr 1e-3)."""
    if optimizer is None:
        return {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
    probe = optimizer([torch.nn.Parameter(torch.zeros(1))])
    group = probe.param_groups[0]
    adam = type(probe) is torch.optim.AdamW or (type(probe) is torch.optim.Adam and group["weight_decay"] == 0)
    if not adam or len(probe.param_groups) != 1 or group.get("amsgrad") or group.get("maximize"):
        raise LoweringError(
            f"an offloaded plan runs AdamW over chunks (one set of hyperparameters), but the "
            f"optimizer is {type(probe).__name__} with {len(probe.param_groups)} group(s); pass "
            f"torch.optim.AdamW, or plan with offload=False"
        )
    return {
        "lr": float(group["lr"]),
        "betas": tuple(group["betas"]),
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
    }


def layer_treatments(plan: Plan, num_layers: int) -> dict[int, str]:
    """Layer index -> "offload", "full" or "selective" for the layers the plan treats."""
    if plan.layer_modes:
        return {i: mode for mode, layers in plan.layer_modes.items() for i in layers}
    if plan.recompute != "none":
        return dict.fromkeys(range(num_layers), plan.recompute)
    return {}


def apply_layer_treatments(
    module: torch.nn.Module, plan: Plan, *, tracker=None
) -> tuple[ActivationOffload | None, list[str]]:
    """Make the model's repeated layers (its longest ModuleList) do what the plan says with their activations.

    "full": the layer's forward runs under non-reentrant checkpointing; "selective": its attention
    module does (eagerly the attention module holds its projections too, so this recomputes a little
    more than the traced graph's selective segment, which keeps them); "offload": the layer runs
    inside an `ActivationOffload` (which counts what it brings back on `tracker`). Returns the offload
    hooks (None if unused) and the checkpointed module paths.
    """
    lists = [(name, m) for name, m in module.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return None, []
    path, layers = max(lists, key=lambda item: len(item[1]))
    todo = layer_treatments(plan, len(layers))
    if any(i >= len(layers) for i in todo):
        raise LoweringError(f"the plan treats layers {sorted(todo)} but {path} holds {len(layers)}")
    offload = ActivationOffload(tracker=tracker) if "offload" in todo.values() else None
    checkpointed = []
    for i, mode in sorted(todo.items()):
        layer = layers[i]
        if mode == "offload":
            _wrap_forward(layer, lambda run, *a, **k: _offloaded(offload, run, *a, **k))
            continue
        target, where = layer, f"{path}.{i}"
        if mode == "selective":
            found = [(n, m) for n, m in layer.named_modules() if "Attention" in type(m).__name__]
            if not found:
                continue  # no attention block to recompute in this layer
            where, target = f"{where}.{found[0][0]}", found[0][1]
        _wrap_forward(target, _checkpointed)
        checkpointed.append(where)
    return offload, checkpointed


def _wrap_forward(mod: torch.nn.Module, wrapper) -> None:
    inner = mod.forward
    mod.forward = lambda *args, **kwargs: wrapper(inner, *args, **kwargs)


def _checkpointed(run, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


def _offloaded(offload: ActivationOffload, run, *args, **kwargs):
    with offload:
        return run(*args, **kwargs)


_CHUNK_WORDS = "a chunk's all-gather of its weights or reduce-scatter of its gradients over the data axis"


def host_chunks(layouts, fraction: float) -> set[int]:
    """The first trainable chunks whose elements reach `fraction` of all trainable elements (rounded up)."""
    trainable = [lay for lay in layouts if lay.requires_grad]
    total = sum(lay.capacity for lay in trainable)
    chosen, covered = set(), 0
    for lay in trainable:
        if covered >= fraction * total - 0.5:
            break
        chosen.add(lay.index)
        covered += lay.capacity
    return chosen


class OffloadProgram(Program):
    """A dp x 1 plan with host offload on this rank (see the module docstring); `store` and `tracker` are the
    chunks and their device accounting."""

    kind = ProgramKind.OFFLOAD

    @classmethod
    def trace_parts(cls, plan: Plan) -> None:
        return None  # the model runs eagerly over the chunks

    def __init__(
        self,
        model: torch.nn.Module,
        plan: Plan,
        traced: TracedModel | None,
        cluster: ClusterSpec,
        *,
        optimizer=None,
        chunk_numel: int | None = None,
    ):
        super().__init__(model, plan, traced, cluster, optimizer=optimizer)
        dp = plan.mesh.get("dp", 1)
        if plan.mesh.get("tp", 1) != 1 or dp != dist.get_world_size():
            raise LoweringError(
                f"host offload runs plans with a data axis over all ranks only, got mesh {plan.mesh}; "
                f"plan with constraints={{'tp': 1}} or offload=False"
            )
        self.dp, self.rank = dp, dist.get_rank()
        self.comm = ProgramComm.of_plan(plan, self.kind)
        self.device = self.device_type
        module = copy.deepcopy(model).to(self.device)
        specs, aliases, values = module_params(module)
        budget = plan.offload.get("device_budget_bytes") or plan.cluster.device.memory_bytes
        compute = COMPUTE_DTYPES.get(plan.precision, torch.float32)
        if chunk_numel is None:
            chunk_numel = offload_chunk_numel(
                [s.numel for s in specs], dp=dp, budget_bytes=budget, compute_itemsize=compute.itemsize
            )
        host = host_chunks(
            pack(specs, chunk_numel, multiple=ALIGN_NUMEL * dp), plan.offload.get("optimizer_fraction", 0.0)
        )
        self.tracker = MemoryTracker(budget_bytes=int(budget))
        group = new_group(list(range(dp))) if dp > 1 else None  # dp x 1: every rank, waits bounded
        self.store = ChunkStore(
            specs,
            chunk_numel=chunk_numel,
            compute_dtype=compute,
            device=self.device,
            group=group,
            host=host,
            aliases=aliases,
            tracker=self.tracker,
        )
        self.store.load_state(values)
        del values
        self.store.bind(module)
        # the store prefetches one chunk ahead at most: a deeper prefetch depth runs as 1
        self.scheduler = ChunkScheduler(
            self.store,
            module,
            prefetch=self.comm.prefetches_chunk,
            reduce_window=self.comm.chunk_reductions_in_flight,
        )
        # the tensors autograd keeps for backward, on the same tracker as the chunks
        self.activations = ActivationTracker(self.tracker, self.device)
        self.activation_offload, self.checkpointed = apply_layer_treatments(module, plan, tracker=self.tracker)
        self._module_box = (module,)  # not a submodule: its parameters are the store's transient views
        self.optimizer = ChunkAdamW(self.store, **_adamw_hyperparameters(optimizer))
        self._grad_scale = 1.0

    @property
    def module(self) -> torch.nn.Module:
        return self._module_box[0]

    # ------------------------------------------------------------------------------------ running

    def _local(self, tree):
        """This rank's rows of every batch tensor, on the device."""

        def share(t):
            if isinstance(t, torch.Tensor):
                return rank_rows(t, self.dp, self.rank).to(self.device).contiguous()
            return t

        return pytree.tree_map(share, tree)

    def _zero_grads(self) -> None:
        pass  # the store's gradient buffers restart from zero after every optimizer step

    def _run_micro_batches(self, micro: list[tuple], backward: bool) -> tuple[float, float]:
        """(loss sum, kept-label count) over the ranks and micro-batches, running backward from each if asked."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for mb_args, mb_kwargs in micro:
            local_args, local_kwargs = self._local((mb_args, mb_kwargs))
            with waiting_for(_CHUNK_WORDS):
                with _SumCrossEntropy(enabled=self.loss_spec is None) as ce, self.activations:
                    loss = _loss_of(self.module(*local_args, **local_kwargs))
                if backward:
                    self.scaled(loss).backward()
            totals[0] += loss.detach().double()
            totals[1] += ce.count.double() if ce.count is not None else 1.0
        if self.dp > 1:
            with waiting_for("the all-reduce of the loss and label count over the data axis"):
                dist.all_reduce(totals, group=self.store.group)
        loss_sum, count = totals.tolist()
        return loss_sum, count

    def _forward_backward(self, micro: list[tuple]) -> tuple[float, float]:
        return self._run_micro_batches(micro, backward=True)

    def _scale_gradients(self, weight: float, scale: float) -> None:
        # the store averaged the gradients over dp; the loss is the sum over every kept label. ChunkAdamW
        # divides them in its own pass over them
        self._grad_scale = weight * scale / self.dp

    def _gradients(self) -> list[torch.Tensor]:
        return [c.grad for c in self.store.chunks if c.grad is not None]

    def _gradient_shares(self) -> list[tuple[torch.Tensor, int]]:
        with waiting_for(_CHUNK_WORDS):
            self.store.finish_grads()  # idempotent: the step finds nothing left to reduce
        return [(g, 1) for g in self._gradients()]  # this rank's shard of each chunk (the whole chunk on one rank)

    def _gradient_divisor(self) -> float:
        return self._grad_scale  # ChunkAdamW divides the gradients in its own pass

    def _scale_gradients_by(self, factor: float) -> None:
        self._grad_scale /= factor

    def _discard_gradients(self) -> None:
        self.store.zero_grad()  # a skipped step's gradients must not carry into the next one

    def _loss_shards(self) -> int:
        return self.dp * self.plan.num_microbatches  # each rank runs plain tensors on its rows

    def release_pending_work(self) -> None:
        with waiting_for(_CHUNK_WORDS):
            for chunk in self.store.chunks:
                self.store.wait(chunk)  # a gather issued ahead
                self.store.finish_reduce(chunk)  # a reduce-scatter in flight

    def _optimizer_step(self) -> None:
        with waiting_for(_CHUNK_WORDS):
            self.optimizer.step(grad_scale=self._grad_scale)

    def _evaluate(self, micro: list[tuple]) -> float:
        was_training = self.module.training
        self.module.eval()
        try:
            loss_sum, count = self._run_micro_batches(micro, backward=False)
        finally:
            self.module.train(was_training)
        return loss_sum / count

    def forward(self, *args, **kwargs):
        """Run the model on any batch with this program's parameters (every rank computes the whole batch)."""
        return self.module(*args, **kwargs)

    # ---------------------------------------------------------------------------------- states

    def parameters(self, recurse: bool = True):  # noqa: ARG002 - the nn.Module signature
        """This rank's shards of the master weights, one flat tensor per chunk: what its optimizer updates."""
        return iter([chunk.master for chunk in self.store.chunks])

    def _full_parameters(self) -> dict[str, torch.Tensor]:
        with waiting_for("the all-gathers of the chunks' masters for state_dict"):
            return self.store.full_state()

    def _named_buffers(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_buffers(remove_duplicate=False))

    # the chunks' shards cut parameters anywhere: their pieces are flat ranges (autopar.checkpoint.chunks)
    def checkpoint_masters(self) -> dict:
        return chunks.chunk_pieces(self.store, "master")

    def checkpoint_optimizer_state(self) -> dict[str, dict]:
        return chunks.chunk_optimizer_state(self.store, self.optimizer)

    def prepare_optimizer_state(self) -> None:
        pass  # the chunks' moments exist from the start

    def reset_optimizer_state(self) -> None:
        chunks.reset_optimizer_state(self.store, self.optimizer)

    def after_checkpoint_load(self) -> None:
        chunks.after_load(self.store, self.optimizer)
