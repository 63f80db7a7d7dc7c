"""Train a small LLaMA with autopar on local CPU ranks.

    torchrun --standalone --nproc_per_node 2 examples/train_llama.py --steps 5
    torchrun --standalone --nproc_per_node 4 examples/train_llama.py --pp 2 --schedule 1f1b

Every rank builds the same model (same seed) and passes the same global batch; autopar plans
the layout for `cpu:N`, keeps each rank's shards, and trains.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import autopar
from autopar import presets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--tp", type=int, default=None, help="pin the tensor-parallel axis size")
    ap.add_argument("--pp", type=int, default=None, help="pin the number of pipeline stages")
    ap.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "interleaved_1f1b"),
        default=None,
        help="pin the pipeline schedule (with --pp)",
    )
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # one CPU "node" per torchrun agent: `--nnodes 2` on one machine prices the link between them as a network
    cluster = f"cpu:{world}" if per_node == world else f"{world // per_node}x{per_node}xcpu"
    torch.manual_seed(0)
    config = presets.load_config("tiny-llama")
    model = presets.build_model(config, device="cpu")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=g)
    pins = {"tp": args.tp, "pp": args.pp, "schedule": args.schedule}
    constraints = {k: v for k, v in pins.items() if v is not None} or None
    pm = autopar.compile(
        model,
        cluster,
        (ids,),
        {"labels": ids},
        constraints=constraints,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    )
    rank = dist.get_rank()
    if rank == 0:
        print(pm.plan.summary(), flush=True)
    for step in range(args.steps):
        loss = pm.train_step(ids, labels=ids)
        if rank == 0:
            print(f"step {step + 1}: loss {loss:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
