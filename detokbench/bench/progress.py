"""The one-line progress display of a bench run (on a terminal), or a line per result."""

from __future__ import annotations

import os
import sys
import time

from .report import log


class Progress:
    """`total` measurements; `begin` one, `update` its line while it runs, `done` its result."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.i, self.quiet = total, 0, quiet
        self.tty = sys.stderr.isatty() and not quiet
        self.last, self.t0 = 0.0, time.monotonic()
        self.label, self.width = "", 0

    def begin(self, label: str) -> None:
        self.i += 1
        self.label = label
        self.last = 0.0

    def update(self, text: str, force: bool = False) -> None:
        if not self.tty:
            return
        t = time.monotonic()
        if not force and t - self.last < 0.2:
            return
        self.last = t
        try:
            cols = os.get_terminal_size(sys.stderr.fileno()).columns - 1
        except OSError:
            cols = 160
        line = f"[{self.i}/{self.total} {t - self.t0:5.0f}s] {self.label}  {text}"[:cols]
        sys.stderr.write("\r" + line + " " * max(0, self.width - len(line)))
        sys.stderr.flush()
        self.width = len(line)

    def done(self, text: str) -> None:
        if self.tty:
            self.update(text, force=True)
        elif not self.quiet:
            log(f"[{self.i}/{self.total} {time.monotonic() - self.t0:5.0f}s] {self.label}  {text}")

    def close(self) -> None:
        if self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()
