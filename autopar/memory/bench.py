"""Benchmark: AdamW over flat chunks against torch.optim.AdamW over the model's separate tensors.

    python -m autopar.memory bench [--layers 6] [--hidden 768] [--repeats 5] [--threads 1 2]

Builds a LLaMA-shaped model on the CPU (about 92M parameters with the defaults), gives every
parameter a random gradient, and times one optimizer step, side by side in one run over the same
values: the chunk AdamW ("blocked" and "fused" implementations, over a store's flat chunks) and
torch.optim.AdamW with fused=True, foreach=True and foreach=False over the separate tensors. Prints
the median step time of each and the ratios, for each thread count. A benchmark, not a test: the
figures depend on the machine.
"""

from __future__ import annotations

import argparse

import torch

from autopar import presets
from autopar.cost_model.calibrate import median_time_s
from autopar.memory.adamw import chunk_adamw_step
from autopar.memory.layout import ParamSpec
from autopar.memory.store import ChunkStore

HPARAMS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2}


def build_params(layers: int, hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The parameters of a LLaMA-shaped model (vocab 32000, MLP 8/3 x hidden), built on the CPU."""
    cfg = presets.load_config(
        "tiny-llama",
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        vocab_size=32000,
    )
    torch.manual_seed(seed)
    model = presets.build_model(cfg, device="cpu")
    return {n: p.detach() for n, p in model.named_parameters()}


def _median_time(fn, repeats: int) -> float:
    # one warm-up call: state allocation, first-touch page faults
    return median_time_s(fn, repeats, warmup=1)


def _torch_case(values: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], **flags):
    params = [torch.nn.Parameter(v.clone()) for v in values.values()]
    for p, g in zip(params, grads.values(), strict=True):
        p.grad = g
    opt = torch.optim.AdamW(
        params,
        lr=HPARAMS["lr"],
        betas=(HPARAMS["beta1"], HPARAMS["beta2"]),
        eps=HPARAMS["eps"],
        weight_decay=HPARAMS["weight_decay"],
        **flags,
    )
    return opt.step, (params, opt)


def _chunk_case(store: ChunkStore, impl: str):
    chunks = store.trainable_chunks()
    state = {"step": 0}
    bufs = (
        [c.master for c in chunks],
        [c.grad for c in chunks],
        [c.exp_avg for c in chunks],
        [c.exp_avg_sq for c in chunks],
    )

    def step():
        state["step"] += 1
        chunk_adamw_step(*bufs, step=state["step"], impl=impl, **HPARAMS)

    return step


def run(layers: int, hidden: int, repeats: int, threads: list[int], chunk_numel: int | None) -> list[dict]:
    values = build_params(layers, hidden)
    num = sum(v.numel() for v in values.values())
    g = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(v.shape, generator=g) * 1e-3 for n, v in values.items()}
    store = ChunkStore([ParamSpec(n, tuple(v.shape)) for n, v in values.items()], chunk_numel=chunk_numel, device="cpu")
    store.load_state(values)
    for name, grad in grads.items():
        store.add_grad(name, grad)
    print(
        f"{num / 1e6:.1f}M parameters in {len(values)} tensors; {store.num_chunks} chunks of "
        f"{store.chunk_numel / 1e6:.2f}M elements (waste {store.waste() / max(num, 1):.2%})"
    )
    rows = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        times = {}
        for impl in ("blocked", "fused"):
            times[f"chunk-{impl}"] = _median_time(_chunk_case(store, impl), repeats)
        for label, flags in (
            ("torch-fused", {"fused": True}),
            ("torch-foreach", {"foreach": True}),
            ("torch-for-loop", {"foreach": False}),
        ):
            step, keep = _torch_case(values, grads, **flags)
            times[label] = _median_time(step, repeats)
            del step, keep
        rows.append({"threads": n_threads, "numel": num, **times})
        _print_row(n_threads, num, times)
    return rows


def _print_row(n_threads: int, num: int, times: dict[str, float]) -> None:
    base_fused, base_loop = times["torch-fused"], times["torch-for-loop"]
    print(f"\nthreads={n_threads}  (median step time; speed-up = torch time / this time)")
    print(f"  {'optimizer':<16}{'ms':>9}{'GB/s':>8}{'vs fused':>10}{'vs for-loop':>13}")
    for label, t in times.items():
        gbps = num * 4 * 7 / t / 1e9  # reads p, g, m, v; writes p, m, v
        print(f"  {label:<16}{t * 1e3:>9.1f}{gbps:>8.1f}{base_fused / t:>9.2f}x{base_loop / t:>12.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m autopar.memory bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--chunk-numel", type=int, default=None, help="default: chosen by choose_chunk_size")
    args = ap.parse_args(argv)
    run(args.layers, args.hidden, args.repeats, args.threads, args.chunk_numel)
