"""GPU benchmark of the Triton kernels: correctness on the GPU first, then speed and memory next to PyTorch.

Run ``python -m autopar.triton_kernels.bench``. Without a CUDA device it says so and exits 0, so it is safe to call
anywhere; with one it prints:

1. correctness: every kernel against PyTorch (SDPA math, ``F.rms_norm``, ``F.layer_norm``, ``F.cross_entropy``)
   computed in fp32 from the same inputs, forward and all input gradients; a failure makes the exit status 1;
2. flash attention forward and forward+backward TFLOP/s, bf16, sequence 1k..16k, head dim 64 and 128, causal and
   not, next to ``F.scaled_dot_product_attention`` on its flash backend. Batch x heads fill the GPU with 16k
   tokens per batch and a model width of 2048 (heads = 2048 / head_dim). FLOPs: forward ``4 b h s^2 d``, backward
   2.5x the forward, half of each when causal;
3. ``linear_cross_entropy`` against ``F.cross_entropy`` on materialised bf16 logits at vocab 128256: time of
   forward+backward and peak memory above the inputs.

The first call of each attention shape autotunes (a few configs per kernel), which dominates the run time; the
whole script takes about three minutes on one H100 or H200. ``--quick`` runs a smaller sweep.

``--smoke`` runs every check and every timing row at tiny sizes (sequence 16..50, head dim 32, hidden 32, vocab
256) with one repeat: a test that the script works, not a measurement. With ``--device cpu`` (which needs
``TRITON_INTERPRET=1``) the kernels run in the Triton interpreter on CPU tensors, times come from a CPU clock,
and peak memory, which only CUDA's allocator counts, prints as n/a; ``--device cpu --smoke`` finishes in well
under a minute, so this script is known to run before it meets a GPU.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

FAILED: list[str] = []
# Timed calls per measurement on the CPU, after one warm-up call (on CUDA, triton.testing.do_bench decides).
CPU_REPEATS = 3


def _time_ms(
    fn: Callable[[], object],
    device: torch.device,
    grad_to_none: Sequence[torch.Tensor] = (),
    repeats: int = CPU_REPEATS,
) -> float:
    """Milliseconds per call of `fn`: do_bench's CUDA events on a GPU, the median of `repeats` by a CPU clock."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, grad_to_none=list(grad_to_none) or None)
    times = []
    for i in range(repeats + 1):
        for t in grad_to_none:
            t.grad = None
        start = time.perf_counter()
        fn()
        if i:  # the first call is the warm-up
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _peak_gib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory of a call of `fn` above what was allocated before, in GiB; None off CUDA (not run then)."""
    if device.type != "cuda":  # only CUDA's caching allocator keeps a peak
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _rate(x: float) -> str:
    """A TFLOP/s figure in 9 columns; interpreted kernels manage far below 0.1, which would print as 0.0."""
    return f"{x:9.1f}" if x >= 0.1 else f"{x:9.2e}"


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest elementwise error relative to the largest expected magnitude."""
    scale = expected.abs().max().item() or 1.0
    return ((actual.float() - expected.float()).abs().max().item()) / scale


def _report(what: str, errors: dict[str, float], tol: float) -> None:
    ok = all(math.isfinite(e) and e <= tol for e in errors.values())
    if not ok:
        FAILED.append(what)
    detail = "  ".join(f"{name} {err:.1e}" for name, err in errors.items())
    print(f"  {'ok  ' if ok else 'FAIL'} {what:55s} {detail}  (tol {tol:.0e} of max)")


def _grads_of(fn: Callable, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> tuple[torch.Tensor, list]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def _check_attention(b, hq, hkv, sq, sk, d, causal, dtype, gen, device) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from autopar.triton_kernels import flash_attention

    q = torch.randn(b, hq, sq, d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, hkv, sk, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    grad_out = torch.randn(b, hq, sq, d, device=device, dtype=dtype, generator=gen)
    out, grads = _grads_of(lambda q, k, v: flash_attention(q, k, v, causal=causal), [q, k, v], grad_out)

    def sdpa_fp32(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    ref, ref_grads = _grads_of(sdpa_fp32, [t.float() for t in (q, k, v)], grad_out.float())
    errors = {"out": _rel_error(out, ref)}
    errors.update({n: _rel_error(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True)})
    # 16-bit: P and dS are rounded to the input dtype before their matmuls (as in every flash kernel).
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
    _report(f"flash_attention {b}x{hq}/{hkv}x{sq}x{sk}x{d} causal={causal} {dtype}", errors, tol)


def _check_norms(rows, cols, dtype, gen, device) -> None:
    from autopar.triton_kernels import layer_norm, rms_norm

    x = torch.randn(rows, cols, device=device, dtype=dtype, generator=gen)
    w, b = (1 + 0.5 * torch.randn(cols, device=device, dtype=dtype, generator=gen) for _ in range(2))
    dy = torch.randn(rows, cols, device=device, dtype=dtype, generator=gen)
    cases = (
        ("rms_norm", lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (cols,), w, 1e-6), [x, w]),
        (
            "layer_norm",
            lambda x, w, b: layer_norm(x, w, b, 1e-5),
            lambda x, w, b: F.layer_norm(x, (cols,), w, b, 1e-5),
            [x, w, b],
        ),
    )
    for name, ours, theirs, params in cases:
        out, grads = _grads_of(ours, params, dy)
        ref, ref_grads = _grads_of(theirs, [t.float() for t in params], dy.float())
        errors = {"out": _rel_error(out, ref)}
        errors.update({f"d{i}": _rel_error(g, r) for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True))})
        # One rounding of each result to the input dtype; the statistics and sums are fp32.
        tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
        _report(f"{name} {rows}x{cols} {dtype}", errors, tol)


