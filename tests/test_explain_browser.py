"""The HTML report in a real headless browser (Chromium): no console errors, and the charts are drawn.

Chromium comes from Debian's packages; where it is missing the set-up installs it (`apt-get install -y
chromium`) when it can (root, apt-get present), and the tests are skipped with the reason only where
that is impossible. One screenshot per report kind (plain, pipeline, offload) is kept as a test
artefact: under $AUTOPAR_TEST_ARTIFACTS when set, else pytest's temporary folder; the path is printed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from autopar.report_charts import PALETTE
from tests.test_explain import _plan

# `make test-all`: installing Chromium takes minutes on a fresh machine; the HTML itself is checked by test_explain
pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

_BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _find_browser() -> str | None:
    return next((shutil.which(b) for b in _BROWSERS if shutil.which(b)), None)


@pytest.fixture(scope="module")
def browser() -> str:
    found = _find_browser()
    if found:
        return found
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("no Chromium, and it cannot be installed here (needs root and apt-get)")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=900, env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
        )
        if done.returncode != 0:
            pytest.skip(f"installing Chromium failed ({' '.join(cmd)}): {done.stderr.strip()[-300:]}")
    found = _find_browser()
    if not found:
        pytest.skip("apt-get installed chromium but no chromium binary is on PATH")
    return found


def _artefacts(tmp_path_factory) -> Path:
    where = os.environ.get("AUTOPAR_TEST_ARTIFACTS")
    out = Path(where) if where else tmp_path_factory.mktemp("report-screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _run(browser: str, *flags: str, page: Path) -> subprocess.CompletedProcess:
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--enable-logging=stderr",
        "--v=0",
        *flags,
        page.as_uri(),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _hex(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))


def _chart_regions(png: Path, colours: list[str]) -> list[tuple[int, int]]:
    """Vertical bands (first row, last row) of the screenshot holding chart-coloured pixels, gaps over 40 rows."""
    from PIL import Image

    img = Image.open(png).convert("RGB")
    wanted = {_hex(c) for c in colours}
    w, h = img.size
    px = img.load()
    rows = [y for y in range(h) if sum(px[x, y] in wanted for x in range(0, w, 2)) >= 3]
    bands: list[tuple[int, int]] = []
    for y in rows:
        if bands and y - bands[-1][1] <= 40:
            bands[-1] = (bands[-1][0], y)
        else:
            bands.append((y, y))
    return bands


@pytest.mark.parametrize("kind", ["plain", "pipeline", "offload"])
def test_html_report_renders_with_charts(browser, tmp_path_factory, kind):
    plan = {
        "plain": lambda: _plan("llama", compare=["dp=2,zero=3"]),
        "pipeline": lambda: _plan("gpt2", constraints={"pp": 2, "num_microbatches": 4}),
        "offload": lambda: _plan("llama", offload=True),
    }[kind]()
    out = _artefacts(tmp_path_factory)
    page = out / f"report-{kind}.html"
    page.write_text(plan.explain("html"))
    dom = _run(browser, "--dump-dom", page=page)
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    assert dom.stdout.count("<svg") == plan.explain("html").count("<svg") >= 3
    shot = out / f"report-{kind}.png"
    done = _run(browser, f"--screenshot={shot}", "--window-size=1200,7000", page=page)
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    print(f"\nscreenshot of the {kind} report: {shot}")
    # memory, time and why charts each draw bars in the palette's colours; the pipeline adds its Gantt
    bands = _chart_regions(shot, list(PALETTE))
    assert len(bands) >= 3, bands
    if kind == "pipeline":
        assert _chart_regions(shot, ["#8fb8ec", "#1f4e96"]), "no Gantt boxes in the screenshot"
