"""Progress of planning on stderr: one updating line of what is being done, not a line per candidate.

The solvers tell `autopar.plan(progress=...)` about every mesh and pipeline layout they price. On a
terminal, `PlanProgress` turns those messages into one line rewritten in place (the phase, the meshes and
pipeline layouts priced so far, the alternatives priced, seconds elapsed), drawn once planning has taken more than
a second (`after_s`: a plan found sooner leaves the terminal as it was); when stderr is not a terminal
it writes one line per phase and the totals at the end. `verbose=True` writes every message, as the solvers say it. Nothing goes
to stdout, so `--json` files and piped reports never hold progress.
"""

from __future__ import annotations

import sys
import time


class PlanProgress:
    """A `progress` callable for `autopar.plan` that draws one status line on `stream` (default stderr)."""

    def __init__(self, stream=None, *, verbose: bool = False, after_s: float = 1.0):
        self.stream = stream if stream is not None else sys.stderr
        self.verbose = verbose
        self.after_s = after_s
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.phase = "starting"
        self.meshes = self.layouts = self.alternatives = 0
        self._width = 0

    def __call__(self, msg: str) -> None:
        if self.verbose:
            print(f"[autopar] {msg}", file=self.stream, flush=True)
            return
        phase = self._classify(msg)
        if self.live:
            if self._width or time.perf_counter() - self.t0 >= self.after_s:
                self._draw()
        elif phase == "tracing":
            print(f"[autopar] {msg}", file=self.stream, flush=True)
        elif phase != self.phase:
            print(f"[autopar] {phase} ...", file=self.stream, flush=True)
        self.phase = phase

    def _classify(self, msg: str) -> str:
        if msg.startswith("mesh "):
            self.meshes += 1
            return "pricing meshes"
        if msg.startswith("pipeline"):
            self.layouts += 1 if msg.startswith("pipeline ") else 0
            return "pricing pipeline layouts"
        if msg.startswith("pricing alternative"):
            self.alternatives += 1
            return "pricing alternatives"
        if msg.startswith(("tracing", "traced")):
            return "tracing"
        return self.phase

    def _line(self) -> str:
        return (
            f"[autopar] {self.phase}: {self.meshes} meshes, {self.layouts} pipeline layouts, "
            f"{self.alternatives} alternatives priced ({time.perf_counter() - self.t0:.1f} s)"
        )

    def _draw(self) -> None:
        line = self._line()
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def close(self) -> None:
        """End the status line (on a terminal) with the totals; elsewhere write the totals as one line."""
        if self.verbose:
            return
        if self.live:
            if not self._width and time.perf_counter() - self.t0 < self.after_s:
                return  # done within the first second: no line was drawn, none is left behind
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
        else:
            print(self._line(), file=self.stream, flush=True)
