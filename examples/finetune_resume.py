"""Fine-tune Hugging Face weights with autopar, checkpointing as it goes, resuming after a failure.

    torchrun --standalone --nproc_per_node 2 examples/finetune_resume.py --workdir /tmp/ft --steps 8
    # a rank that dies is restarted by torchrun, and the job resumes from the newest checkpoint:
    torchrun --standalone --nproc_per_node 2 --max-restarts 1 examples/finetune_resume.py --workdir /tmp/ft2 \
        --kill-rank 1 --kill-at-step 4

1. Hugging Face weights in: `--weights DIR` (a folder written by `save_pretrained`; without it, a tiny LLaMA
   is written to `<workdir>/base` first). The model is built on the meta device from the folder's config and
   `autopar.compile(..., pretrained=DIR)` has each rank read only the slices it holds.
2. Train, with a checkpoint every `--save-every` steps (`pm.save_checkpoint`, the newest `--keep-last` kept);
   the batch of step s is drawn from a generator seeded with s, so a resumed run sees the data it would have.
3. On start, `autopar.latest_checkpoint(<workdir>/checkpoints)` is resumed from when there is one.
4. Hugging Face weights out: `pm.save_pretrained(<workdir>/final)`, loadable by
   `transformers.AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.runtime import ensure_process_group


def base_weights(workdir: Path) -> Path:
    """A tiny LLaMA written by transformers (rank 0 writes, the others wait)."""
    path = workdir / "base"
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            use_cache=False,
        )
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()
    return path


def batch(step: int, size: int, seq_len: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (size, seq_len), generator=g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--weights", type=Path, default=None, help="Hugging Face weights to start from")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--kill-rank", type=int, default=None, help="this rank kills itself (first attempt only)")
    ap.add_argument("--kill-at-step", type=int, default=None)
    args = ap.parse_args()
    # torchrun's group (joined under a key prefix of this attempt, so a restarted job never dials a dead peer)
    ensure_process_group(autopar.ClusterSpec.parse(f"cpu:{os.environ['WORLD_SIZE']}"))
    world, rank = dist.get_world_size(), dist.get_rank()
    weights = args.weights or base_weights(args.workdir)

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(weights)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ids = batch(0, args.batch_size, args.seq_len, config.vocab_size)
    pm = autopar.compile(
        model,
        f"cpu:{world}",
        (ids,),
        {"labels": ids},
        pretrained=weights,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    )
    checkpoints = args.workdir / "checkpoints"
    start = 0
    latest = autopar.latest_checkpoint(checkpoints)
    if latest is not None:
        start = pm.load_checkpoint(latest)["step"]
        if rank == 0:
            print(f"resumed from {latest} at step {start}", flush=True)
    elif rank == 0:
        print(f"{pm.plan.program} program, mesh {dict(pm.plan.mesh)}, weights from {weights}", flush=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    loss = float("nan")
    for step in range(start + 1, args.steps + 1):
        if rank == args.kill_rank and step == args.kill_at_step and attempt == 0:
            print(f"rank {rank} kills itself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        ids = batch(step, args.batch_size, args.seq_len, config.vocab_size)
        loss = pm.train_step(ids, labels=ids)
        if rank == 0:
            print(f"step {step}: loss {loss:.6f}", flush=True)
        if step % args.save_every == 0:
            pm.save_checkpoint(checkpoints / f"step{step:06d}", extra={"step": step}, keep_last=args.keep_last)
    pm.save_pretrained(args.workdir / "final")
    if rank == 0:
        print(f"final loss {loss!r}; weights in {args.workdir / 'final'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
