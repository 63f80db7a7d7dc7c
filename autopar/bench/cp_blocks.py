"""GPU benchmark of context-parallel attention blocks: a zig-zag rank's pairs against one full-sequence call.

Run ``python -m autopar.bench.cp_blocks`` on a machine with one CUDA GPU (about two to three minutes, most of it
the kernels' autotuning of each block size). Without a CUDA device it says so and exits 0 without running
anything.

What it measures, for sequences of 32K, 64K and 128K tokens (bf16, batch 1, 8 query heads and 8 key/value
heads of dim 128, causal) split over c = 2, 4, 8 ranks in zig-zag order (2c chunks of L / 2c tokens; rank r
holds chunks r and 2c-1-r):

1. correctness first: one rank's pairs, merged by their log-sum-exp, against the rows of the full call
   (bf16, 4K tokens, c = 2; tolerance 2e-2 of the largest value, about five bf16 roundings); a failure makes
   the exit status 1;
2. efficiency: every rank does the same pairs under zig-zag, two diagonal pairs (a chunk against itself,
   causal) and 2c-1 visible ones (a chunk against an earlier chunk, no mask), each one call of autopar's Triton
   kernel (``attention_block_forward`` / ``attention_block_backward``). Pairs of one kind and size cost the
   same, so a rank's time is 2 t_diagonal + (2c-1) t_visible, from one timed call of each. Efficiency is the
   rank's throughput (its FLOPs, 1/c of the sequence's, over its time) over the full call's (one causal call
   on the whole sequence), forward and forward+backward. FLOPs: ``4 b h n^2 d`` per visible pair of n tokens,
   half of it on a diagonal pair and on the causal full call, backward 2.5x the forward. The target is 0.9 of
   the full call's throughput where the kernel's calls are at least 8K tokens (``chunk`` >= 8192); rows below
   are reported too, marked as outside the target;
3. the merge: the rank's 2c+1 log-sum-exp merges of (out, lse) pairs (``context_parallel.blocks.merge``),
   their time and their share of the rank's forward.

Nothing is compared with published figures; the output is the measurement of the machine it runs on.

``--smoke --device cpu`` (with ``TRITON_INTERPRET=1``) runs every step at tiny sizes in the Triton interpreter
on CPU tensors, times from a CPU clock: a test that the script runs, not a measurement.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch

TARGET_EFFICIENCY = 0.9
TARGET_MIN_CHUNK = 8192
SEQUENCES = (32768, 65536, 131072)
DEGREES = (2, 4, 8)
SMOKE_SEQUENCES, SMOKE_DEGREES = (64,), (2,)
FAILED: list[str] = []


def _time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Milliseconds per call: triton's do_bench on CUDA, else the median of `repeats` timed calls after a warm-up."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        fn()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _qkv(seq: int, heads: int, head_dim: int, dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, generator=g) for _ in range(3)]


def zigzag_pairs(num_ranks: int, rank: int = 0) -> list[tuple[int, int, bool]]:
    """(query chunk, key chunk, causal) of every pair rank `rank` computes under a causal mask (hidden ones left
    out): its chunks r and 2c-1-r against every chunk at or before each."""
    mine = (rank, 2 * num_ranks - 1 - rank)
    return [(qc, kc, qc == kc) for qc in mine for kc in range(qc + 1)]


def check_merge(device, dtype, seq: int, num_ranks: int, heads: int, head_dim: int) -> None:
    """One rank's pairs merged by LSE against the same rows of the full causal call."""
    from autopar.context_parallel import blocks
    from autopar.triton_kernels.flash_attention import attention_block_forward

    q, k, v = _qkv(seq, heads, head_dim, dtype, device)
    scale = 1.0 / math.sqrt(head_dim)
    full, _ = attention_block_forward(q, k, v, causal=True, scale=scale)
    n = seq // (2 * num_ranks)
    worst = 0.0
    for qc in (0, 2 * num_ranks - 1):
        part = None
        for _, kc, causal in (p for p in zigzag_pairs(num_ranks) if p[0] == qc):
            qs, ks = slice(qc * n, (qc + 1) * n), slice(kc * n, (kc + 1) * n)
            found = attention_block_forward(
                q[:, :, qs], k[:, :, ks], v[:, :, ks], causal=causal, scale=scale, q_offset=qc * n, k_offset=kc * n
            )
            part = blocks.merge(part, found)
        expected = full[:, :, qc * n : (qc + 1) * n].float()
        worst = max(worst, (part[0].float() - expected).abs().max().item() / (expected.abs().max().item() or 1.0))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: a few roundings of P and of the outputs
    ok = math.isfinite(worst) and worst <= tol
    if not ok:
        FAILED.append(f"merge {seq} c={num_ranks}")
    print(
        f"  {'ok  ' if ok else 'FAIL'} zig-zag rank 0 of c={num_ranks}, {seq} tokens, merged vs full call: "
        f"max error {worst:.1e} of the largest value (tol {tol:.0e})"
    )


