"""How the benchmark times things: GPU time with CUDA events, host time with perf_counter.

GPU time is the median of `triton.testing.do_bench`: it warms the function up, flushes the L2
cache before every repetition and times the function alone between two CUDA events, so the
figure is device time, not launch overhead. Should do_bench fail (its API has moved between
Triton releases), a plain median over CUDA-event pairs is used instead and the row says so.

Host time is `time.perf_counter_ns` around each call, one call per sample, reported as the
median and the 10th/90th percentiles over samples (linear interpolation between the closest
ranks: :mod:`fuzz.bench.stats`).

On CPU (`--quick`) GPU time is a perf_counter median of a few calls of the interpreted kernel:
it shows the code runs, it is not a figure.

Example::

    timer = Timer(torch.device("cuda"), quick=False)
    us, method = timer.gpu_us(lambda: buf.zero_())
    stats = summarize(host_samples(lambda: z.zero_block_ids([1]), 100, before=rt.synchronize))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fuzz.bench.stats import median, percentile

DO_BENCH_WARMUP_MS = 25
DO_BENCH_REP_MS = 100
EVENT_REPS = 50  # the fallback's repetitions
CPU_REPS = 3  # --quick: calls per CPU timing


@dataclass
class Budget:
    """The run's overall wall-clock budget (--max-seconds): rows past it are skipped, not run."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    @property
    def exhausted(self) -> bool:
        return self.left() <= 0


class Timer:
    """GPU-time measurements on one device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        """Wait for the device's queued work (none on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def gpu_us(self, fn: Callable[[], object]) -> tuple[float, str]:
        """(median microseconds, how it was measured)."""
        if self.device.type != "cuda":
            return median(host_samples(fn, CPU_REPS)), "perf_counter median (CPU, not a figure)"
        try:
            from triton.testing import do_bench

            ms = do_bench(fn, warmup=DO_BENCH_WARMUP_MS, rep=DO_BENCH_REP_MS, return_mode="median")
            return float(ms) * 1000.0, "triton.testing.do_bench median (L2 flushed)"
        except Exception as exc:  # noqa: BLE001 - any failure: fall back, and say why
            return _event_median_us(fn), f"CUDA events median (do_bench failed: {type(exc).__name__}: {exc})"


def _event_median_us(fn: Callable[[], object]) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(EVENT_REPS)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return median(start.elapsed_time(end) for start, end in pairs) * 1000.0


def host_samples(fn: Callable[[], object], n: int,
                 before: Callable[[], object] | None = None) -> list[float]:
    """Microseconds of `n` calls of `fn`, each timed alone; `before` runs untimed ahead of each."""
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        if before is not None:
            before()
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1000.0)
    return out


def summarize(samples: list[float]) -> dict[str, float | int | None]:
    """Median, 10th and 90th percentiles (microseconds, 2 decimals; :mod:`fuzz.bench.stats` says
    how the percentiles interpolate) and the sample count."""
    if not samples:
        return {"median_us": None, "p10_us": None, "p90_us": None, "samples": 0}
    return {"median_us": round(median(samples), 2), "p10_us": round(percentile(samples, 10), 2),
            "p90_us": round(percentile(samples, 90), 2), "samples": len(samples)}
