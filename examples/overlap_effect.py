"""What pricing gradient-sync overlap changes in the free search: each case planned twice, overlap off and on.

    python examples/overlap_effect.py

Each case (a preset on a simulated cluster) is planned with `constraints={"overlap": False}` (every
gradient all-reduce exposed after backward, the price before the runtime overlapped) and with the
default (bucket all-reduces launched from backward and hidden behind the backward still to run, as
the data-parallel runtime does). Prints one row per case: the layout each search chose, its predicted
step time, and how much gradient sync the overlapping plan hides.
"""

from __future__ import annotations

import argparse
import time

import autopar
from autopar.bench.megatron import layout

CASES = (
    ("gpt2", "2x8xH100-80GB", 256, 1024),
    ("gpt3-1.3b", "8xA100-80GB", 64, 2048),
    ("llama3-8b", "8xH100-80GB", 64, 8192),
    ("llama2-7b", "2x8xA100-80GB", 512, 4096),
    ("gpt3-13b", "8x8xA100-80GB", 1024, 2048),
    ("gpt3-1.3b", "6x8xH100-80GB", 192, 2048),
    ("gpt3-6.7b", "6x8xH100-80GB", 192, 2048),
    ("llama2-70b", "64x8xA100-40GB", 1536, 2048),
    ("gpt3-175b", "128x8xA100-80GB", 1536, 2048),
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, nargs="*", help="indices into CASES (default: all)")
    args = ap.parse_args()
    cases = [CASES[i] for i in args.cases] if args.cases else list(CASES)
    print(
        "| model | cluster | layout, overlap off | step ms | layout, overlap on | step ms | change | grad sync ms "
        "(hidden) | planning s (off / on) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model, cluster, gbs, seq in cases:
        plans, secs = {}, {}
        for overlap in (False, True):
            t0 = time.perf_counter()
            plans[overlap] = autopar.plan(
                model, cluster, global_batch_size=gbs, seq_len=seq, constraints={"overlap": overlap}, alternatives=False
            )
            secs[overlap] = time.perf_counter() - t0
        off, on = plans[False].predicted, plans[True].predicted
        change = 100.0 * (on.step_time_s - off.step_time_s) / off.step_time_s
        print(
            f"| {model} | {cluster} | {layout(plans[False])} | {_ms(off.step_time_s)} | {layout(plans[True])} | "
            f"{_ms(on.step_time_s)} | {change:+.1f}% | {_ms(on.grad_sync_s)} ({_ms(on.grad_sync_hidden_s)}) | "
            f"{secs[False]:.1f} / {secs[True]:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
