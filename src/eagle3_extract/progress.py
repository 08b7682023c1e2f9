"""Progress bar and end-of-run summary.

The bar counts tokens, not samples: batches run longest first, so a
sample-count ETA would be badly off while a token ETA is not. Samples and
gigabytes written ride along in the postfix. Updated from writer threads.
"""

from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm

from .types import Sample


class Progress:
    def __init__(self, total_samples: int, total_tokens: int, enabled: bool = True):
        self.total_samples = total_samples
        self.samples = 0
        self.bytes = 0
        self.t0 = time.perf_counter()
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

    def close(self) -> None:
        with self._lock:
            self._refresh()
            self._bar.close()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0