def _check_cross_entropy(tokens, hidden_dim, vocab, dtype, gen, device) -> None:
    from autopar.triton_kernels import linear_cross_entropy

    h = torch.randn(tokens, hidden_dim, device=device, dtype=dtype, generator=gen)
    w = torch.randn(vocab, hidden_dim, device=device, dtype=dtype, generator=gen) / hidden_dim**0.5
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    labels[::7] = -100
    one = torch.ones((), device=device, dtype=dtype)
    out, grads = _grads_of(lambda h, w: linear_cross_entropy(h, w, labels), [h, w], one)
    ref, ref_grads = _grads_of(lambda h, w: F.cross_entropy(h @ w.T, labels), [h.float(), w.float()], one.float())
    errors = {"loss": _rel_error(out, ref), "dhidden": _rel_error(grads[0], ref_grads[0])}
    errors["dweight"] = _rel_error(grads[1], ref_grads[1])
    # 16-bit: the logits and their gradient are rounded to the input dtype before the matmuls.
    tol = 3e-2 if dtype != torch.float32 else 1e-4
    _report(f"linear_cross_entropy {tokens}x{hidden_dim} vocab {vocab} {dtype}", errors, tol)


# (batch, heads q, heads kv, seq q, seq k, head dim, causal, dtype): GQA, MQA and MHA, ragged q/k lengths.
ATTENTION_CASES = [
    (2, 8, 2, 1000, 1000, 128, True, torch.bfloat16),
    (1, 4, 4, 777, 1500, 64, False, torch.float16),
    (1, 8, 1, 300, 300, 96, True, torch.float32),
    (2, 16, 16, 4096, 4096, 64, True, torch.bfloat16),
]
NORM_CASES = [(4096, 4096, torch.bfloat16), (1024, 16384, torch.float32), (333, 1000, torch.float16)]
CROSS_ENTROPY_CASES = [(4096, 1024, 32000, torch.bfloat16), (1000, 512, 50257, torch.float32)]
# The same kinds of case at sizes the interpreter runs in seconds: lengths that are no multiple of a block.
SMOKE_ATTENTION_CASES = [
    (1, 4, 2, 40, 40, 32, True, torch.bfloat16),
    (1, 2, 2, 23, 50, 32, False, torch.float16),
    (1, 4, 1, 16, 16, 32, True, torch.float32),
]
SMOKE_NORM_CASES = [(16, 32, torch.bfloat16), (8, 100, torch.float32), (5, 33, torch.float16)]
SMOKE_CROSS_ENTROPY_CASES = [(64, 32, 256, torch.bfloat16), (37, 32, 301, torch.float32)]


def check_correctness(device: torch.device, smoke: bool = False) -> None:
    """Each kernel against PyTorch in fp32 from the same (16-bit or fp32) inputs, on `device`."""
    print("correctness (max error / max |expected|):")
    gen = torch.Generator(device=device).manual_seed(0)
    for case in SMOKE_ATTENTION_CASES if smoke else ATTENTION_CASES:
        _check_attention(*case, gen, device)
    for case in SMOKE_NORM_CASES if smoke else NORM_CASES:
        _check_norms(*case, gen, device)
    for case in SMOKE_CROSS_ENTROPY_CASES if smoke else CROSS_ENTROPY_CASES:
        _check_cross_entropy(*case, gen, device)


