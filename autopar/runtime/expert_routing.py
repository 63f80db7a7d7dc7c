"""The router's auxiliary load-balancing loss over the whole batch, when the data axis splits the batch.

Hugging Face's MoE models (Mixtral, Qwen2-MoE, ...) add `router_aux_loss_coef` times Switch Transformer's balancing
loss to the language-model loss when `output_router_logits` is on (`load_balancing_loss_func`):

    aux = E · Σ_e f_e · P_e,   f_e = (top-k choices of expert e) / N,   P_e = (Σ_tokens softmax(logits)_e) / N

over the N token rows of every MoE layer of the batch. A rank of the data axis sees 1 / dp of the rows: computed on
them, f and P are that rank's and the mean of the ranks' losses is not the batch's (the product of two means is not
the mean of the products). f comes from `aten.histc` over the top-k indices, a count with no gradient; P carries the
gradient to the router. Replacing each rank's counts by the mean of every rank's (an all-reduce over the data axis,
divided by dp) makes each rank's loss E · Σ_e f_e(batch) · P_e(rank), whose mean over the ranks (the program's loss
and gradient: equal shares of rows) is the batch's aux loss, and whose gradient is the batch's: aux is linear in P
once f is fixed.

`global_routing_counts_pass` does that on the traced graph. What it does not cover: an `attention_mask` (the loss
then counts with `scatter_add` and divides by the mask's sum: rank-local, the program warns) and micro-batches (each
micro-batch's counts are its own, as gradient accumulation in one process would have them).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import fx

from autopar.runtime.collectives import waiting_for

aten = torch.ops.aten


class MeanOverRanks(torch.nn.Module):
    """A count (no gradient) averaged over the ranks of `group`: all-reduced, divided by their number."""

    def __init__(self, group, num_ranks: int):
        super().__init__()
        self._group, self.num_ranks = group, num_ranks

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        total = counts.detach().clone()
        with waiting_for("the all-reduce of the router's per-expert token counts over the data axis (the aux loss)"):
            dist.all_reduce(total, group=self._group)
        return total / self.num_ranks


def global_routing_counts_pass(
    gm: fx.GraphModule, example_inputs, *, num_experts: int, group, num_ranks: int
) -> fx.GraphModule:
    """Follow each `aten.histc` of `num_experts` bins (the balancing loss's per-expert counts) by `MeanOverRanks`.

    Expects a traced graph whose experts modules were already replaced (no count of theirs is left). Guarantees every
    reader of such a count reads the mean of every rank's; `gm.meta["autopar_routing_counts"]`: how many it replaced.
    """
    del example_inputs
    counts = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target == aten.histc.default and _bins(n) == num_experts
    ]
    if counts:
        gm.add_submodule("routing_counts_mean", MeanOverRanks(group, num_ranks))
    for node in counts:
        with gm.graph.inserting_after(node):
            mean = gm.graph.call_module("routing_counts_mean", (node,))
        mean.meta = dict(node.meta)
        node.replace_all_uses_with(mean, delete_user_cb=lambda user, m=mean: user is not m)
    gm.meta["autopar_routing_counts"] = len(counts)
    gm.graph.lint()
    gm.recompile()
    return gm


def _bins(node: fx.Node) -> int:
    """`histc`'s bins (its second argument, 100 by default)."""
    if len(node.args) > 1:
        return node.args[1]
    return node.kwargs.get("bins", 100)


def warn_local_aux_loss(model: torch.nn.Module, num_counts: int, num_microbatches: int) -> None:
    """Warn where the model's loss holds a balancing loss that is not the batch's (module docstring): its config
    asks for one (`output_router_logits` and a nonzero `router_aux_loss_coef`) and the graph has no count to share
    (an attention mask), or the batch runs in micro-batches."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or not getattr(config, "router_aux_loss_coef", 0.0):
        return
    if num_counts == 0:
        warnings.warn(
            "expert parallelism: the router's auxiliary load-balancing loss is computed on each rank's own tokens "
            "(its counts were not found as aten.histc of the experts' number of bins: an attention mask makes them "
            "a scatter_add), so the loss and the router's gradients differ from one process's over the whole batch; "
            "drop the attention mask or set output_router_logits=False to train without it",
            stacklevel=3,
        )
    elif num_microbatches > 1:
        warnings.warn(
            f"expert parallelism: the router's auxiliary load-balancing loss counts the tokens of each of the "
            f"{num_microbatches} micro-batches over every rank, not the whole batch at once as one process does",
            stacklevel=3,
        )


def global_label_count_pass(gm: fx.GraphModule, example_inputs, *, group, num_ranks: int) -> fx.GraphModule:
    """Divide each mean cross-entropy (no class weights) by the mean over the ranks of the kept-label count.

    For a graph whose loss is more than a cross-entropy (the language-model loss plus the balancing loss), which the
    data-parallel program averages over the ranks (`sum_loss_pass` counts labels only where the loss is the
    cross-entropy itself): rank r's Σ_r loss_r / (count / dp) averaged over the ranks is Σ loss / count, the
    batch's mean however unevenly the ignored labels (-100) fall. Guarantees each such cross-entropy's readers read
    that value; `gm.meta["autopar_global_label_counts"]`: how many it replaced.
    """
    del example_inputs
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    found = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.cross_entropy_loss.default:
            continue
        bound = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
        if bound.get("weight") is not None or bound.get("reduction", 1) != 1:
            continue
        found.append((node, bound))
    if found:
        gm.add_submodule("label_count_mean", MeanOverRanks(group, num_ranks))
    for node, bound in found:
        ignore = bound.get("ignore_index", -100)
        graph = gm.graph
        with graph.inserting_before(node):
            args = (bound["input"], bound["target"], None, 2, ignore, bound.get("label_smoothing", 0.0))
            total = graph.call_function(aten.cross_entropy_loss.default, args)
            kept = graph.call_function(
                aten.sum.default, (graph.call_function(aten.ne.Scalar, (bound["target"], ignore)),)
            )
            mean = graph.call_module("label_count_mean", (kept,))
            loss = graph.call_function(aten.div.Tensor, (total, mean))
        loss.meta = dict(node.meta)
        node.replace_all_uses_with(loss)
        graph.erase_node(node)
    gm.meta["autopar_global_label_counts"] = len(found)
    gm.graph.lint()
    gm.recompile()
    return gm
