"""A complete fine-tuning job with autopar on CPU ranks: tokenizer, padded data, schedule, clipping, LoRA,
checkpoints, export, generation.

    torchrun --standalone --nproc_per_node 2 examples/finetune.py --workdir /tmp/ft --steps 20
    torchrun --standalone --nproc_per_node 2 examples/finetune.py --workdir /tmp/ft-lora --steps 20 --lora
    # run it again with more --steps and the same --workdir: it resumes from the newest checkpoint
    # smaller: --layers 1 --hidden-size 32 --max-length 16 --steps 4 (the test's form, tests/distributed)

1. A tokenizer trained on a local text file with `tokenizers` (byte-level BPE, no network): `--text FILE`, or a
   built-in text written to `<workdir>/corpus.txt`.
2. A dataset of its lines, of varying lengths: each batch is padded to its longest line rounded up to a multiple of
   8 (right padding: `attention_mask` 0 and labels -100 there), at most `--max-length` tokens, the length the
   program is planned for. Shorter batches run on the plan's layout, each length traced once (at most 8 kept).
   Every rank passes the same global batch (`pm.data_loader` draws it the same way on every rank; autopar takes
   each rank's share). With `local_batch=True` each data-parallel rank would pass its own rows instead, which
   must then be padded to a length every rank agrees on.
3. The model: a small LLaMA written to `<workdir>/base` at the first start (or `--weights DIR`), with LoRA adapters on
   the attention projections with `--lora` (`peft`).
4. `autopar.compile(..., max_grad_norm=1.0)`: the gradients are clipped to a global norm of 1.0, and a step whose
   loss or gradients are not finite raises (compile with `on_nonfinite="skip"` to skip it).
5. AdamW with a linear warm-up and a cosine decay (`LambdaLR` on `pm.optimizer`); `pm.last_step` gives each step's
   loss, gradient norm and tokens.
6. A checkpoint every `--save-every` steps (`pm.save_checkpoint`, with the schedule's state in `extra`); at start the
   newest one under `<workdir>/checkpoints` is resumed from (`--stop-at` stops a run early, as an interruption would),
   on the plan the first start made and kept in `<workdir>/plan.json` (`compile(..., plan=)`: no planning again).
7. `pm.save_pretrained(<workdir>/final)`: Hugging Face weights (with `--lora`: the adapters, as PEFT saves them, and
   the merged model in `<workdir>/merged`). Rank 0 loads them with transformers (and peft) and generates a few tokens.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.runtime import ensure_process_group

TEXT = [
    "the cat sat on the mat",
    "a quick brown fox jumps over the lazy dog while the cat watches from the mat",
    "rain falls on the hills",
    "the dog and the fox run along the river in the morning light",
    "we train small models on small machines",
    "every rank reads the same batch and takes its share of the rows",
    "short line",
    "the optimizer steps once the gradients of every rank are summed and clipped",
]
PAD_MULTIPLE = 8


def write_corpus(workdir: Path, text: str | None) -> Path:
    """The text the tokenizer learns and the model trains on: `--text`, or the built-in lines (rank 0 writes)."""
    if text is not None:
        return Path(text)
    path = workdir / "corpus.txt"
    if dist.get_rank() == 0 and not path.exists():
        path.write_text("\n".join(line for _ in range(8) for line in TEXT) + "\n")
    dist.barrier()
    return path


def train_tokenizer(corpus: Path, workdir: Path, vocab_size: int):
    """A byte-level BPE tokenizer learned from the corpus (rank 0 trains and saves it, every rank loads it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = workdir / "tokenizer.json"
    if dist.get_rank() == 0 and not path.exists():
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train([str(corpus)], trainer)
        tok.save(str(path))
    dist.barrier()
    return PreTrainedTokenizerFast(tokenizer_file=str(path), pad_token="<pad>", bos_token="<s>", eos_token="</s>")


class Lines(torch.utils.data.Dataset):
    """The corpus's lines as token ids, each `<s> line </s>`, cut at `max_length`."""

    def __init__(self, corpus: Path, tokenizer, max_length: int):
        lines = [line for line in corpus.read_text().splitlines() if line.strip()]
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.rows = [[bos, *tokenizer(line)["input_ids"], eos][:max_length] for line in lines]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> list[int]:
        return self.rows[i]


def collate(rows: list[list[int]], pad_id: int, max_length: int, length: int | None = None) -> dict:
    """Right-pad a batch to its longest row rounded up to a multiple of 8, so that few lengths are traced (or to
    `length`)."""
    if length is None:
        length = min(max_length, PAD_MULTIPLE * math.ceil(max(len(r) for r in rows) / PAD_MULTIPLE))
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def base_weights(workdir: Path, vocab_size: int, max_length: int, hidden_size: int, layers: int) -> Path:
    """A small LLaMA written by transformers (rank 0 writes, the others wait)."""
    path = workdir / "base"
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_length,
            use_cache=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier()
    return path


def build_model(weights: Path, lora: bool):
    """The model every rank builds alike: the adapters' random initialisation seeded the same on every rank (and
    in every run, so a resumed run and one that went straight through start from the same weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(weights)
    if lora:
        import peft

        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
    return model


def warmup_cosine(warmup: int, total: int):
    """The learning-rate factor of step s: linear warm-up over `warmup` steps, then a cosine decay to 10%."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return factor


def export_and_generate(args, workdir: Path, weights: Path, tokenizer) -> None:
    """Rank 0: load what save_pretrained wrote with transformers (and peft) and generate a few tokens."""
    from transformers import AutoModelForCausalLM

    if args.lora:
        import peft

        model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(weights), workdir / "final")
        merged = AutoModelForCausalLM.from_pretrained(workdir / "merged")
    else:
        model = merged = AutoModelForCausalLM.from_pretrained(workdir / "final")
    prompt = tokenizer("the cat", return_tensors="pt")["input_ids"]
    prompt = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), prompt], dim=1)
    for name, m in (("loaded", model), ("merged", merged)):
        out = m.eval().generate(
            prompt, max_new_tokens=args.generate, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        print(f"{name} generates: {tokenizer.decode(out[0, prompt.shape[1] :])!r}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--text", help="a text file to learn the tokenizer and train on (default: built-in lines)")
    ap.add_argument("--weights", help="a Hugging Face LLaMA folder to start from (default: a small one, written)")
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters instead of every weight")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4, help="the global batch (rows per step)")
    ap.add_argument("--max-length", type=int, default=32, help="the longest batch, the length planned for")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the small LLaMA written at the start")
    ap.add_argument("--hidden-size", type=int, default=64, help="its hidden size (4 heads, 2 key-value heads)")
    ap.add_argument("--vocab-size", type=int, default=384, help="the tokenizer's (256 bytes, 3 specials, merges)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--generate", type=int, default=5, help="tokens to generate from the exported model")
    ap.add_argument("--stop-at", type=int, help="stop after this step, as an interrupted job would (checkpointed)")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    cluster = f"cpu:{os.environ.get('WORLD_SIZE', 1)}"  # torchrun's ranks
    ensure_process_group(autopar.ClusterSpec.parse(cluster))
    if dist.get_rank() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    corpus = write_corpus(workdir, args.text)
    tokenizer = train_tokenizer(corpus, workdir, args.vocab_size)
    weights = (
        Path(args.weights)
        if args.weights
        else base_weights(workdir, len(tokenizer), args.max_length, args.hidden_size, args.layers)
    )
    dataset = Lines(corpus, tokenizer, args.max_length)
    pad = tokenizer.pad_token_id

    # plan for the longest batch: one of max_length tokens (shorter ones run on its layout)
    example = collate([dataset[i] for i in range(args.batch_size)], pad, args.max_length, length=args.max_length)
    # planned at the first start and kept: a resumed run runs the layout its checkpoints were written on
    plan_file = workdir / "plan.json"
    plan = autopar.Plan.from_json(plan_file.read_text()) if plan_file.exists() else None
    pm = autopar.compile(
        build_model(weights, args.lora),
        cluster,
        example_kwargs=example,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0),
        plan=plan,
        max_grad_norm=1.0,
    )
    if plan is None and dist.get_rank() == 0:
        plan_file.write_text(pm.plan.to_json())
    schedule = torch.optim.lr_scheduler.LambdaLR(pm.optimizer, warmup_cosine(args.warmup, args.steps))
    loader = pm.data_loader(dataset, seed=0, collate_fn=lambda rows: collate(rows, pad, args.max_length))

    start = 0
    found = autopar.latest_checkpoint(workdir / "checkpoints")
    if found is not None:
        extra = pm.load_checkpoint(found)
        schedule.load_state_dict(extra["schedule"])
        start = extra["step"]
        if dist.get_rank() == 0:
            print(f"resumed from {found} at step {start}", flush=True)

    per_epoch = len(loader)
    step = start
    while step < args.steps:
        epoch, skip = divmod(step, per_epoch)
        loader.sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i < skip:
                continue  # done before the checkpoint this run resumed from
            pm.train_step(**batch)
            schedule.step()
            step += 1
            stats = pm.last_step
            if dist.get_rank() == 0:
                print(
                    f"step {step}: loss {stats.loss:.4f}, grad norm {stats.grad_norm:.3f}, tokens {stats.tokens}, "
                    f"length {batch['input_ids'].shape[1]}, lr {schedule.get_last_lr()[0]:.2e}",
                    flush=True,
                )
            stop = step == args.steps or step == args.stop_at
            if step % args.save_every == 0 or stop:
                pm.save_checkpoint(
                    workdir / "checkpoints" / f"step{step:06d}",
                    extra={"step": step, "schedule": schedule.state_dict()},
                    keep_last=2,
                )
            if stop:
                break
        if step == args.stop_at:
            if dist.get_rank() == 0:
                print(f"stopped at step {step}", flush=True)
            dist.destroy_process_group()
            return

    pm.save_pretrained(workdir / "final")
    if args.lora:
        pm.save_pretrained(workdir / "merged", merged=True)
    if dist.get_rank() == 0:
        print(f"final loss {pm.last_step.loss:.6f}; wrote {workdir / 'final'}", flush=True)
        export_and_generate(args, workdir, weights, tokenizer)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
