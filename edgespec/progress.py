"""A one-line progress display on stderr (model downloads, exports, benchmark runs).

On a terminal the line is redrawn in place: ``name  12.3/98.4 MB  12%  status``.
Elsewhere (a log file, CI) it is silent unless ``lines`` asks for one line
per tenth of the work, so logs stay short.
"""
from __future__ import annotations

import sys


class Progress:
    """Counts units of work towards ``total``; subclasses format the counter."""

    def __init__(self, name: str, total: int, *, enabled: bool = True, lines: bool = False):
        self.name, self.total, self.count = name, total, 0
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.lines = enabled and lines and not self.tty
        self._shown = -1      # percentage on the line drawn in place; -1 = no line open
        self._width = 0       # characters of that line, to blank a longer one
        self._logged = -1     # tenth last written as its own line (not a terminal)

    def counter(self) -> str:
        return f"{self.count}/{self.total}"

    def note(self, text: str) -> None:
        if self.enabled:
            self._end_line()
            print(f"{self.name}: {text}", file=sys.stderr, flush=True)

    def update(self, n: int = 1, status: str = "") -> None:
        self.count += n
        pct = min(100, self.count * 100 // max(self.total, 1))
        text = f"{self.name}  {self.counter()}  {pct:3d}%" + (f"  {status}" if status else "")
        if self.tty and (pct != self._shown or status):
            self._shown = pct
            print("\r" + text.ljust(self._width), end="", file=sys.stderr, flush=True)
            self._width = len(text)
        elif self.lines and pct // 10 != self._logged:
            self._logged = pct // 10
            print(text, file=sys.stderr, flush=True)

    def done(self) -> None:
        self._end_line()

    def _end_line(self) -> None:
        if self._shown >= 0:
            print(file=sys.stderr, flush=True)
            self._shown = -1
            self._width = 0


class ByteProgress(Progress):
    """Progress counted in bytes, shown in MB: `name  12.3/98.4 MB  12%`."""

    def counter(self) -> str:
        return f"{self.count / 1e6:.1f}/{self.total / 1e6:.1f} MB"
