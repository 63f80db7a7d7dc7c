"""Commit subjects say what changed in at most 72 characters (the body says why).

Older history holds longer subjects and is published: it stays as it is. Every commit after `SINCE` (a merge of
main after which no commit has a longer subject) is held to the rule here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess
REPO = Path(__file__).resolve().parents[1]
SINCE = "67e9d97"
MAX_SUBJECT = 72


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)


def test_commit_subjects_after_the_last_long_one_are_at_most_72_characters():
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout: no history to read")
    if _git("cat-file", "-e", f"{SINCE}^{{commit}}").returncode != 0:
        pytest.skip(f"{SINCE} is not in this clone's history (a shallow clone)")
    subjects = _git("log", "--format=%h %s", f"{SINCE}..HEAD").stdout.splitlines()
    long = [line for line in subjects if len(line.split(" ", 1)[1]) > MAX_SUBJECT]
    assert not long, f"subjects over {MAX_SUBJECT} characters: {long}"