def _attention_row(
    batch: int, heads: int, seq: int, head_dim: int, causal: bool, device: torch.device, repeats: int
) -> list[float]:
    """TFLOP/s: ours forward, SDPA forward, ours forward+backward, SDPA forward+backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from autopar.triton_kernels import flash_attention

    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)
    flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)

    def ours():
        return flash_attention(q, k, v, causal=causal)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    row = []
    with torch.no_grad():
        row += [flops / _time_ms(fn, device, repeats=repeats) * 1e-9 for fn in (ours, sdpa)]
    for fn in (ours, sdpa):
        ms = _time_ms(lambda fn=fn: fn().backward(grad_out), device, grad_to_none=[q, k, v], repeats=repeats)
        row.append(3.5 * flops / ms * 1e-9)  # backward is 2.5x the forward
    return row


def bench_attention(
    seq_lens: list[int],
    head_dims: list[int],
    device: torch.device,
    tokens: int = 16384,
    width: int = 2048,
    repeats: int = CPU_REPEATS,
) -> None:
    """TFLOP/s of our forward and forward+backward next to SDPA's flash backend, bf16.

    Each shape holds `tokens` tokens per batch (batch = tokens / seq) and heads of `width` / head_dim; `repeats`
    timed calls per figure on the CPU.
    """
    print("\nflash attention, bf16, TFLOP/s (batch x heads x seq x head_dim):")
    print(f"  {'shape':28s} {'causal':>6s} {'fwd ours':>9s} {'fwd sdpa':>9s} {'f+b ours':>9s} {'f+b sdpa':>9s}")
    for head_dim in head_dims:
        for causal in (False, True):
            for seq in seq_lens:
                batch, heads = max(1, tokens // seq), max(1, width // head_dim)
                row = _attention_row(batch, heads, seq, head_dim, causal, device, repeats)
                shape = f"{batch}x{heads}x{seq}x{head_dim}"
                print(f"  {shape:28s} {causal!s:>6s} " + " ".join(_rate(x) for x in row), flush=True)


def _cross_entropy_row(
    tokens: int, hidden_dim: int, vocab: int, device: torch.device, repeats: int
) -> list[float | None]:
    """ms ours, ms materialised, peak GiB ours, peak GiB materialised (forward+backward; None off CUDA)."""
    from autopar.triton_kernels import linear_cross_entropy

    h = torch.randn(tokens, hidden_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden_dim, device=device, dtype=torch.bfloat16) / hidden_dim**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)

    def ours():
        linear_cross_entropy(h, w, labels).backward()

    def materialised():
        F.cross_entropy(h @ w.T, labels).backward()

    row: list[float | None] = [_time_ms(fn, device, [h, w], repeats) for fn in (ours, materialised)]
    for fn in (ours, materialised):
        h.grad = w.grad = None
        row.append(_peak_gib(fn, device))
    return row


def bench_cross_entropy(
    token_counts: list[int],
    device: torch.device,
    hidden_dim: int = 4096,
    vocab: int = 128256,
    repeats: int = CPU_REPEATS,
) -> None:
    """Time of forward+backward and peak memory above the inputs, fused op against materialised logits."""
    print(f"\nlinear + cross-entropy, bf16, hidden {hidden_dim}, vocab {vocab} (forward+backward):")
    print(f"  {'tokens':>7s} {'ms ours':>9s} {'ms torch':>9s} {'peak GiB ours':>14s} {'peak GiB torch':>15s}")
    for tokens in token_counts:
        ms_ours, ms_torch, gib_ours, gib_torch = _cross_entropy_row(tokens, hidden_dim, vocab, device, repeats)
        gib = [f"{g:{w}.2f}" if g is not None else f"{'n/a':>{w}s}" for g, w in ((gib_ours, 14), (gib_torch, 15))]
        print(f"  {tokens:7d} {ms_ours:9.2f} {ms_torch:9.2f} {gib[0]} {gib[1]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.triton_kernels.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="seq 1k and 4k, head dim 128, one token count")
    parser.add_argument("--skip-correctness", action="store_true", help="only time the kernels")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu runs the kernels in the Triton interpreter (needs TRITON_INTERPRET=1)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every check and timing row at tiny sizes, few repeats: does the script run",
    )
    args = parser.parse_args(argv)
    FAILED.clear()  # main may run more than once in a process (tests)
    from autopar.triton_kernels import kernels_interpreted

    if args.device == "cpu":
        if not kernels_interpreted():
            print(
                "autopar.triton_kernels.bench: --device cpu runs the kernels in the Triton interpreter, and "
                "TRITON_INTERPRET is not set; run it as TRITON_INTERPRET=1 python -m autopar.triton_kernels.bench "
                "--device cpu."
            )
            return 2
        print(f"device: cpu (Triton interpreter), torch {torch.__version__}")
    else:
        if not torch.cuda.is_available():
            print(
                "autopar.triton_kernels.bench: no CUDA device is available; this benchmark needs a GPU (or "
                "--device cpu with TRITON_INTERPRET=1 to check that it runs). Nothing to run."
            )
            return 0
        if kernels_interpreted():
            print(
                "autopar.triton_kernels.bench: TRITON_INTERPRET is set, so the kernels would run in the "
                "interpreter; unset it to benchmark the compiled kernels."
            )
            return 1
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    device = torch.device(args.device)
    if not args.skip_correctness:
        check_correctness(device, smoke=args.smoke)
    if args.smoke:
        bench_attention([16, 32], [32], device, tokens=64, width=64, repeats=1)
        bench_cross_entropy([16], device, hidden_dim=32, vocab=256, repeats=1)
    elif args.quick:
        bench_attention([1024, 4096], [128], device)
        bench_cross_entropy([8192], device)
    else:
        bench_attention([1024, 2048, 4096, 8192, 16384], [64, 128], device)
        bench_cross_entropy([8192, 32768], device)
    if FAILED:
        print(f"\nFAILED correctness checks: {', '.join(FAILED)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
