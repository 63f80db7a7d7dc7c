"""`autopar bench exits`: does a finished job exit cleanly, every time?

A scheduler marks a job whose process ends with a signal or a non-zero status as failed, and restarts it: a
training that finished but aborted at exit ("terminate called without an active exception") costs a whole rerun.
This suite launches a user-style script under torchrun (`--standalone`, 2 CPU ranks, gloo) `launches` times per
program kind: compile a tiny LLaMA, two training steps, a checkpoint (saved asynchronously for one kind in two
launches, so that its background group and threads are part of every exit), `torch.distributed.
destroy_process_group()`, and the interpreter's normal exit. It counts launches whose torchrun exit status is not
0 and keeps the last lines of their output.

Each launch starts Python, imports torch and autopar and compiles: tens of seconds on a loaded two-core machine,
so 200 launches per kind take hours. `--launches` picks fewer; the document records how many ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from autopar.bench.common import env_md, environment, md_table, write_json
from autopar.errors import ConfigError

# program kind -> (constraints, offload)
KINDS = {
    "data-parallel": ({"dp": 2, "tp": 1}, None),
    "sharded": ({"tp": 2}, None),
    "pipeline": ({"pp": 2, "num_microbatches": 2}, None),
    "offload": ({"tp": 1}, True),
}
TAIL_LINES = 40
LAUNCH_TIMEOUT_S = 900

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    import autopar

    constraints, offload, folder, async_save = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      use_cache=False, attn_implementation="sdpa")
    ids = torch.randint(0, 128, (8, 16))
    pm = autopar.compile(LlamaForCausalLM(cfg), "cpu:2", (ids,), {"labels": ids}, constraints=constraints,
                         offload=offload)
    for _ in range(2):
        pm.train_step(ids, labels=ids)
    saved = pm.save_checkpoint(folder + "/step2", async_save=async_save)
    if async_save:
        saved.result()
    dist.destroy_process_group()
    print("done", flush=True)
    """
)


def _launch(script: Path, kind: str, folder: Path, async_save: bool) -> tuple[int, str, float]:
    """(torchrun's exit status, the output's last lines, seconds) of one launch."""
    constraints, offload = KINDS[kind]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        json.dumps(constraints),
        json.dumps(offload),
        str(folder),
        "1" if async_save else "0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")  # an abort prints every stack
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=LAUNCH_TIMEOUT_S
        )
        status, out = done.returncode, done.stdout
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        status, out = -9, text + f"\n(killed after {LAUNCH_TIMEOUT_S} s)"
    return status, "\n".join(out.splitlines()[-TAIL_LINES:]), time.perf_counter() - start


def run(
    out_dir,
    *,
    launches: int = 200,
    kinds: tuple[str, ...] = tuple(KINDS),
    show_progress: bool = True,
) -> dict:
    """Launch the script `launches` times per kind; write exits.json and exits.md into `out_dir`."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ConfigError(f"bench exits: unknown program kinds {unknown}; expected some of {', '.join(KINDS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="exits-") as tmp:
        script = Path(tmp) / "user_script.py"
        script.write_text(SCRIPT)
        for kind in kinds:
            failures, seconds = [], []
            for i in range(launches):
                status, tail, took = _launch(script, kind, Path(tmp) / f"{kind}-{i}", async_save=i % 2 == 1)
                seconds.append(took)
                if status != 0:
                    failures.append({"launch": i, "status": status, "tail": tail})
                if show_progress:
                    print(
                        f"[autopar bench] exits: {kind} launch {i + 1}/{launches}: status {status}, {took:.0f} s, "
                        f"{len(failures)} failed so far",
                        file=sys.stderr,
                        flush=True,
                    )
            results[kind] = {"launches": launches, "failed": len(failures), "failures": failures, "seconds": seconds}
    doc = {"suite": "exits", "environment": environment(), "kinds": results}
    write_json(out / "exits.json", doc)
    (out / "exits.md").write_text(markdown(doc))
    return doc


def markdown(doc: dict) -> str:
    rows = [
        [kind, r["launches"], r["failed"], f"{sum(r['seconds']) / max(len(r['seconds']), 1):.0f} s"]
        for kind, r in doc["kinds"].items()
    ]
    lines = [
        "# autopar bench exits: torchrun launches of a user-style script (compile, 2 steps, a save, "
        "destroy_process_group, exit)",
        "",
        env_md(doc["environment"]),
        "",
        md_table(["program", "launches", "non-zero exits", "mean launch"], rows),
        "",
    ]
    for kind, r in doc["kinds"].items():
        for f in r["failures"][:3]:
            lines += [f"## {kind}, launch {f['launch']}: status {f['status']}", "", "```", f["tail"], "```", ""]
    return "\n".join(lines)
