"""The `lengths` suite: step time of a batch at half the planned sequence length against the full length.

A program planned for S tokens runs shorter batches on the same layout (`autopar.runtime.shapes`): the model is
traced again at the new length, once. On a compute-bound model the half-length step should take about half the
time (attention, quadratic in the length, a little less; per-step fixed costs, the optimizer step among them,
a little more), not the full-length time that padding every batch to S costs. Measured on one CPU process (one
thread) for the data-parallel program and the sharded program (ZeRO-1 with full recompute on one rank: the
DTensor path), next to a program compiled for the half length itself (what planning for it would give).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

# a LLaMA of 8.7M parameters whose matmuls dominate a step on a CPU core
MODEL = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6, vocab_size=2048)
BATCH, LENGTH = 4, 256
PROGRAMS = {"data-parallel": {"tp": 1}, "sharded": {"tp": 1, "zero": 1, "recompute": "full"}}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **MODEL, num_key_value_heads=MODEL["num_attention_heads"], max_position_embeddings=LENGTH, use_cache=False
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _batch(length: int):
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, length), generator=g)
    return (ids,), {"labels": ids.clone()}


def _step_time(pm, length: int, repetitions: int) -> tuple[float, float]:
    """(wall, CPU) median seconds of `repetitions` steps at `length` after one warm-up step (which traces a new
    length). The process's CPU time is what a shared machine's other loads disturb least."""
    args, kwargs = _batch(length)
    pm.train_step(*args, **kwargs)
    wall, cpu = [], []
    for _ in range(repetitions):
        t0, c0 = time.perf_counter(), time.process_time()
        pm.train_step(*args, **kwargs)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return sorted(wall)[len(wall) // 2], sorted(cpu)[len(cpu) // 2]


def measure(program: str, repetitions: int = 3) -> dict:
    """Step times of one program kind: planned at LENGTH and run at LENGTH and LENGTH / 2, and planned at LENGTH / 2."""
    import autopar

    constraints = PROGRAMS[program]
    full = autopar.compile(_model(), "cpu:1", *_batch(LENGTH), constraints=constraints)
    assert str(full.plan.program) == program, full.plan.program
    (w_full, c_full), (w_half, c_half) = (
        _step_time(full, LENGTH, repetitions),
        _step_time(full, LENGTH // 2, repetitions),
    )
    planned_half = autopar.compile(_model(), "cpu:1", *_batch(LENGTH // 2), constraints=constraints)
    w_planned, c_planned = _step_time(planned_half, LENGTH // 2, repetitions)
    return {
        "program": program,
        "full_s": w_full,
        "half_s": w_half,
        "planned_half_s": w_planned,
        "full_cpu_s": c_full,
        "half_cpu_s": c_half,
        "planned_half_cpu_s": c_planned,
        "half_over_full_cpu": c_half / c_full,
        "lengths_traced": full.lengths.traced,
    }


def run(out_dir, *, quick: bool = False, show_progress: bool = True) -> dict:
    """Measure every program kind of `PROGRAMS` (one process, one thread); write lengths.json and lengths.md."""
    import platform

    torch.set_num_threads(1)
    rows = []
    for program in PROGRAMS if not quick else ["data-parallel"]:
        if show_progress:
            print(f"lengths: {program}", flush=True)
        rows.append(measure(program, repetitions=2 if quick else 5))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "suite": "lengths",
        "model": MODEL,
        "batch": BATCH,
        "planned_length": LENGTH,
        "torch": torch.__version__,
        "machine": platform.machine(),  # processor() runs `uname -p` in a child process
        "rows": rows,
    }
    (out / "lengths.json").write_text(json.dumps(doc, indent=1))
    lines = [
        f"Step time at half the planned length ({LENGTH // 2} of {LENGTH} tokens, batch {BATCH}), one CPU thread",
        "",
        "",
        "CPU seconds of the process per step (wall seconds in brackets), medians:",
        "",
        "| program | full | half | half / full (CPU) | planned for half |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['program']} | {r['full_cpu_s']:.3f} ({r['full_s']:.3f}) | {r['half_cpu_s']:.3f} ({r['half_s']:.3f}) | "
        f"{r['half_over_full_cpu']:.2f} | {r['planned_half_cpu_s']:.3f} ({r['planned_half_s']:.3f}) |"
        for r in rows
    ]
    (out / "lengths.md").write_text("\n".join(lines) + "\n")
    return doc


if __name__ == "__main__":
    import sys

    print(json.dumps(run(sys.argv[1] if len(sys.argv) > 1 else "bench-lengths"), indent=1))
