"""The benchmark's measurements, one function per table; each row records its own failure.

* :func:`launch_rows`: host and GPU time of one launch of an empty Triton kernel and of
  `zero_blocks`, through Triton's JIT dispatch and through the cached launcher.
* :func:`bandwidth_rows`: GPU time and write bandwidth of `zero_blocks` for each block count on
  one cache, beside `zero_()` and a device-to-device copy of the same bytes (the ceilings). The
  zeroed pages are checked afterwards, and the guards at the end.
* :func:`config_rows`: the same kernel under other BLOCK_SIZE / num_warps choices.
* :func:`host_rows`: host microseconds per `zero_block_ids` call of every race-free or racy
  design, for each id count, with the GPU idle (synchronised before each call) and busy (a long
  sleep queued first), through the checked runtime the fuzzer runs and the unchecked fast path.

A row that raises gets ``error`` (and the run goes on); a row past the budget gets ``skipped``.
"""

from __future__ import annotations

import functools
import inspect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from zeroer.kernel import CachedLauncher, launch_config, zero_blocks
from zeroer.cache.layout import KVCache, build_cache
from zeroer.registry import BUILTINS, DIRECT, RACE_FREE, RACY
from kvdevice.runtime import Runtime, SimRuntime
from fuzz.bench.kernel.caches import bench_cache, bytes_per_block, describe
from fuzz.bench.kernel.timing import Budget, Timer, host_samples, summarize

HOST_CACHE = "llama"  # the cache the designs zero in the host table
LAUNCH_SAMPLES, QUICK_LAUNCH_SAMPLES = 200, 3
IDLE_SAMPLES, IDLE_WARMUP, QUICK_IDLE_SAMPLES = 100, 10, 3
DIRECT_ROUNDS = 4  # interleaved rounds of the direct designs (each takes its share of the samples)
BUSY_CALLS, BUSY_ROUNDS = 32, 4  # calls queued behind one sleep; counted rounds (one more warms up)
QUICK_BUSY_CALLS, QUICK_BUSY_ROUNDS = 3, 1
MAX_DELAY_UNITS = 3000  # CudaRuntime.delay units (~0.1 ms each): at most ~0.3 s of sleep per round
CONFIGS = ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16), (8192, 32))  # (BLOCK_SIZE, num_warps)
QUICK_CONFIGS = ((256, 2), (4096, 8))
CONFIG_BLOCKS, QUICK_CONFIG_BLOCKS = (1, 256, 4096), (1, 4)
ERROR_CHARS = 600


def _empty(n):  # the least a launch can do: the baseline for a one-block zero
    pass


_empty_compiled = triton.jit(_empty, do_not_specialize=["n"])
_empty_interpreted = InterpretedFunction(_empty)
_empty_launcher = CachedLauncher(_empty_compiled)


class UncheckedSimRuntime(SimRuntime):
    """The simulator without the happens-before checker: the CPU stand-in for the fast path."""

    checked = False


@dataclass
class Context:
    """What every measurement needs: the device, the sizes asked for, the budget, the caches."""

    device: torch.device
    quick: bool
    blocks: list[int]
    ids: list[int]
    geometries: list[str]
    zeroers: list[str]
    budget: Budget
    errors: list[dict] = field(default_factory=list)
    caches: dict[str, KVCache] = field(default_factory=dict)

    @property
    def timer(self) -> Timer:
        return Timer(self.device)

    def cache(self, name: str) -> KVCache:
        if name not in self.caches:
            self.caches[name] = build_cache(bench_cache(name, self.quick), device=self.device)
            self.timer.sync()  # filled on torch's stream; the runtimes' streams must not overtake that
        return self.caches[name]

    def drop(self, name: str) -> None:
        self.caches.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def describe(self, name: str) -> dict:
        return describe(bench_cache(name, self.quick), self.quick)


ORDERS = ("random", "ascending")  # how the zeroed ids lie in the cache (bandwidth table)


