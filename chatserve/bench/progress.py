"""A progress bar for long benchmark runs: tqdm when installed, else a plain one on stderr.

A serving run can take minutes; the bar (requests done, errors) says it is alive without
mixing into stdout, which carries the summary table. `--disable-tqdm` (vLLM's flag) turns it off;
the fallback also stays quiet when stderr is not a terminal, so logs of scripted runs stay clean.
"""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    def __init__(self, total: int, desc: str = "requests", disable: bool = False) -> None:
        self.total = total
        self.done = 0
        self.errors = 0
        self._bar: Any = None
        self._plain = False
        self._t0 = time.perf_counter()
        self._last = 0.0
        if disable:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._plain = sys.stderr.isatty()
        else:
            self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr)

    def update(self, ok: bool = True) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        if self._bar is not None:
            self._bar.update(1)
            if self.errors:
                self._bar.set_postfix(errors=self.errors)
        elif self._plain:
            now = time.perf_counter()
            if now - self._last > 0.2 or self.done == self.total:
                self._last = now
                self._render(now)

    def _render(self, now: float, end: str = "") -> None:
        width = 30
        filled = int(width * self.done / self.total) if self.total else width
        elapsed = now - self._t0
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} requests  "
                         f"errors {self.errors}  {elapsed:.0f} s{end}")
        sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._plain:
            self._render(time.perf_counter(), "\n")
