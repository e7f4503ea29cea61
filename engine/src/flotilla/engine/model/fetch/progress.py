"""Download progress on stderr; tqdm loads only on a terminal."""

from __future__ import annotations

import sys


class ByteProgress:
    """Download progress on stderr: a live bar on a terminal; in a log (an init container's) a line per tenth,
    since a bar's carriage returns would pile up into one unreadable line."""

    _UNKNOWN_TOTAL_STEP = 256 << 20

    def __init__(self, label: str, total: int | None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self._next_report = self._step()
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, file=sys.stderr)

    def _step(self) -> int:
        return max(self.total // 10, 1) if self.total else self._UNKNOWN_TOTAL_STEP

    def update(self, count: int) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
        elif count and self.done >= self._next_report:
            self._next_report = self.done + self._step()
            print(f"{self.label}: {self._describe_done()}", file=sys.stderr)

    def _describe_done(self) -> str:
        if self.total:
            return f"{self.done * 100 // self.total}% of {self.total} bytes"
        return f"{self.done} bytes"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
