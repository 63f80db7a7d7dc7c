"""The command line: plan a preset, write and re-read a plan, and report user mistakes as errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(*args):
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True, timeout=300)


def _main(capsys, *args) -> tuple[int, str]:
    """`autopar ARGS` run by `autopar.cli.main` in this process: its exit status, and its stdout on success or its
    stderr otherwise (a subprocess costs an interpreter, torch and transformers: seconds on two shared cores)."""
    from autopar.cli import main

    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out if rc == 0 else err


@pytest.mark.subprocess
def test_plan_json_and_explain(tmp_path, capsys):
    out = tmp_path / "plan.json"
    report = tmp_path / "plan.html"
    r = _run(
        "plan",
        "--model",
        "gpt2",
        "--cluster",
        "8xA100-80GB",
        "--global-batch-size",
        "64",
        "--seq-len",
        "512",
        "--json",
        str(out),
        "--report",
        str(report),
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    assert "mesh" in r.stdout and "MFU" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["mesh"]["dp"] * doc["mesh"]["tp"] == 8
    assert report.read_text().startswith("<!doctype html>")
    # in this process: the command above showed the process's exit status and output are main()'s
    rc, text = _main(capsys, "explain", str(out))
    assert rc == 0 and "Why this plan" in text


@pytest.mark.subprocess
def test_user_errors_exit_with_a_message(tmp_path, capsys):
    r = _run("plan", "--model", "gpt2", "--cluster", "8xB999", "--global-batch-size", "8", "--seq-len", "128")
    assert r.returncode == 2 and "autopar: error:" in r.stderr and "A100-80GB" in r.stderr
    # the others in this process: the command above showed that main()'s status and stderr are the process's
    rc, err = _main(
        capsys,
        "plan",
        "--model",
        "no-such-model",
        "--cluster",
        "8xA100-80GB",
        "--global-batch-size",
        "8",
        "--seq-len",
        "128",
    )
    assert rc == 2 and "autopar: error:" in err and "preset" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc, err = _main(capsys, "explain", str(bad))
    assert rc == 2 and "invalid JSON" in err


# The flags that pin pipeline and memory choices: each reaches autopar.plan as the keyword or constraint it
# names, an unset switch leaves autopar.plan's default, and the planned layout shows the pin.

_TINY = ("plan", "--model", "tiny-llama", "--global-batch-size", "8", "--seq-len", "32", "--quiet")


def _plan_json(tmp_path, capsys, *flags, cluster="cpu:2"):
    """Run `autopar plan` in this process on tiny-llama; the plan's JSON document."""
    from autopar.cli import main

    out = tmp_path / "plan.json"
    rc = main([*_TINY, "--cluster", cluster, "--json", str(out), *flags])
    assert rc == 0, capsys.readouterr().err
    return json.loads(out.read_text())


def test_choices_are_those_the_api_accepts():
    from autopar.constraints import RECOMPUTE_MODES, SCHEDULES
    from autopar.passes import recompute
    from autopar.passes.pipeline import Schedule

    assert SCHEDULES == tuple(s.value for s in Schedule)
    assert RECOMPUTE_MODES == recompute.RECOMPUTE_MODES


def test_plan_flags_are_the_constraint_fields(capsys):
    """`autopar plan --help` offers a flag for each field of Constraints marked for the command line, and only
    those become constraints."""
    import dataclasses

    from autopar.cli import main
    from autopar.constraints import Constraints, cli_flags

    offered = {f.name for f in dataclasses.fields(Constraints) if f.metadata["flag"]}
    assert {kw["dest"] for _, kw in cli_flags()} == offered
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    shown = capsys.readouterr().out
    assert all(f"--{name.replace('_', '-')}" in shown for name in offered)


