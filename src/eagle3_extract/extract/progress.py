"""Progress bar, the time estimate, and end-of-run summary.

The bar counts tokens, not samples: batches run longest first, so a
sample-count ETA would be badly off while a token ETA is not. Samples and
gigabytes written ride along in the postfix. Updated from writer threads.

Before the long part, one line estimates the time: the token rate measured
from the first file landed (engine start and the first batch's warm-up
excluded) over a short calibration (CALIBRATE_S: several batches, not the files
of one), then the bar's live ETA takes over; a job shorter than that gets none.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from tqdm import tqdm

from eagle3_extract.types import Sample

log = logging.getLogger("eagle3_extract.extract.job")
CALIBRATE_S = 20.0


class Progress:
    def __init__(self, total_samples: int, total_tokens: int, enabled: bool = True):
        self.total_samples = total_samples
        self.samples = 0
        self.bytes = 0
        self.t0 = time.perf_counter()
        self.total_tokens = total_tokens
        self.tokens = 0
        self._first: tuple[float, int] | None = None  # (time, tokens) at the first file
        self.estimate: dict[str, float] | None = None
        self._lock = threading.Lock()
        self._bar = tqdm(
            total=total_tokens, unit="tok", unit_scale=True, dynamic_ncols=True,
            mininterval=1.0, file=sys.stderr, disable=not enabled, desc="extract",
        )
        self._refresh()

    def _refresh(self) -> None:
        self._bar.set_postfix_str(
            f"samples {self.samples}/{self.total_samples}, {self.bytes / 1e9:.3f} GB written",
            refresh=False,
        )

    def on_sample(self, sample: Sample, nbytes: int) -> None:
        with self._lock:
            self.samples += 1
            self.bytes += nbytes
            self._refresh()
            self._bar.update(len(sample))
            self.tokens += len(sample)
            self._calibrate()

    def _calibrate(self) -> None:
        now = time.perf_counter()
        if self._first is None:
            self._first = (now, self.tokens)
            return
        t, n = self._first
        if self.estimate is not None or self.tokens >= self.total_tokens:
            return
        if now - t < CALIBRATE_S:  # several batches' cadence, not one batch's files
            return
        rate = (self.tokens - n) / max(now - t, 1e-9)
        left = (self.total_tokens - self.tokens) / rate
        self.estimate = {"tokens_per_s": round(rate, 1), "seconds_left": round(left, 1),
                         "after_tokens": self.tokens}
        log.info("time: %.0f tok/s over the first %d tokens: about %s for the %d left "
                 "(done near %s)", rate, self.tokens, _hms(left),
                 self.total_tokens - self.tokens,
                 time.strftime("%H:%M", time.localtime(time.time() + left)))

    def close(self) -> None:
        with self._lock:
            self._refresh()
            self._bar.close()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
