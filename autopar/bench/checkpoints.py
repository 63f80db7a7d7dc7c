"""Checkpoint benchmarks: `autopar bench soak` and `autopar bench checkpoint`.

- soak: a long run on local CPU ranks (default 300 steps on cpu:4) that saves a training checkpoint every
  `every` steps with `keep_last` retention. After each save every rank records its resident set (VmRSS), loads
  the checkpoint it just wrote back into the running program (a save that cannot be read back shows here,
  not when a job restarts) and checks that the eval loss did not move. At the end: the checkpoints left on
  disk must be exactly the `keep_last` newest. Resident memory should be flat after the first saves.
- checkpoint: save and load time of a training checkpoint (masters and AdamW moments, through
  torch.distributed.checkpoint, each rank writing its own shards) of a ~100M-parameter LLaMA-style model on
  cpu:2, next to `torch.save` / `torch.load` of the same state (model and optimizer state dicts) from one
  process, on the same disk; and of an asynchronous save, how long it blocks training (the copy of the state)
  and how long until the checkpoint is committed.

Both spawn gloo ranks (rendezvous through a file, one thread each) like the run suite, and write JSON and
Markdown into the output folder. Figures from a machine shared with other work are wall-clock times under
that load: the documents record the load average next to them.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from autopar.bench.common import environment, fmt_gib, md_table, run_on_ranks, write_json
from autopar.errors import ConfigError


@dataclass(frozen=True)
class SoakSettings:
    steps: int = 300
    every: int = 50
    keep_last: int = 2
    constraints: tuple = (("tp", 2), ("zero", 1))  # a sharded program: DTensor shards in every checkpoint
    batch: int = 8
    seq: int = 32


@dataclass(frozen=True)
class TimingSettings:
    hidden: int = 768
    layers: int = 12
    intermediate: int = 2048
    vocab: int = 16000  # with the sizes above: about 110M parameters
    repeats: int = 3
    constraints: tuple = (("dp", 2), ("zero", 1))


# ------------------------------------------------------------------------------------------- helpers


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _llama(hidden: int, layers: int, intermediate: int, vocab: int, heads: int = 4) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _batch(vocab: int, batch: int, seq: int) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return (ids,), {"labels": ids.clone()}


def _cpu_world(cluster: str) -> int:
    text = str(cluster).strip().lower()
    if not text.startswith("cpu:") or not text[4:].isdigit() or int(text[4:]) < 1:
        raise ConfigError(f"checkpoint benchmarks run on local CPU ranks: --cluster must be 'cpu:N', got {cluster!r}")
    return int(text[4:])


def _say(rank: int, show: bool, msg: str) -> None:
    if rank == 0 and show:
        print(f"[autopar bench] {msg}", file=sys.stderr, flush=True)


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------- soak


def _soak_rank(rank: int, world: int, root: str, settings: SoakSettings, show: bool) -> dict:
    import autopar
    from autopar.checkpoint.training import latest_checkpoint, read_marker

    torch.manual_seed(0)
    model = _llama(64, 2, 128, 256)
    args, kwargs = _batch(256, settings.batch, settings.seq)
    pm = autopar.compile(
        model,
        f"cpu:{world}",
        args,
        kwargs,
        constraints=dict(settings.constraints),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )
    _say(rank, show, f"soak: {pm.plan.summary()}")
    records, losses = [], []
    t0 = time.perf_counter()
    for step in range(1, settings.steps + 1):
        losses.append(pm.train_step(*args, **kwargs))
        if step % settings.every:
            continue
        before = pm.eval_step(*args, **kwargs)
        t_save = time.perf_counter()
        path = pm.save_checkpoint(f"{root}/step{step}", extra={"step": step}, keep_last=settings.keep_last)
        t_load = time.perf_counter()
        extra = pm.load_checkpoint(path)
        t_done = time.perf_counter()
        after = pm.eval_step(*args, **kwargs)
        records.append(
            {
                "step": step,
                "rss_bytes": _rss_bytes(),
                "save_s": t_load - t_save,
                "load_s": t_done - t_load,
                "loaded": extra == {"step": step} and after == before and pm.num_steps == step,
                "latest": Path(latest_checkpoint(root) or "").resolve() == Path(path),
            }
        )
        _say(
            rank,
            show,
            f"soak: step {step}, rank 0 RSS {fmt_gib(records[-1]['rss_bytes'])}, "
            f"{(time.perf_counter() - t0) / step * 1e3:.0f} ms/step",
        )
    kept = sorted(int(read_marker(p)["step"]) for p in Path(root).iterdir() if read_marker(p) is not None)
    return {
        "rank": rank,
        "records": records,
        "kept_steps": kept,
        "losses": losses,
        "program": str(pm.plan.program),
        "mesh": dict(pm.plan.mesh),
        "wall_s": time.perf_counter() - t0,
    }


def run_soak(
    out_dir,
    *,
    cluster: str = "cpu:4",
    quick: bool = False,
    show_progress: bool = True,
    settings: SoakSettings | None = None,
) -> dict:
    """Run the soak (see the module docstring) and write soak.json and soak.md into `out_dir`."""
    world = _cpu_world(cluster)
    settings = settings or (SoakSettings(steps=60, every=10, constraints=()) if quick else SoakSettings())
    if world % dict(settings.constraints).get("tp", 1):  # a pinned tensor axis this cluster cannot hold
        settings = SoakSettings(**(asdict(settings) | {"constraints": ()}))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="soak-", dir=out))
    try:
        load_before = _load_average()
        ranks = run_on_ranks(world, _soak_rank, str(root), settings, show_progress, label="checkpoint bench")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    expected = [s for s in range(settings.every, settings.steps + 1, settings.every)][-settings.keep_last :]
    doc = {
        "suite": "soak",
        "environment": environment(),
        "cluster": cluster,
        "settings": asdict(settings),
        "load_average_before": load_before,
        "load_average_after": _load_average(),
        "ranks": ranks,
        "expected_kept_steps": expected,
        "summary": _soak_summary(ranks, expected),
    }
    write_json(out / "soak.json", doc)
    (out / "soak.md").write_text(soak_markdown(doc))
    return doc


def _soak_summary(ranks: list[dict], expected: list[int]) -> dict:
    """Growth of each rank's resident set from the second checkpoint (after warm-up) to the last, and the checks."""
    growth = {}
    for r in ranks:
        rss = [rec["rss_bytes"] for rec in r["records"] if rec["rss_bytes"] is not None]
        growth[str(r["rank"])] = rss[-1] - rss[1] if len(rss) > 2 else None  # str: the keys JSON writes
    return {
        "rss_growth_after_warmup_bytes": growth,
        "every_checkpoint_loadable": all(rec["loaded"] for r in ranks for rec in r["records"]),
        "latest_is_the_newest": all(rec["latest"] for r in ranks for rec in r["records"]),
        "retention_honoured": all(r["kept_steps"] == expected for r in ranks),
    }