def pick_ids(n: int, num_blocks: int, order: str = "random") -> list[int]:
    """`n` distinct ids, never the null block, the same for every run (seeded by `n`).

    ``random``: scattered over the cache, as after a long run of allocations and frees;
    ``ascending``: blocks 1..n, adjacent in memory, as in a fresh cache's free queue.
    """
    if order == "ascending":
        return list(range(1, n + 1))
    return random.Random(n).sample(range(1, num_blocks), n)


def pages_zeroed(cache: KVCache, ids: torch.Tensor) -> bool:
    """Whether every page of the blocks ``ids`` reads zero, in every segment."""
    return all(bool(cache.pages(s).index_select(0, ids).eq(0).all()) for s in range(len(cache.segments)))


def run_row(ctx: Context, section: str, row: dict, measure: Callable[[dict], None]) -> dict:
    """Fill `row` with `measure`, or record why not: over budget, or the exception it raised."""
    if ctx.budget.exhausted:
        row["skipped"] = "over the --max-seconds budget"
        return row
    try:
        measure(row)
    except Exception as exc:  # noqa: BLE001 - one failed row must not lose the others
        row["error"] = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        ctx.errors.append({"section": section, **{k: v for k, v in row.items() if k != "error"},
                           "error": row["error"]})
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
    return row


def _gbps(nbytes: int, us: float | None) -> float | None:
    return None if not us else round(nbytes / us / 1e3, 2)  # bytes per us / 1e3 = GB/s


# -- launch ----------------------------------------------------------------------------------

def _empty_launch(path: str, device: torch.device) -> Callable[[], None]:
    if device.type != "cuda":
        return lambda: _empty_interpreted[(1, 1, 1)](0)
    if path == "jit":
        return lambda: _empty_compiled[(1, 1, 1)](0, num_warps=1)
    return lambda: _empty_launcher.launch((torch.cuda.current_device(),), (1, 1, 1), (0,), num_warps=1)


def launch_rows(ctx: Context) -> list[dict]:
    samples = QUICK_LAUNCH_SAMPLES if ctx.quick else LAUNCH_SAMPLES
    rows = []
    for path in ("jit", "cached"):
        def empty(row: dict, path: str = path) -> None:
            fn = _empty_launch(path, ctx.device)
            fn()  # compile outside the timing
            ctx.timer.sync()
            row["host"] = summarize(host_samples(fn, samples))
            us, row["gpu_timer"] = ctx.timer.gpu_us(fn)
            row["gpu_us"] = round(us, 2)

        rows.append(run_row(ctx, "launch", {"what": "empty kernel", "path": path, "blocks": 0}, empty))
    for n in ctx.ids:
        for path in ("jit", "cached"):
            def zero(row: dict, n: int = n, path: str = path) -> None:
                cache = ctx.cache(HOST_CACHE)
                ids = torch.tensor(pick_ids(n, cache.spec.num_blocks), dtype=torch.int64, device=ctx.device)
                fn = lambda: zero_blocks(cache.table, ids, cached=path == "cached")  # noqa: E731
                fn()
                ctx.timer.sync()
                row["host"] = summarize(host_samples(fn, samples))

            rows.append(run_row(ctx, "launch", {"what": f"zero_blocks ({HOST_CACHE})", "path": path,
                                                "blocks": n}, zero))
    return rows


# -- bandwidth -------------------------------------------------------------------------------

