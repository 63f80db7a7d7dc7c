"""What differs between the torch releases autopar supports (2.11 and later): the one place that knows.

Code elsewhere calls these and never branches on the torch version itself; here each difference is detected by
the feature (a name, a keyword, a registered function), not by the version number. Found by running the smoke
tier (`make test-torch TORCH=2.11.0`) on 2.11, 2.13 and 2.15; "2.11" below is the oldest release checked, and
2.13 and 2.15 take the plain path of each.

- ``all_gather_single`` / ``reduce_scatter_single``: ``torch.distributed``'s flat all-gather and reduce-scatter,
  called ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in 2.11 (2.13 keeps those as deprecated aliases).
  The name is looked up on ``torch.distributed`` at each call, so a test that replaces
  ``dist.all_gather_single`` to count calls still sees every call on the releases that have it.
- ``funcol_all_gather`` / ``funcol_reduce_scatter`` / ``funcol_all_reduce``: the functional collectives (what a
  lowered graph issues on the tensor axis), ``all_gather_single`` / ``reduce_scatter_single`` in 2.13 and
  ``all_gather_tensor`` / ``reduce_scatter_tensor`` before; looked up at each call, as above.
- ``dtensor_from_local``: ``DTensor.from_local`` with ``grad_placements`` (the placement its backward leaves the
  gradient in: a replicated weight's gradient kept partial, summed later by a bucket), which 2.11's lacks; there
  the backward is done here, as 2.13's does it.
- DTensor's sharding strategy of ``aten.constant_pad_nd`` (Hugging Face's loss pads the labels) in 2.11 gives one
  placement whatever the mesh's dims, which fails on a 2-D mesh ("list index out of range" in a redistribute);
  where torch has that strategy, importing this module registers DTensor's own replicate-everything strategy for
  the op instead (2.13's shards it on the dims it does not pad).
- ``PipelineStage``: torch's, except that 2.11's, in a stage with a backward, marks every receive buffer as
  requiring a gradient, which fails on an integer input (the micro-batch index autopar's stages pass along:
  "only Tensors of floating point dtype can require gradients"), and expects a gradient back for every input;
  there the buffers follow the example inputs' ``requires_grad``, and only those that require one send a gradient
  back, as 2.13's do. Imported on first use (``from autopar.compat import PipelineStage``).
- ``inline_grad_mode_regions``: 2.11's ``torch.export`` (non-strict, training IR) wraps a region run under
  ``torch.no_grad()`` / ``torch.autocast(enabled=False)`` (Hugging Face's rotary embedding is one) in a
  higher-order op calling a submodule; 2.13's leaves the region's ops inline in the graph. The planner prices and
  shards ATen ops, so the trace inlines such regions, and every release hands it the same kind of graph.
- ``without_stack_traces``: tracing that records no Python stack on each graph node (``torch.fx.config``'s
  ``do_not_emit_stack_traces``; nothing in autopar reads a node's ``stack_trace``, and capturing one per node is
  about a quarter of an export of the tiny LLaMA). Where the flag is missing, stacks are recorded as before.
"""

from __future__ import annotations

import contextlib
import inspect
import operator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import DTensor

__all__ = [
    "all_gather_single",
    "dtensor_from_local",
    "funcol_all_gather",
    "funcol_all_reduce",
    "funcol_reduce_scatter",
    "inline_grad_mode_regions",
    "reduce_scatter_single",
    "without_stack_traces",
]


def all_gather_single(output, input, group=None, async_op: bool = False):
    """`torch.distributed.all_gather_single` (``all_gather_into_tensor`` before torch 2.13): gather every rank's
    `input` (same size on each) into `output`, rank order along the first dim. Returns the work with `async_op`."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """`torch.distributed.reduce_scatter_single` (``reduce_scatter_tensor`` before torch 2.13): reduce `input`
    over the group with `op` and keep this rank's equal share of it in `output`. Returns the work with
    `async_op`."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def funcol_all_gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's `t` joined on `dim` over `group` (functional: possibly an `AsyncCollectiveTensor`)."""
    from torch.distributed import _functional_collectives as funcol

    fn = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return fn(t, dim, group)