def soak_markdown(doc: dict) -> str:
    ranks = doc["ranks"]
    steps = [rec["step"] for rec in ranks[0]["records"]]
    header = ["step"] + [f"rank {r['rank']} RSS" for r in ranks] + ["save (rank 0)", "load (rank 0)"]
    rows = []
    for i, step in enumerate(steps):
        rec0 = ranks[0]["records"][i]
        rows.append(
            [step]
            + [fmt_gib(r["records"][i]["rss_bytes"]) for r in ranks]
            + [f"{rec0['save_s'] * 1e3:.0f} ms", f"{rec0['load_s'] * 1e3:.0f} ms"]
        )
    s = doc["summary"]
    growth = ", ".join(
        f"rank {k}: {v / 2**20:+.1f} MiB" if v is not None else f"rank {k}: —"
        for k, v in s["rss_growth_after_warmup_bytes"].items()
    )
    return "\n".join(
        [
            f"# autopar bench soak: {doc['settings']['steps']} steps on {doc['cluster']}, a checkpoint every "
            f"{doc['settings']['every']} (keep_last={doc['settings']['keep_last']})",
            "",
            f"Program: {ranks[0]['program']} {ranks[0]['mesh']}; load average {doc['load_average_before']} before, "
            f"{doc['load_average_after']} after (other work on the machine slows every figure).",
            "",
            md_table(header, rows),
            "",
            f"- resident set growth from the second checkpoint to the last: {growth}",
            f"- every checkpoint loaded back with the same eval loss, step and extra: {s['every_checkpoint_loadable']}",
            f"- latest_checkpoint named the newest after every save: {s['latest_is_the_newest']}",
            f"- retention kept exactly steps {doc['expected_kept_steps']}: {s['retention_honoured']}",
            "",
        ]
    )


# ------------------------------------------------------------------------------------ save/load timing


def _timing_rank(rank: int, world: int, root: str, settings: TimingSettings, show: bool) -> dict:
    import torch.distributed as dist

    import autopar

    torch.manual_seed(0)
    model = _llama(settings.hidden, settings.layers, settings.intermediate, settings.vocab)
    num_params = sum(p.numel() for p in model.parameters())
    args, kwargs = _batch(settings.vocab, 2, 16)
    pm = autopar.compile(
        model,
        f"cpu:{world}",
        args,
        kwargs,
        constraints=dict(settings.constraints),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
    )
    del model
    pm.train_step(*args, **kwargs)  # AdamW's moments exist from the first step
    _say(rank, show, f"checkpoint: {num_params / 1e6:.0f}M parameters, {pm.plan.summary()}")
    saves, loads = [], []
    for i in range(settings.repeats):
        path = f"{root}/dcp{i}"
        dist.barrier()
        t0 = time.perf_counter()
        pm.save_checkpoint(path)
        saves.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        pm.load_checkpoint(path)
        loads.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in Path(path).iterdir())
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        _say(rank, show, f"checkpoint: save {saves[-1]:.2f} s, load {loads[-1]:.2f} s, {size / 2**30:.2f} GiB")
    blocked, committed = _async_timing(rank, pm, root, settings.repeats)
    _say(rank, show, f"checkpoint: async save blocked {blocked[-1]:.2f} s, committed after {committed[-1]:.2f} s")
    return {
        "rank": rank,
        "num_parameters": num_params,
        "save_s": saves,
        "load_s": loads,
        "bytes": size,
        "async_blocked_s": blocked,
        "async_committed_s": committed,
        "program": str(pm.plan.program),
        "mesh": dict(pm.plan.mesh),
    }


