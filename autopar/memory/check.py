"""Check: a model whose states exceed the device budget trains with offload, and its measured peak is the plan's.

    python -m autopar.memory check [--device cuda|cpu] [--gpu H200-141GB] [--layers 8] [--hidden 1024]
                                   [--seq 1024] [--batch 8] [--budget-fraction 0.6] [--steps 4]

Builds a LLaMA-shaped model (vocab 32000) on the CPU, plans it for one device with a memory budget of
`--budget-fraction` times its model states (parameters, gradients and AdamW states, as the planner
counts them without offload), so that only host offload makes it fit, compiles the plan and trains
`--steps` steps. It prints the losses, the plan's predicted peak, the memory tracker's peak and, on a
GPU, `torch.cuda.max_memory_allocated` over the steps after the first (everything the device held:
the states the plan keeps there, the chunks in flight, activations and working memory), and the
ratios. Exit status 1 when the plan does not offload, a loss is not finite, or
(on a GPU) the measured peak is more than `--tolerance` (10%) away from the prediction.

On CPU there is no allocator statistic: the tracker's figure is the measurement, and the check shows
how far the plan's (conservative) accounting is from what the runtime holds.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from autopar.units import GIB


def _model_and_batch(args):
    from autopar import presets

    cfg = presets.load_config(
        "tiny-llama",
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        vocab_size=32000,
        max_position_embeddings=max(args.seq, 64),
    )
    torch.manual_seed(0)
    model = presets.build_model(cfg, device="cpu")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (args.batch, args.seq), generator=g)
    return model, (), {"input_ids": ids, "labels": ids.clone()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autopar.memory check", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gpu", default="H200-141GB", help="the device preset the GPU is planned as")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--budget-fraction", type=float, default=0.6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tolerance", type=float, default=0.10)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu to check the CPU path")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import autopar
    from autopar.runtime import ensure_process_group

    cluster = f"1x{args.gpu}" if args.device == "cuda" else "cpu:1"
    model, inputs, kwargs = _model_and_batch(args)
    free = autopar.plan(
        model, cluster, inputs, kwargs, offload=False, memory_budget=float("inf"), constraints={"tp": 1}
    )
    mem = free.predicted.memory_breakdown
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    budget = args.budget_fraction * states
    plan = autopar.plan(model, cluster, inputs, kwargs, memory_budget=budget, constraints={"tp": 1})
    print(plan.summary())
    print(
        f"model states {states / GIB:.3f} GiB, budget {budget / GIB:.3f} GiB ({args.budget_fraction:.0%} of the states)"
    )
    ok = bool(plan.offload)
    if not ok:
        print("FAIL: the plan does not offload")
    ensure_process_group(plan.cluster)
    program = autopar.compile(model, cluster, inputs, kwargs, plan=plan)
    cuda = args.device == "cuda"
    losses = []
    for step in range(args.steps):
        if step == 1:  # the first step allocates the optimizer's bookkeeping and records the chunk order
            program.tracker.reset_peak()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
        losses.append(program.train_step(*inputs, **kwargs))
    if cuda:
        torch.cuda.synchronize()
    print("losses", " ".join(f"{v:.4f}" for v in losses))
    if not all(math.isfinite(v) for v in losses):
        ok = False
        print("FAIL: a loss is not finite")
    predicted = plan.predicted.peak_memory_bytes
    rows = [("plan's predicted peak", predicted), ("memory tracker's peak", program.tracker.peak)]
    if cuda:
        rows.append(("torch.cuda.max_memory_allocated", torch.cuda.max_memory_allocated()))
    for name, value in rows:
        print(f"  {name:42s} {value / GIB:10.4f} GiB  {value / predicted:6.2f}x the prediction")
    if cuda:
        measured = rows[-1][1]
        if abs(measured - predicted) > args.tolerance * predicted:
            ok = False
            print(
                f"FAIL: measured peak is {measured / predicted - 1:+.1%} from the prediction "
                f"(tolerance {args.tolerance:.0%})"
            )
    print("ok" if ok else "check failed")
    return 0 if ok else 1