@pytest.mark.parametrize(
    ("flags", "constraints", "switches"),
    [
        ((), {}, {}),
        (
            ("--pp", "2", "--schedule", "interleaved_1f1b", "--virtual-stages", "2"),
            {"pp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2},
            {},
        ),
        (
            ("--num-microbatches", "4", "--recompute", "selective"),
            {"num_microbatches": 4, "recompute": "selective"},
            {},
        ),
        (("--micro-batch-size", "2", "--tp", "1"), {"micro_batch_size": 2, "tp": 1}, {}),
        (("--offload", "--pipeline", "--fuse-kernels"), {}, {"offload": True, "pipeline": True, "fuse_kernels": True}),
        (
            ("--no-offload", "--no-pipeline", "--no-fuse-kernels"),
            {},
            {"offload": False, "pipeline": False, "fuse_kernels": False},
        ),
    ],
)
def test_plan_flags_pass_through(monkeypatch, flags, constraints, switches):
    import autopar
    from autopar.cli import main

    calls = []

    class _Stop(Exception):
        pass

    def spy(model, cluster, **kwargs):
        calls.append(kwargs)
        raise _Stop

    monkeypatch.setattr(autopar, "plan", spy)
    with pytest.raises(_Stop):
        main([*_TINY, "--cluster", "cpu:4", *flags])
    (kwargs,) = calls
    assert kwargs["constraints"] == constraints
    assert {k: kwargs[k] for k in ("offload", "pipeline", "fuse_kernels") if k in kwargs} == switches


@pytest.mark.integration
def test_recompute_and_micro_batches_reach_the_plan(tmp_path, capsys):
    assert _plan_json(tmp_path, capsys)["recompute"] == "none"
    doc = _plan_json(tmp_path, capsys, "--recompute", "full", "--dp", "2", "--micro-batch-size", "2")
    assert doc["recompute"] == "full" and doc["mesh"]["dp"] == 2 and doc["num_microbatches"] == 2


@pytest.mark.integration
def test_pipeline_flags_reach_the_plan(tmp_path, capsys):
    doc = _plan_json(tmp_path, capsys, "--pp", "2", "--schedule", "gpipe", "--num-microbatches", "4", cluster="cpu:4")
    assert doc["mesh"]["pp"] == 2 and doc["pipeline"]["schedule"] == "gpipe" and doc["num_microbatches"] == 4


@pytest.mark.integration
def test_offload_and_fusion_switches_reach_the_plan(tmp_path, capsys):
    assert not _plan_json(tmp_path, capsys)["fusion"]["enabled"]  # default off on CPUs
    assert _plan_json(tmp_path, capsys, "--fuse-kernels")["fusion"]["enabled"]
    assert _plan_json(tmp_path, capsys, "--offload")["offload"]["optimizer_fraction"] == 1.0
    # 1 MB per device fits only with states on the host: the default offloads, --no-offload cannot plan.
    assert _plan_json(tmp_path, capsys, "--memory-budget", "1MB")["offload"]["optimizer_fraction"] > 0


@pytest.mark.integration
@pytest.mark.parametrize(
    ("cluster", "flags", "message"),
    [
        ("cpu:2", ("--memory-budget", "1MB", "--no-offload"), "offload=False"),
        ("cpu:4", ("--pp", "3"), "does not divide the world size 4"),
        ("cpu:4", ("--pp", "0"), "expected a positive integer"),
        ("cpu:4", ("--num-microbatches", "3"), "does not split"),
        ("cpu:4", ("--pp", "2", "--schedule", "interleaved_1f1b", "--virtual-stages", "2"), "lower virtual_stages"),
    ],
)
def test_bad_pins_exit_with_one_line(capsys, cluster, flags, message):
    from autopar.cli import main

    assert main([*_TINY, "--cluster", cluster, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autopar: error:") and "\n" not in err and message in err, err


def test_bad_choices_are_refused_by_the_parser(capsys):
    from autopar.cli import main

    for flags in (("--schedule", "zigzag"), ("--recompute", "some"), ("--pp", "two")):
        with pytest.raises(SystemExit) as e:
            main([*_TINY, "--cluster", "cpu:4", *flags])
        assert e.value.code == 2 and "invalid" in capsys.readouterr().err