def _async_timing(rank: int, pm, root: str, repeats: int) -> tuple[list[float], list[float]]:
    """Asynchronous saves: how long the call blocks training (the copy of the state), and how long until the
    checkpoint is written and committed."""
    import torch.distributed as dist

    blocked, committed = [], []
    for i in range(repeats):
        path = f"{root}/async{i}"
        dist.barrier()
        t0 = time.perf_counter()
        pm.save_checkpoint(path, async_save=True)
        blocked.append(time.perf_counter() - t0)
        pm.wait_checkpoint()
        committed.append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    return blocked, committed


def _torch_save_reference(root: Path, settings: TimingSettings) -> dict:
    """torch.save / torch.load of the full model and optimizer state dicts from one process (what a single-process
    trainer writes), with AdamW's moments made by one step like the ranks'."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _llama(settings.hidden, settings.layers, settings.intermediate, settings.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    args, kwargs = _batch(settings.vocab, 2, 16)
    model(*args, **kwargs).loss.backward()
    opt.step()
    saves, loads = [], []
    for i in range(settings.repeats):
        path = root / f"full{i}.pt"
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loads.append(time.perf_counter() - t0)
        size = path.stat().st_size
        del state
        path.unlink()
    return {"save_s": saves, "load_s": loads, "bytes": size}


def run_checkpoint_timing(
    out_dir,
    *,
    cluster: str = "cpu:2",
    quick: bool = False,
    show_progress: bool = True,
    settings: TimingSettings | None = None,
) -> dict:
    """Time checkpoint save and load (see the module docstring); write checkpoint.json and checkpoint.md."""
    world = _cpu_world(cluster)
    settings = settings or (
        TimingSettings(hidden=256, layers=2, intermediate=512, repeats=2) if quick else TimingSettings()
    )
    if world % dict(settings.constraints).get("dp", 1):  # a pinned data axis this cluster cannot hold
        settings = TimingSettings(**(asdict(settings) | {"constraints": ()}))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ckpt-", dir=out))
    try:
        load_before = _load_average()
        ranks = run_on_ranks(world, _timing_rank, str(root), settings, show_progress, label="checkpoint bench")
        reference = _torch_save_reference(root, settings)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc = {
        "suite": "checkpoint",
        "environment": environment(),
        "cluster": cluster,
        "settings": asdict(settings),
        "load_average_before": load_before,
        "load_average_after": _load_average(),
        "ranks": ranks,
        "torch_save": reference,
    }
    write_json(out / "checkpoint.json", doc)
    (out / "checkpoint.md").write_text(checkpoint_markdown(doc))
    return doc


def checkpoint_markdown(doc: dict) -> str:
    ranks, ref = doc["ranks"], doc["torch_save"]
    # a collective save or load ends when its slowest rank does
    save = [max(r["save_s"][i] for r in ranks) for i in range(len(ranks[0]["save_s"]))]
    load = [max(r["load_s"][i] for r in ranks) for i in range(len(ranks[0]["load_s"]))]
    rows = [
        [
            f"autopar save_checkpoint / load_checkpoint ({doc['cluster']}, {ranks[0]['program']} {ranks[0]['mesh']})",
            f"{statistics.median(save):.2f} s",
            f"{statistics.median(load):.2f} s",
            fmt_gib(ranks[0]["bytes"]),
        ],
        [
            "torch.save / torch.load of the full state dicts, one process",
            f"{statistics.median(ref['save_s']):.2f} s",
            f"{statistics.median(ref['load_s']):.2f} s",
            fmt_gib(ref["bytes"]),
        ],
    ]
    if "async_blocked_s" in ranks[0]:
        blocked = [max(r["async_blocked_s"][i] for r in ranks) for i in range(len(ranks[0]["async_blocked_s"]))]
        done = [max(r["async_committed_s"][i] for r in ranks) for i in range(len(ranks[0]["async_committed_s"]))]
        rows.insert(
            1,
            [
                "autopar save_checkpoint(async_save=True): training blocked / until committed",
                f"{statistics.median(blocked):.2f} s / {statistics.median(done):.2f} s",
                "",
                "",
            ],
        )
    return "\n".join(
        [
            f"# autopar bench checkpoint: {ranks[0]['num_parameters'] / 1e6:.0f}M parameters, AdamW, fp32",
            "",
            md_table(["", "save (median)", "load (median)", "on disk"], rows),
            "",
            f"Medians of {len(save)} repetitions, wall clock, the slowest rank's; load average "
            f"{doc['load_average_before']} before, {doc['load_average_after']} after (other work on the machine slows "
            f"every figure). The autopar load includes the checks against the model and the RNG and step restore.",
            "",
        ]
    )
