"""The traces `plan` and `compile` take of a model, built on `trace.trace_model`: in the plan's compute format, on
a cp degree's batch, at the shape a program runs, and a preset's two first layers standing for all of them.

A graph traced for a cp degree above 1 holds each sequence as cp zig-zag chunks stacked on the batch
(`context_parallel.inputs.traced_batch`) and runs without the causal masks its chunks would build
(`passes.context_parallel.drop_causal_masks`): the cp program applies causality by global position.
"""

from __future__ import annotations

import copy
import functools

from autopar.context_parallel.inputs import is_causal_lm, local_batch, splitting_sequences, traced_batch
from autopar.ir import OpGraph
from autopar.passes.context_parallel import drop_causal_masks
from autopar.passes.fused_ops import FUSION_KINDS, fuse_traced, fusion_knobs
from autopar.plan import Plan
from autopar.trace import trace_model

# Layers of a preset traced when its layers are all alike: the trace stands for the whole depth
# (see OpGraph.edge_weight). Two is the fewest that show how one layer feeds the next.
_SHORT_TRACE_LAYERS = 2
# Model types whose layers are identical by construction (no per-layer kinds in their configs).
_UNIFORM_MODEL_TYPES = {"llama", "gpt2", "bert", "mistral", "mixtral", "qwen2", "opt", "gpt_neox", "gptj", "roberta"}


def trace_in_format(model, args, kwargs, precision: str, cp: int = 1):
    """The model traced as a plan of `precision` computes it (the one trace call of plan and compile): mixed
    precision in its compute format, "fp32" in the model's own dtype. For a cp degree above 1 (`args` the cp
    traced batch) without the model's causal masks (`passes.context_parallel.drop_causal_masks`)."""
    from autopar.runtime.base import compute_dtype  # the runtime (and Triton): not for `autopar --help`

    with splitting_sequences(cp > 1):  # a user's loss takes a chunk's labels from its shift_labels
        traced = trace_model(model, args, kwargs, compute_dtype=compute_dtype(precision))
    return _cp_graph(traced, cp)


def _cp_graph(traced, cp: int):
    """`traced` as a cp program runs it: without the causal masks its chunks would build (cp above 1)."""
    if cp <= 1:
        return traced
    return drop_causal_masks(traced)


def cp_traced_batch(model, args, kwargs, cp: int):
    """The batch a cp plan traces `model` with (`context_parallel.inputs.traced_batch`)."""
    return traced_batch(args, kwargs, cp, causal_lm=is_causal_lm(model))


def cp_rank_batch(model, args, kwargs, cp: int):
    """cp rank 0's share of a batch (`context_parallel.inputs.local_batch`): the shape every cp rank runs."""
    return local_batch(args, kwargs, cp, 0, causal_lm=is_causal_lm(model))


def program_trace(model, plan: Plan, args, kwargs):
    """The model traced at the program's shape in the plan's compute format, fused when the plan fuses."""
    cp = plan.mesh.get("cp", 1)
    if cp > 1:  # one cp rank's share of the sequences: the rows each rank of the data axis runs
        args, kwargs = cp_rank_batch(model, args, kwargs, cp)
    traced = trace_in_format(model, args, kwargs, plan.precision, cp)
    if plan.fusion.get("enabled"):  # the program runs the graph the plan priced
        traced = fuse_traced(traced, **fusion_knobs(plan.fusion.get("kinds", FUSION_KINDS)))
    return traced


def length_tracer(model, plan: Plan, traced):
    """What a program traces the model with at a shorter sequence length (`autopar.runtime.shapes`): `program_trace`
    over a copy of the model without its weights; None for a program that traces nothing."""
    if traced is None:
        return None
    from autopar.runtime.shapes import fake_copy  # the runtime is imported when a program is built

    return functools.partial(program_trace, fake_copy(model), plan)


def trace_shortened(module, args, kwargs, say, fuse: bool = False, cp: int = 1, kinds=FUSION_KINDS) -> OpGraph | None:
    """Trace a preset with two of its identical layers standing for all of them; None when that is not valid."""
    from autopar import presets  # transformers: imported when a preset is traced, not for `autopar --help`

    config = getattr(module, "config", None)
    if config is None or config.model_type not in _UNIFORM_MODEL_TYPES:
        return None
    depth = int(getattr(config, "num_hidden_layers", 0) or 0)
    if depth <= _SHORT_TRACE_LAYERS:
        return None
    if any(isinstance(v, (list, tuple)) and len(v) == depth for v in config.to_dict().values()):
        return None  # a per-layer setting: layers may differ
    dtype = next(module.parameters()).dtype
    short_config = copy.deepcopy(config)
    short_config.num_hidden_layers = _SHORT_TRACE_LAYERS
    short = presets.build_model(short_config, device="meta", dtype=dtype)
    traced = _cp_graph(trace_model(short, args, kwargs), cp)
    if fuse:
        traced = fuse_traced(traced, **fusion_knobs(kinds))
    probe = OpGraph.from_traced(traced)
    containers = {c for c, _ in probe.node_layer.values() if c is not None}
    if len(containers) != 1:
        return None
    try:
        graph = OpGraph.from_traced(traced, layer_repeats={containers.pop(): depth})
    except ValueError:
        return None
    say(f"traced {_SHORT_TRACE_LAYERS} of {depth} identical layers; each stands for {depth / _SHORT_TRACE_LAYERS:g}")
    return graph


__all__ = ["cp_rank_batch", "cp_traced_batch", "program_trace", "trace_in_format", "trace_shortened"]