def funcol_reduce_scatter(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The sum of `t` over `group`, this rank's equal piece of it on `dim` (functional)."""
    from torch.distributed import _functional_collectives as funcol

    fn = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return fn(t, "sum", dim, group)


def funcol_all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    """The sum of `t` over `group` (functional)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(t, "sum", group)


_FROM_LOCAL_TAKES_GRAD_PLACEMENTS = "grad_placements" in inspect.signature(DTensor.from_local).parameters


def dtensor_from_local(
    local, mesh=None, placements=None, *, run_check: bool = False, shape=None, stride=None, grad_placements=None
) -> DTensor:
    """`DTensor.from_local` with `grad_placements` on every release (see the module docstring)."""
    if grad_placements is None or _FROM_LOCAL_TAKES_GRAD_PLACEMENTS:
        extra = {} if grad_placements is None else {"grad_placements": grad_placements}
        return DTensor.from_local(local, mesh, placements, run_check=run_check, shape=shape, stride=stride, **extra)
    return _FromLocal.apply(local, mesh, tuple(placements), run_check, shape, stride, tuple(grad_placements))


class _FromLocal(torch.autograd.Function):
    """`DTensor.from_local` whose backward redistributes the gradient to `grad_placements` (torch 2.13's)."""

    @staticmethod
    def forward(ctx, local, mesh, placements, run_check, shape, stride, grad_placements):
        ctx.mesh, ctx.grad_placements = mesh, grad_placements
        ctx.set_materialize_grads(False)
        return DTensor.from_local(local, mesh, placements, run_check=run_check, shape=shape, stride=stride)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 7
        if tuple(grad.placements) == ctx.grad_placements:
            return (grad.to_local(), *(None,) * 6)
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        from torch.distributed.tensor._redistribute import redistribute_local_tensor

        target = DTensorSpec(ctx.mesh, ctx.grad_placements, tensor_meta=grad._spec.tensor_meta)
        return (redistribute_local_tensor(grad._local_tensor, grad._spec, target), *(None,) * 6)


def _region(node: fx.Node) -> tuple[fx.Node, tuple] | None:
    """(the get_attr node of the submodule, its inputs) of a call of a grad-mode region's higher-order op that
    inlining keeps equivalent, else None (an autocast region that casts stays a call: inline, it would not)."""
    hop = torch.ops.higher_order
    if node.op != "call_function":
        return None
    if node.target is getattr(hop, "wrap_with_set_grad_enabled", None):
        return node.args[1], node.args[2:]
    if node.target is getattr(hop, "wrap_with_autocast", None) and node.args[2] is False:
        return node.args[4], node.args[5:]
    return None


def inline_grad_mode_regions(gm: fx.GraphModule) -> int:
    """Replace, in place, each call of a grad-mode region (see the module docstring) in `gm` by the ops of its
    submodule; returns how many were inlined (0 on the releases whose export leaves the ops inline)."""
    count = 0
    for node in list(gm.graph.nodes):
        found = _region(node)
        if found is None:
            continue
        attr, inputs = found
        sub = getattr(gm, attr.target)
        count += inline_grad_mode_regions(sub)  # a region nested in this one
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        with gm.graph.inserting_before(node):
            outputs = gm.graph.graph_copy(sub.graph, dict(zip(placeholders, inputs, strict=True)))
        for user in list(node.users):  # the region returns a tuple, read by getitem
            assert user.target is operator.getitem, f"a grad-mode region's output read by {user.target}"
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not attr.users:
            gm.graph.erase_node(attr)
            gm.delete_submodule(attr.target)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _pipeline_stage() -> type:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.stage import _RecvInfo

    # 2.13's takes whether the stage has a backward as an argument and sets each buffer from its metadata
    if "has_backward" not in inspect.signature(PipelineStage._prepare_forward_infra).parameters:

        class PipelineStage(PipelineStage):  # noqa: F811 - torch's, mended (see the module docstring)
            def _prepare_forward_infra(self, num_microbatches, args, kwargs=None, *rest):
                backward = self.has_backward
                self.has_backward = False  # torch's would mark every receive buffer as requiring a gradient
                try:
                    outputs = super()._prepare_forward_infra(num_microbatches, args, kwargs, *rest)
                finally:
                    self.has_backward = backward
                if backward and not self.is_first:
                    for infos in self.args_recv_info.values():
                        for info, example in zip(infos, self.inputs_meta, strict=True):
                            info.buffer.requires_grad_(example.requires_grad)
                return outputs

            def _create_grad_send_info(self, args_recv_info):
                # an input that needs no gradient sends none back
                return [
                    info.source if isinstance(info, _RecvInfo) and info.buffer.requires_grad else None
                    for info in args_recv_info
                ]

            def _create_grad_recv_info(self, act_send_info):
                # nor does the stage before wait for one
                infos = super()._create_grad_recv_info(act_send_info)
                examples = self.get_outputs_meta()
                return tuple(info if examples[k].requires_grad else None for k, info in enumerate(infos))

            def _retrieve_recv_grads(self, bwd_chunk_id):
                return tuple(None if info is None else info.buffer for info in self.grad_recv_info[bwd_chunk_id])

    return PipelineStage


@contextlib.contextmanager
def without_stack_traces():
    """Trace within this block without recording a Python stack on each FX node; the flag is restored after."""
    config = getattr(fx, "config", None)
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def __getattr__(name: str):
    if name == "PipelineStage":  # imported on first use: torch.distributed.pipelining is a heavy import
        return _pipeline_stage()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _replicate_constant_pad_on_every_mesh_dim() -> None:
    try:
        from torch.distributed.tensor._ops import _matrix_ops
    except ImportError:  # laid out otherwise: not 2.11's
        return
    if hasattr(_matrix_ops, "constant_pad_nd_strategy"):  # 2.11's one-placement strategy (2.13 renamed it)
        from torch.distributed.tensor._ops.utils import register_op_strategy, replicate_op_strategy

        register_op_strategy(torch.ops.aten.constant_pad_nd.default)(replicate_op_strategy)


_replicate_constant_pad_on_every_mesh_dim()