def bandwidth_rows(ctx: Context, name: str) -> tuple[list[dict], dict]:
    """Rows for cache `name`, and a summary of the cache (shape, guard check)."""
    info: dict[str, Any] = {"name": name, **ctx.describe(name)}
    rows: list[dict] = []
    state: dict[str, Any] = {}

    def setup() -> None:
        cache = ctx.cache(name)
        words = max(ctx.blocks) * bytes_per_block(cache.spec) // 4
        state["cache"], state["ceiling"] = cache, torch.empty(2 * words, dtype=torch.int32, device=ctx.device)
        config = launch_config(cache.table.max_page)
        info["launch_config"] = {"block_size": config.block_size, "num_warps": config.num_warps}

    def measure(row: dict) -> None:
        if "cache" not in state:
            setup()
        cache, buf = state["cache"], state["ceiling"]
        n, nbytes = row["blocks"], row["bytes"]
        ids = pick_ids(n, cache.spec.num_blocks, row["order"])
        cache.poison(ids)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=ctx.device)
        row["kernel_us"], row["gpu_timer"] = ctx.timer.gpu_us(lambda: zero_blocks(cache.table, ids_t))
        row["pages_zeroed"] = pages_zeroed(cache, ids_t)
        words = nbytes // 4
        zero_view, src = buf[:words], buf[words:2 * words]
        row["zero_us"], _ = ctx.timer.gpu_us(zero_view.zero_)
        row["copy_us"], _ = ctx.timer.gpu_us(lambda: zero_view.copy_(src))
        for what in ("kernel", "zero", "copy"):
            row[f"{what}_us"] = round(row[f"{what}_us"], 2)
            row[f"{what}_gbps"] = _gbps(nbytes, row[f"{what}_us"])
        row["kernel_vs_zero"] = round(row["kernel_gbps"] / row["zero_gbps"], 3) if row["zero_gbps"] else None

    per_block = bytes_per_block(bench_cache(name, ctx.quick))
    # Scattered ids on every cache; adjacent ones too on the target cache, to tell the kernel's
    # own cost from what scattered 32 KiB pages cost the memory (docs/performance.md).
    for order in ORDERS if name == HOST_CACHE else ORDERS[:1]:
        for n in ctx.blocks:
            rows.append(run_row(ctx, "bandwidth", {"geometry": name, "order": order, "blocks": n,
                                                   "bytes": n * per_block}, measure))
    if "cache" in state:
        def guards(row: dict) -> None:
            row["guard_violations"] = state["cache"].guard_violations()[:5]

        checked = run_row(ctx, "bandwidth", {"geometry": name, "check": "guards"}, guards)
        info["guard_violations"] = checked.get("guard_violations")
        if "guard_violations" not in checked:
            info["guard_check"] = checked.get("error") or checked.get("skipped")
    state.clear()
    return rows, info


def config_rows(ctx: Context) -> list[dict]:
    configs = QUICK_CONFIGS if ctx.quick else CONFIGS
    sizes = [n for n in (QUICK_CONFIG_BLOCKS if ctx.quick else CONFIG_BLOCKS)
             if n < bench_cache(HOST_CACHE, ctx.quick).num_blocks]
    rows = []
    for block_size, num_warps in configs:
        for n in sizes:
            def measure(row: dict, n: int = n, bs: int = block_size, nw: int = num_warps) -> None:
                cache = ctx.cache(HOST_CACHE)
                ids = torch.tensor(pick_ids(n, cache.spec.num_blocks), dtype=torch.int64, device=ctx.device)
                us, row["gpu_timer"] = ctx.timer.gpu_us(
                    lambda: zero_blocks(cache.table, ids, block_size=bs, num_warps=nw))
                row["kernel_us"], row["kernel_gbps"] = round(us, 2), _gbps(row["bytes"], us)

            row = {"geometry": HOST_CACHE, "block_size": block_size, "num_warps": num_warps, "blocks": n,
                   "bytes": n * bytes_per_block(bench_cache(HOST_CACHE, ctx.quick))}
            rows.append(run_row(ctx, "configs", row, measure))
    return rows


# -- host time per call ----------------------------------------------------------------------

def _runtime(ctx: Context, path: str) -> Runtime:
    checked = path == "checked"
    if ctx.device.type == "cuda":
        from kvdevice.runtime.cuda import CudaRuntime

        return CudaRuntime(mode="free", device=ctx.device, checked=checked)
    return SimRuntime() if checked else UncheckedSimRuntime()


