"""The command line: plan a preset, write and re-read a plan, and report user mistakes as errors."""

from __future__ import annotations

import json
import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True, timeout=300)


def test_plan_json_and_explain(tmp_path):
    out = tmp_path / "plan.json"
    report = tmp_path / "plan.html"
    r = _run("plan", "--model", "gpt2", "--cluster", "8xA100-80GB", "--global-batch-size", "64", "--seq-len", "512",
             "--json", str(out), "--report", str(report), "--quiet")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "mesh" in r.stdout and "MFU" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["mesh"]["dp"] * doc["mesh"]["tp"] == 8
    assert report.read_text().startswith("<!doctype html>")
    r = _run("explain", str(out))
    assert r.returncode == 0 and "Why this mesh" in r.stdout


def test_user_errors_exit_with_a_message(tmp_path):
    r = _run("plan", "--model", "gpt2", "--cluster", "8xB999", "--global-batch-size", "8", "--seq-len", "128")
    assert r.returncode == 2 and "autopar: error:" in r.stderr and "A100-80GB" in r.stderr
    r = _run("plan", "--model", "no-such-model", "--cluster", "8xA100-80GB", "--global-batch-size", "8",
             "--seq-len", "128")  # fmt: skip
    assert r.returncode == 2 and "preset" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = _run("explain", str(bad))
    assert r.returncode == 2 and "invalid JSON" in r.stderr
