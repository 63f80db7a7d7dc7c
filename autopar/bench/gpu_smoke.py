"""Smoke on one GPU: autopar imports, plans a preset, and trains a tiny model two bf16 steps like one process.

    python -m autopar.bench.gpu_smoke [--preset H100-80GB] [--device cuda|cpu]

Steps, each printed with its time:

1. import autopar (and its Triton kernels);
2. plan the llama2-7b preset on eight GPUs of this one's preset (global batch 8, sequence 2048);
3. compile the tiny-llama preset (vocab 256, 2 layers of width 64, a batch of 8 x 128 tokens) for one GPU
   (world size 1: a one-rank NCCL group, as ``torchrun --nproc_per_node 1`` starts, unless a launcher set one up)
   with ``precision="bf16"``, train two steps with SGD (momentum 0.9) and two with AdamW, and compare the losses with
   a single-process mixed-precision run on the same GPU (a bf16 copy of the model computes, fp32 masters are
   updated): within `LOSS_RTOL`.

Exit status 0 when every step ran and matched, 1 otherwise; without a CUDA device it says so in one line and
exits 2. ``--device cpu`` runs the same steps on one CPU rank in fp32 (a test that the script runs).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import socket
import sys
import time

import torch

# bf16 keeps 8 bits of mantissa: the program and the reference round differently wherever an op's order of
# summation differs (a fused attention kernel against SDPA, say), a few parts in a thousand on the loss after a
# step; a missing gradient, a wrong scale or a skipped update moves the second loss by far more than 2e-2.
LOSS_RTOL = 2e-2
LR = 1e-2
STEPS = 2


def _optimizer(name: str):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=LR, eps=1e-6)


def _one_rank_group(device: str) -> None:
    """Environment of a one-rank launch (as torchrun sets it), so that the program joins an NCCL group on a GPU."""
    if "RANK" in os.environ or device != "cuda":
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _tiny_model_and_batch():
    from autopar import presets

    torch.manual_seed(0)
    model = presets.build_model(presets.load_config("tiny-llama"), device="cpu")
    ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(1))
    return model, (ids,), {"labels": ids.clone()}


def reference_losses(model, args, kwargs, opt: str, device: str, dtype: torch.dtype) -> list[float]:
    """Single-process mixed precision: a copy of `model` in `dtype` computes, fp32 masters are updated."""
    compute = copy.deepcopy(model).to(device=device, dtype=dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in compute.parameters()]
    step = _optimizer(opt)(masters)
    args, kwargs = [a.to(device) for a in args], {k: v.to(device) for k, v in kwargs.items()}
    losses = []
    for _ in range(STEPS):
        with torch.no_grad():
            for c, m in zip(compute.parameters(), masters, strict=True):
                c.copy_(m)
        compute.zero_grad(set_to_none=True)
        loss = compute(*args, **kwargs).loss
        loss.backward()
        for c, m in zip(compute.parameters(), masters, strict=True):
            m.grad = None if c.grad is None else c.grad.float()
        step.step()
        losses.append(float(loss.detach()))
    return losses


def _timed(label: str, fn):
    start = time.perf_counter()
    out = fn()
    print(f"{label}: {time.perf_counter() - start:.1f} s", flush=True)
    return out


def run(preset: str, device: str) -> bool:
    """The steps of the module docstring; True when all of them ran and matched."""
    import autopar
    import autopar.triton_kernels  # noqa: F401 - registers the kernels' ops

    print(f"autopar imported; torch {torch.__version__}")
    big = _timed(
        "plan llama2-7b",
        lambda: autopar.plan("llama2-7b", f"8x{preset}", global_batch_size=8, seq_len=2048),
    )
    print(big.summary())
    cluster = f"1x{preset}" if device == "cuda" else "cpu:1"
    precision, dtype = ("bf16", torch.bfloat16) if device == "cuda" else ("fp32", torch.float32)
    ok = True
    for opt in ("sgd", "adamw"):
        model, args, kwargs = _tiny_model_and_batch()
        ref = reference_losses(model, args, kwargs, opt, device, dtype)
        t0 = time.perf_counter()
        program = autopar.compile(model, cluster, args, kwargs, optimizer=_optimizer(opt), precision=precision)
        print(f"compile tiny-llama ({opt}): {time.perf_counter() - t0:.1f} s", flush=True)
        got = [program.train_step(*args, **kwargs) for _ in range(STEPS)]
        close = all(math.isfinite(g) and abs(g - r) <= LOSS_RTOL * abs(r) for g, r in zip(got, ref, strict=True))
        ok &= close
        print(
            f"{opt}: program {str(program.plan.program)!r} losses {[round(v, 4) for v in got]}, "
            f"one process {[round(v, 4) for v in ref]}: {'match' if close else 'MISMATCH'} (rtol {LOSS_RTOL})"
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autopar.bench.gpu_smoke", description=__doc__.split("\n")[0])
    p.add_argument("--preset", help="the device preset this GPU is planned as (default: from its name)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"autopar.bench.gpu_smoke: no CUDA device (torch {torch.__version__}); run it on a GPU machine")
        return 2
    preset = args.preset
    if preset is None and args.device == "cuda":
        from autopar.bench.gpu_measure import preset_for

        props = torch.cuda.get_device_properties(0)
        preset = preset_for(props.name, props.total_memory)
    _one_rank_group(args.device)
    ok = run(preset or "A100-80GB", args.device)
    print("ok" if ok else "smoke failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