def _options(ctx: Context, name: str) -> dict:
    # The simulator runs staged designs with the torch kernel, as the sim fuzz campaigns do:
    # under the interpreter each call would time the interpreter.
    params = inspect.signature(BUILTINS[name].factory).parameters
    return {"kernel": "torch"} if ctx.device.type != "cuda" and "kernel" in params else {}


def _busy_calls(ctx: Context, rt: Runtime, call: Callable[[], None], idle_us: float | None) -> tuple[list[float], bool]:
    """Host times of calls queued behind a sleep, and whether the GPU stayed busy throughout."""
    calls, rounds = (QUICK_BUSY_CALLS, QUICK_BUSY_ROUNDS) if ctx.quick else (BUSY_CALLS, BUSY_ROUNDS)
    # Sleep about 4x as long as the calls take (0.1 ms a unit), longer if that proved too short.
    units = 5 if ctx.quick else max(20, min(MAX_DELAY_UNITS, math.ceil(calls * (idle_us or 100) * 4 / 100)))
    stream = rt.current_stream()
    samples: list[float] = []
    busy_throughout = True
    for r in range(rounds + 1):  # round 0 warms up (a ring grows, the allocator fills)
        rt.synchronize()
        rt.delay(stream, units)
        got = host_samples(call, calls)
        busy = not rt.query_event(rt.record_event())
        rt.synchronize()
        if r:
            samples += got
            busy_throughout = busy_throughout and busy
        if not busy:
            units = min(MAX_DELAY_UNITS, units * 4)
    return samples, busy_throughout


def host_rows(ctx: Context) -> list[dict]:
    rows = []
    for path in ("unchecked", "checked"):
        holder: dict[str, Runtime] = {}

        def start(row: dict, path: str = path) -> None:
            holder["rt"] = _runtime(ctx, path)
            ctx.cache(HOST_CACHE)

        start_row = run_row(ctx, "host", {"runtime": path}, start)
        if "rt" not in holder:
            rows.append(start_row)
            continue
        rt = holder["rt"]
        try:
            with rt.use_stream(rt.default_stream):
                for name in ctx.zeroers:
                    if name not in DIRECT:
                        rows += _design_rows(ctx, rt, path, name)
                if path == "unchecked":
                    # Straight against torch.cuda: on torch's current stream, which use_stream
                    # made the runtime's, so the runtime's sleep keeps the GPU busy for them too.
                    rows += _direct_rows(ctx, rt, [name for name in ctx.zeroers if name in DIRECT])
        finally:
            try:  # whatever the budget says: a runtime left open keeps its watchdog thread
                rt.close()
            except Exception as exc:  # noqa: BLE001
                ctx.errors.append({"section": "host", "runtime": path, "closing": True,
                                   "error": f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]})
    return rows


