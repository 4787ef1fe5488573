"""Baseline (c): PyTorch's CUDA sanitizer (CSAN) watching the plain stress loop.

:func:`sanitizer` runs the stress loop of :mod:`fuzz.bench.detect.baselines.stress` on the cuda backend in
free mode, in a child process started with ``TORCH_CUDA_SANITIZER=1`` (CSAN is switched on when
torch is imported, so it must be a fresh interpreter). A **detection is a CSAN report**
("CSAN detected a possible data race ..."), not a finding of our oracle; the child keeps going
past value findings and mentions the first one after the CSAN report in the message.

CSAN sees torch operators on CUDA tensors and the stream/event calls torch makes; it keys each
access by the tensor's first address. So (docs/baselines.md):

* it cannot see the host writing a pinned buffer (a CPU tensor) that a queued copy still reads,
  which is the vLLM #48085 race itself;
* it cannot see a Triton kernel that writes through a raw address table (the zero kernel), nor
  ``event.query()`` (an event-ring zeroer's only synchronisation);
* it reports two writes to different blocks of one KV-cache tensor from unordered streams,
  because to CSAN they are one tensor.

The runtime waits for the device by polling ``query()`` (gates must never block the host), which
CSAN cannot see; the child turns each of those host syncs into the torch call a plain program
would make (``torch.cuda.synchronize()``, ``Stream.synchronize()``, ``Event.synchronize()``,
immediate since the work is already done), builds the cache and warms up on the runtime's main
stream, so that CSAN judges the zeroer and not the harness.

The child prints one ``kvzero-baseline-result: {json}`` line; :func:`outcome_from_child` (pure,
tested on CPU) turns that, or a crash, a timeout or a bare CSAN report on stderr, into a
:class:`~fuzz.bench.detect.outcome.DetectionOutcome`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from fuzz.bench.detect.baselines.stress import (
    DEFAULT_REPRO_DIR,
    NEEDS_CUDA,
    NO_FINDING,
    EpisodeHooks,
    check_budget,
    check_seed,
    one_line,
    stress_loop,
)
from fuzz.bench.detect.outcome import DetectionOutcome
from fuzz.engine.episode import Episode, EpisodeConfig
from fuzz.engine.oracle import Finding
from fuzz.engine.trace import write_trace

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "kvzero-baseline-result: "
CSAN_REPORT = "CSAN detected a possible data race"  # torch/cuda/_sanitizer.py, UnsynchronizedAccessError
CHILD_MARGIN_S = 120.0  # child start-up: torch and Triton imports, CUDA init, first compiles under CSAN
_REPORT_RE = re.compile(
    r"CSAN detected a possible data race on tensor with data pointer (?P<ptr>\d+)\s*\n"
    r"Access by stream (?P<stream>\d+) during kernel:\s*\n(?P<op>[^\n(]+)[^\n]*\n(?P<type>reading from|writing to)"
    r"(?:.*?\nPrevious access by stream (?P<pstream>\d+) during kernel:\s*\n(?P<pop>[^\n(]+)[^\n]*\n"
    r"(?P<ptype>reading from|writing to))?",
    re.S,
)


# -- messages (pure) ------------------------------------------------------------------------------
def csan_summary(
    ptr: int, current: tuple[str, str, str], previous: tuple[str, str, str] | None, what: str | None = None
) -> str:
    """One line for a CSAN report; ``current``/``previous`` are (operator, access, stream)."""
    op, access, stream = current
    line = f"CSAN: possible data race on the tensor at {ptr:#x}" + (f" ({what})" if what else "")
    line += f": {op} {access} it on {stream}"
    if previous is not None:
        pop, paccess, pstream = previous
        line += f", unordered with {pop} {paccess} it on {pstream}"
    return line


def parse_csan_report(text: str) -> str | None:
    """The first CSAN report in ``text`` (a child's stderr) as one line, or None."""
    if CSAN_REPORT not in text:
        return None
    match = _REPORT_RE.search(text)
    if match is None:  # the format changed: still a report, say so plainly
        return f"CSAN: {one_line(text[text.index(CSAN_REPORT):].splitlines()[0])}"
    previous = None
    if match["pstream"] is not None:
        previous = (match["pop"].strip(), match["ptype"], f"stream {match['pstream']}")
    return csan_summary(int(match["ptr"]), (match["op"].strip(), match["type"], f"stream {match['stream']}"), previous)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return one_line(lines[-1]) if lines else "no output"


def outcome_from_child(rc: int | None, stdout: str, stderr: str, timed_out: bool, limit_s: float) -> DetectionOutcome:
    """The outcome of a sanitizer child from its exit status and output."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return DetectionOutcome(**json.loads(line[len(RESULT_PREFIX):]))
    if timed_out:
        why = f"the sanitizer child did not finish within {limit_s:g} s (budget + margin) and was killed"
    elif rc is not None and rc < 0:
        why = f"the sanitizer child was killed by signal {-rc} before reporting; last stderr line: {_last_line(stderr)}"
    else:
        why = f"the sanitizer child exited with code {rc} before reporting; last stderr line: {_last_line(stderr)}"
    report = parse_csan_report(stderr)
    if report is not None:  # CSAN spoke before the child died: a detection, counts unknown
        return DetectionOutcome(True, None, None, 0, None, None, f"{report} ({why})")
    return DetectionOutcome(False, None, None, 0, None, None, NO_FINDING, error=why)


# -- the parent -----------------------------------------------------------------------------------
def child_command(config: EpisodeConfig, budget_s: float, seed: int, repro_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "fuzz.bench.detect.baselines", "stress-child",
        "--config-json", json.dumps(dataclasses.asdict(config)),
        "--budget", repr(budget_s), "--seed", str(seed), "--repro-dir", str(repro_dir),
    ]


def sanitizer(
    config: EpisodeConfig, budget_s: float, seed: int, *, repro_dir: Path | None = None
) -> DetectionOutcome:
    """Baseline (c): the stress loop under CSAN on cuda (free mode), in a child process."""
    budget_s, seed = check_budget(budget_s), check_seed(seed)
    if not torch.cuda.is_available():
        return NEEDS_CUDA
    config = dataclasses.replace(config, backend="cuda", mode="free")
    repro_dir = (repro_dir or DEFAULT_REPRO_DIR).resolve()
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    limit_s = budget_s + CHILD_MARGIN_S
    rc, stdout, stderr, timed_out = run_child(child_command(config, budget_s, seed, repro_dir), env, limit_s)
    return outcome_from_child(rc, stdout, stderr, timed_out, limit_s)


def run_child(command: list[str], env: dict[str, str], limit_s: float) -> tuple[int | None, str, str, bool]:
    """Run ``command`` in its own process group; kill that group if it outlives ``limit_s``."""
    child = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = child.communicate(timeout=limit_s)
        return child.returncode, stdout, stderr, False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # the group we started (Triton may have spawned helpers)
        stdout, stderr = child.communicate()
        return child.returncode, stdout, stderr, True


# -- the child ------------------------------------------------------------------------------------
class CsanHooks(EpisodeHooks):
    """Make the harness read to CSAN like a plain torch program (see the module docstring), and
    remember the current episode (to name streams and tensors in a report)."""

    episode: Episode | None = None

    def created(self, episode: Episode) -> None:
        self.episode = episode
        rt = episode.rt
        sync_all, sync_stream, sync_event = rt.synchronize, rt.synchronize_stream, rt.synchronize_event

        def synchronize() -> None:
            sync_all()
            torch.cuda.synchronize(rt.device)

        def synchronize_stream(stream=None) -> None:
            sync_stream(stream)
            (stream or rt.current_stream()).handle.synchronize()

        def synchronize_event(event) -> None:
            sync_event(event)
            if event.stream is not None:
                event.handle.synchronize()

        rt.synchronize, rt.synchronize_stream, rt.synchronize_event = synchronize, synchronize_stream, synchronize_event
        torch.cuda.synchronize(rt.device)  # the cache was filled on torch's default stream

    def apply(self, episode: Episode, op: dict) -> Any:
        if op["op"] != "start":
            return episode.apply(op)
        with torch.cuda.stream(episode.streams[0].handle):  # warm-up writes on the main stream
            return episode.apply(op)


def _device_buffers(zeroer: object) -> list[tuple[str, torch.Tensor]]:
    """The device buffers a zeroer keeps in its attributes (two levels deep), by attribute path."""
    from kvdevice.runtime import DeviceBuffer

    found: list[tuple[str, torch.Tensor]] = []

    def visit(value: object, path: str, depth: int) -> None:
        if isinstance(value, DeviceBuffer):
            found.append((path, value.tensor))
        elif isinstance(value, (list, tuple)) and depth < 3:
            for i, item in enumerate(value):
                visit(item, f"{path}[{i}]", depth + 1)
        elif hasattr(value, "__dict__") and depth < 2 and not isinstance(value, (torch.Tensor, type)):
            for name, item in vars(value).items():
                visit(item, f"{path}.{name}", depth + 1)

    for name, value in vars(zeroer).items():
        visit(value, name, 0)
    return found


def describe_pointer(episode: Episode, ptr: int) -> str:
    for t, raw in enumerate(episode.cache.raws):
        if raw.data_ptr() <= ptr < raw.data_ptr() + raw.numel() * raw.element_size():
            return f"KV-cache tensor {t}; CSAN tracks whole tensors, not blocks"
    for path, tensor in _device_buffers(episode.zeroer.zeroer):
        if tensor.data_ptr() <= ptr < tensor.data_ptr() + max(tensor.numel(), 1) * tensor.element_size():
            return f"the zeroer's device buffer {path}"
    return "not the KV cache nor a buffer the zeroer keeps"


def _stream_name(episode: Episode | None, stream_id: int) -> str:
    for stream in episode.streams if episode is not None else ():
        if getattr(stream.handle, "cuda_stream", None) == stream_id:
            return f"stream {stream.index} ('{stream.name}')"
    return "torch's default stream" if stream_id == 0 else f"CUDA stream {stream_id:#x}"


def child_main(config: EpisodeConfig, budget_s: float, seed: int, repro_dir: Path) -> int:
    """Run in the child: the stress loop under CSAN; print one result line; exit 0."""
    # Importing torch.cuda._sanitizer activates CUDA tracing in this process: only with CSAN on.
    enabled = "TORCH_CUDA_SANITIZER" in os.environ
    if enabled:
        import torch.cuda._sanitizer as csan

        enabled = csan.cuda_sanitizer.enabled
    if not enabled:
        error = "CSAN is not enabled in the child; set TORCH_CUDA_SANITIZER=1 before torch is imported"
        outcome = DetectionOutcome(False, None, None, 0, None, None, NO_FINDING, error=error)
    else:
        outcome = _run_under_csan(config, budget_s, seed, repro_dir, csan.CUDASanitizerErrors)
    print(RESULT_PREFIX + json.dumps(dataclasses.asdict(outcome)), flush=True)
    return 0


def _run_under_csan(config: EpisodeConfig, budget_s: float, seed: int, repro_dir: Path, errors: type) -> DetectionOutcome:
    hooks = CsanHooks()
    result = stress_loop(config, budget_s, seed, stop_on_finding=False, hooks=hooks)
    oracle = f"; our value oracle: {one_line(str(result.first))}" if result.first is not None else ""
    exc = result.exception
    if exc is None:
        return DetectionOutcome(False, None, result.episodes, result.steps, None, None, NO_FINDING)
    if not isinstance(exc, errors):
        error = one_line(f"episode {result.episodes} raised {type(exc).__name__}: {exc}")
        return DetectionOutcome(False, None, result.episodes, result.steps, None, None, NO_FINDING, error=error)
    first = exc.errors[0]
    episode = hooks.episode if result.exception_trace else None  # None: raised while building one
    if hasattr(first, "current_access"):
        def access(a) -> tuple[str, str, str]:
            return str(a.operator).split("(")[0], str(a.type), _stream_name(episode, a.stream)

        what = describe_pointer(episode, first.data_ptr) if episode is not None else None
        message = csan_summary(first.data_ptr, access(first.current_access), access(first.previous_access), what)
    else:
        message = f"CSAN: {one_line(str(first))}"
    trace = result.exception_trace or []
    path = write_trace(
        repro_dir, config, trace, [Finding("csan", None, message)], seed=seed, campaign=f"baseline-sanitizer-seed{seed}"
    )
    return DetectionOutcome(True, result.exception_s, result.episodes, result.steps, len(trace), str(path), message + oracle)

