"""Plan JSON of fixed cases, with wall-clock figures taken out, kept as golden files under tests/golden/plans.

A change that moves code without meaning to change what is planned must leave these files byte-identical;
a change that means to change plans rewrites them (and its diff shows which figures moved):

    python -m tests.plan_snapshots --write          # rewrite the golden files
    python -m tests.plan_snapshots --out DIR        # write this head's files to DIR (diff -r them)

The cases cover every program kind: data-parallel, sharded (tp), pipeline and offload, as presets on GPU
clusters and as tiny modules on CPU clusters (analytic estimator: nothing measured on this machine).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

GOLDEN = Path(__file__).parent / "golden" / "plans"


def _tiny(name: str, batch: int = 8, seq: int = 16):
    from tests.models import make_batch, make_model

    args, kwargs = make_batch(name, batch=batch, seq=seq)
    return make_model(name), args, kwargs


# name -> (model, cluster, plan keywords); a model is a preset name or a tiny-model name with ":" before it
CASES = {
    "llama2-7b-8xA100-80GB": ("llama2-7b", "8xA100-80GB", {"global_batch_size": 8, "seq_len": 2048}),
    "llama2-7b-8xA100-40GB-gbs128": ("llama2-7b", "8xA100-40GB", {"global_batch_size": 128, "seq_len": 4096}),
    "llama2-7b-8xA100-80GB-tp8": (
        "llama2-7b",
        "8xA100-80GB",
        {"global_batch_size": 8, "seq_len": 2048, "constraints": {"tp": 8, "dp": 1}},
    ),
    "gpt3-1.3b-2x8xA100-80GB-pp2": (
        "gpt3-1.3b",
        "2x8xA100-80GB",
        {"global_batch_size": 64, "seq_len": 2048, "constraints": {"pp": 2, "schedule": "1f1b"}},
    ),
    "gpt3-1.3b-2x8xA100-80GB": ("gpt3-1.3b", "2x8xA100-80GB", {"global_batch_size": 64, "seq_len": 2048}),
    "llama2-70b-8xA100-80GB-offload": ("llama2-70b", "8xA100-80GB", {"global_batch_size": 32, "seq_len": 4096}),
    "gpt2-cpu4": ("gpt2", "cpu:4", {"global_batch_size": 8, "seq_len": 128}),
    "tiny-llama-cpu2": (":llama", "cpu:2", {}),
    "tiny-llama-cpu2-dp2": (":llama", "cpu:2", {"constraints": {"dp": 2}}),
    "tiny-llama-cpu4-tp2": (":llama", "cpu:4", {"constraints": {"tp": 2}}),
    "tiny-gpt2-cpu2-zero3": (":gpt2", "cpu:2", {"constraints": {"zero": 3}}),
    "tiny-bert-cpu2-recompute": (":bert", "cpu:2", {"constraints": {"recompute": "full"}}),
    "tiny-gpt2-cpu2-pp2": (":gpt2", "cpu:2", {"constraints": {"pp": 2, "num_microbatches": 2}}),
    "tiny-llama-cpu2-offload": (":llama", "cpu:2", {"offload": True}),
}


def snapshot(name: str) -> str:
    """The plan JSON of case `name` without its wall-clock figures."""
    import autopar

    model, cluster, kw = CASES[name]
    if model.startswith(":"):
        module, args, kwargs = _tiny(model[1:])
        plan = autopar.plan(module, cluster, args, kwargs, **kw)
    else:
        plan = autopar.plan(model, cluster, **kw)
    return json.dumps(json.loads(plan.to_json()), indent=1, sort_keys=True) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the golden files")
    parser.add_argument("--out", help="write this head's files to DIR instead")
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    ns = parser.parse_args(argv)
    out = GOLDEN if ns.write else Path(ns.out or "out/plan_snapshots")
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for name in ns.cases or CASES:
        (out / f"{name}.json").write_text(snapshot(name))
        print(f"{name}: written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