def _direct_rows(ctx: Context, rt: Runtime, names: list[str]) -> list[dict]:
    """The direct designs, measured side by side in interleaved rounds.

    Their target is a ratio between two of them, and on a shared host the time per call drifts
    by tens of percent within a minute (seen on the H200 host), so each round measures every
    design once, in turn, and the rounds' samples are pooled.
    """
    base = {name: {"design": name, "verdict": "race-free", "runtime": "direct"} for name in names}
    if ctx.device.type != "cuda":
        return [dict(base[name], ids=None, gpu="setup", skipped="runs on CUDA only (zeroer/designs)")
                for name in names]
    cache = ctx.cache(HOST_CACHE)
    made: dict[str, Any] = {}
    rows = []
    for name in names:
        def build(row: dict, name: str = name) -> None:
            made[name] = BUILTINS[name].factory(cache, rt)
            made[name].warmup()
            rt.synchronize()

        built = run_row(ctx, "host", dict(base[name], ids=None, gpu="setup"), build)
        if name not in made:
            rows.append(built)
    rounds, idle_samples = (1, QUICK_IDLE_SAMPLES) if ctx.quick else (DIRECT_ROUNDS, IDLE_SAMPLES // DIRECT_ROUNDS)
    for n in ctx.ids:
        ids = pick_ids(n, cache.spec.num_blocks)
        idle_us: dict[str, float | None] = {}
        for gpu in ("idle", "busy"):
            samples: dict[str, list[float]] = {name: [] for name in made}
            busy_throughout = dict.fromkeys(made, True)

            def measure(row: dict, gpu: str = gpu, samples: dict = samples, busy_throughout: dict = busy_throughout,
                        idle_us: dict = idle_us, ids: list[int] = ids) -> None:
                for _ in range(rounds):
                    for name, z in made.items():
                        call = functools.partial(z.zero_block_ids, ids)
                        if gpu == "idle":
                            if not ctx.quick:
                                host_samples(call, IDLE_WARMUP, before=rt.synchronize)
                            samples[name] += host_samples(call, idle_samples, before=rt.synchronize)
                        else:
                            got, busy = _busy_calls(ctx, rt, call, idle_us.get(name))
                            samples[name] += got
                            busy_throughout[name] = busy_throughout[name] and busy
                rt.synchronize()

            together = run_row(ctx, "host", {"designs": list(made), "ids": n, "gpu": gpu}, measure)
            for name in made:
                row = dict(base[name], ids=n, gpu=gpu, rounds=rounds)
                if "error" in together or "skipped" in together:
                    row.update({k: together[k] for k in ("error", "skipped") if k in together})
                else:
                    row.update(summarize(samples[name]))
                    if gpu == "busy":
                        row["busy_throughout"] = busy_throughout[name]
                    else:
                        idle_us[name] = row["median_us"]
                rows.append(row)
    return rows


def _design_rows(ctx: Context, rt: Runtime, path: str, name: str) -> list[dict]:
    cache = ctx.cache(HOST_CACHE)
    verdict = "race-free" if name in RACE_FREE else "racy" if name in RACY else "?"
    base = {"design": name, "verdict": verdict, "runtime": path, **_options(ctx, name)}
    made: dict[str, Any] = {}

    def build(row: dict) -> None:
        made["z"] = BUILTINS[name].factory(cache, rt, **_options(ctx, name))
        getattr(made["z"], "warmup", lambda: made["z"].zero_block_ids([0]))()
        rt.synchronize()

    built = run_row(ctx, "host", dict(base, ids=None, gpu="setup"), build)
    if "z" not in made:
        return [built]
    z, rows = made["z"], []
    for n in ctx.ids:
        idle: dict[str, Any] = {}

        def caller(n: int = n) -> Callable[[], None]:
            ids = pick_ids(n, cache.spec.num_blocks)
            return lambda: z.zero_block_ids(ids)

        def measure_idle(row: dict, caller: Callable[[], Callable[[], None]] = caller) -> None:
            call, before = caller(), len(rt.hazards)
            if not ctx.quick:
                host_samples(call, IDLE_WARMUP, before=rt.synchronize)
            row.update(summarize(host_samples(call, QUICK_IDLE_SAMPLES if ctx.quick else IDLE_SAMPLES,
                                              before=rt.synchronize)))
            rt.synchronize()
            row["hazards"] = len(rt.hazards) - before
            idle["us"] = row["median_us"]

        def measure_busy(row: dict, caller: Callable[[], Callable[[], None]] = caller) -> None:
            call, before = caller(), len(rt.hazards)
            samples, row["busy_throughout"] = _busy_calls(ctx, rt, call, idle.get("us"))
            row.update(summarize(samples))
            row["hazards"] = len(rt.hazards) - before

        rows.append(run_row(ctx, "host", dict(base, ids=n, gpu="idle"), measure_idle))
        rows.append(run_row(ctx, "host", dict(base, ids=n, gpu="busy"), measure_busy))
    return rows