def _pair_times(q, k, v, n: int, causal: bool, device, repeats: int) -> tuple[float, float, tuple]:
    """(forward ms, backward ms, forward result) of one pair of n-token chunks (diagonal when causal)."""
    from autopar.triton_kernels.flash_attention import attention_block_backward, attention_block_forward

    scale = 1.0 / math.sqrt(q.shape[-1])
    # a diagonal pair: a chunk against itself; a visible one: the second chunk against the first (no mask). One
    # call's time does not depend on where its rows sit, so the first chunks stand for every chunk.
    qs = q[:, :, :n] if causal else q[:, :, n : 2 * n]
    ks, vs = k[:, :, :n], v[:, :, :n]
    offsets = {"q_offset": 0 if causal else n, "k_offset": 0}
    out, lse = attention_block_forward(qs, ks, vs, causal=causal, scale=scale, **offsets)
    dout = torch.ones_like(out)
    fwd = _time_ms(lambda: attention_block_forward(qs, ks, vs, causal=causal, scale=scale, **offsets), device, repeats)
    bwd = _time_ms(
        lambda: attention_block_backward(dout, qs, ks, vs, out, lse, causal=causal, scale=scale, **offsets),
        device,
        repeats,
    )
    return fwd, bwd, (out, lse)


def bench_blocks(sequences, degrees, device, dtype, heads: int, head_dim: int, repeats: int) -> list[dict]:
    """Efficiency rows (see the module docstring); printed as they come."""
    from autopar.context_parallel import blocks

    rows = []
    print(f"per-block efficiency against one full causal call ({dtype}, {heads} heads, head dim {head_dim})")
    print(
        f"  {'tokens':>7} {'c':>2} {'chunk':>6} {'full fwd ms':>11} {'rank fwd ms':>11} {'eff fwd':>7} "
        f"{'full f+b ms':>11} {'rank f+b ms':>11} {'eff f+b':>7} {'merge ms':>8} {'merge/fwd':>9}  target"
    )
    for seq in sequences:
        q, k, v = _qkv(seq, heads, head_dim, dtype, device)
        full_fwd, full_bwd, _ = _pair_times(q, k, v, seq, True, device, repeats)
        full_flops = 4 * heads * seq * seq * head_dim / 2
        for c in degrees:
            n = seq // (2 * c)
            diag_fwd, diag_bwd, (out, lse) = _pair_times(q, k, v, n, True, device, repeats)
            vis_fwd, vis_bwd, _ = _pair_times(q, k, v, n, False, device, repeats)
            num_visible = 2 * c - 1
            rank_fwd = 2 * diag_fwd + num_visible * vis_fwd
            rank_fb = rank_fwd + 2 * diag_bwd + num_visible * vis_bwd
            rank_flops = full_flops / c
            eff_fwd = (rank_flops / rank_fwd) / (full_flops / full_fwd)
            eff_fb = (rank_flops / rank_fb) / (full_flops / (full_fwd + full_bwd))

            def merges(out=out, lse=lse, count=2 * c + 1):
                part = None
                for _ in range(count):
                    part = blocks.merge(part, (out, lse))
                return part

            merge_ms = _time_ms(merges, device, repeats)
            in_target = n >= TARGET_MIN_CHUNK
            verdict = ("met" if min(eff_fwd, eff_fb) >= TARGET_EFFICIENCY else "missed") if in_target else "n/a"
            print(
                f"  {seq:7d} {c:2d} {n:6d} {full_fwd:11.3f} {rank_fwd:11.3f} {eff_fwd:7.2f} "
                f"{full_fwd + full_bwd:11.3f} {rank_fb:11.3f} {eff_fb:7.2f} {merge_ms:8.3f} "
                f"{merge_ms / rank_fwd:9.3f}  {verdict}"
            )
            rows.append(
                {
                    "tokens": seq,
                    "degree": c,
                    "chunk": n,
                    "efficiency_forward": eff_fwd,
                    "efficiency_forward_backward": eff_fb,
                    "merge_ms": merge_ms,
                    "target": verdict,
                }
            )
        del q, k, v
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.bench.cp_blocks", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu runs the kernels in the Triton interpreter (needs TRITON_INTERPRET=1)",
    )
    parser.add_argument("--smoke", action="store_true", help="every step at tiny sizes: does the script run")
    args = parser.parse_args(argv)
    FAILED.clear()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "autopar.bench.cp_blocks: no CUDA device is available; this benchmark measures the Triton attention "
            "kernel on a GPU and is skipped here (--device cpu --smoke with TRITON_INTERPRET=1 checks that it "
            "runs). Nothing was measured."
        )
        return 0
    from autopar.triton_kernels import kernels_interpreted

    if args.device == "cpu" and not kernels_interpreted():
        print("autopar.bench.cp_blocks: --device cpu needs TRITON_INTERPRET=1 (the kernels run interpreted).")
        return 2
    if args.device == "cuda" and kernels_interpreted():
        print("autopar.bench.cp_blocks: TRITON_INTERPRET is set; unset it to measure the compiled kernels.")
        return 1
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}, torch {torch.__version__}")
    smoke = args.smoke or device.type == "cpu"
    heads, head_dim = (2, 16) if smoke else (8, 128)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    print("correctness")
    check_merge(device, dtype, 64 if smoke else 4096, 2, heads, head_dim)
    bench_blocks(
        SMOKE_SEQUENCES if smoke else SEQUENCES,
        SMOKE_DEGREES if smoke else DEGREES,
        device,
        dtype,
        heads,
        head_dim,
        repeats=1 if smoke else 3,
    )
    if FAILED:
        print(f"FAILED: {', '.join(FAILED)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
