"""``python -m repro timeline TRACE``: a picture of a race, for Perfetto and for any browser.

A trace's ops are replayed on the simulator (whatever backend found them: the ops fix the
schedule, docs/runtime.md) through :class:`fuzz.engine.episode.Episode`, the fuzzer's own executor,
with an observer on its stream queues (:mod:`kvdevice.runtime.queues`) that notes when each device
op is queued and when it runs. What comes out is Chrome trace-event JSON, which ui.perfetto.dev
("Open trace file") and chrome://tracing open:

* one track for the host: a slice per op of the trace, named like the fuzzer's program
  (``allocate_blocks(n=1, stream=0)``), then ``teardown()``, where the episode synchronises once
  and the oracle checks every read and block;
* one track per stream: a slice per device op (copy, kernel, event record, event wait, sleep,
  hold), placed where it *ran*, not where it was queued (its args say which host op queued it);
* a flow arrow from each event record to every wait on it;
* an instant on the right track for each finding, its message in ``args``.

The simulator has no wall time, so the clock is logical: each host op starts a tick, each device
op that runs takes one tick inside the host op that made it run (an ``advance``, a sync, the
teardown), and a host op lasts until the last device op it ran, at least one tick. Order is
therefore exact, and "the copy ran after the host rewrote its buffer" reads straight off the
picture. One tick is drawn as 1 ms (:data:`TICK_US`).

Beside the JSON goes a self-contained HTML page (no network, no script: inline SVG, hover
titles) drawing the same tracks, slices, flows and findings.

Example::

    json_path, html_path = write_timeline(Path("repro/cases/ring_overrun.json"))
    timeline = build_timeline(load_trace(Path("repro/cases/ring_overrun.json")))
    [e["name"] for e in timeline["traceEvents"] if e["ph"] == "X" and e["tid"] == HOST_TID]
    # ['start(in_flight=1)', 'allocate_blocks(n=1, stream=0)', ..., 'teardown()']
"""

from __future__ import annotations

import dataclasses
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from racecheck.atomic_file import write_json_atomically, write_text_atomically
from fuzz.engine.episode import CodeUnderTestRaised, Episode
from fuzz.engine.harness_error import HarnessError
from fuzz.engine.ops import FIELDS
from fuzz.trace import Trace, load_trace
from kvdevice.runtime.queues import QueuedOp

TICK_US = 1000  # one logical tick, in the trace-event format's microseconds
HALF = TICK_US // 2  # flows and instants sit mid-slice, so each binds to exactly one slice
PID = 1
HOST_TID = 1  # stream i is tid i + 2 (tid 0 is avoided: trace viewers read it as the idle thread)

# op -> the rule of fuzz/engine/machine.py that emits it, so a slice reads like the shrunk program.
RULES = {
    "start": "start", "allocate": "allocate_blocks", "write": "write_block", "read": "read_block",
    "free": "free_block", "advance": "advance_stream", "delay": "delay_stream", "end_step": "end_step",
    "sync_stream": "synchronize_stream", "sync_device": "synchronize_device", "reallocate": "reallocate_cache",
}
TEARDOWN = "teardown()"


def stream_tid(stream: int) -> int:
    return stream + 2


def host_op_name(op: dict) -> str:
    """``allocate_blocks(n=1, stream=0)``: an op record as the fuzzer's program prints its rule."""
    name = op["op"]
    defaults = FIELDS[name][1] if name in FIELDS else {}
    args = {k: v for k, v in op.items() if k != "op"}
    rule = RULES.get(name, name)
    if name == "allocate":
        args.setdefault("stream", 0)
        if any(args.get(k, d) != d for k, d in defaults.items() if k != "stream"):
            rule = "allocate_blocks_handed"
    else:  # the optional fields the machine leaves out when they have their default
        args = {k: v for k, v in args.items() if not (k == "cache" and v == defaults.get(k))}
    return f"{rule}({', '.join(f'{k}={v!r}' for k, v in args.items())})"


# -- recording -------------------------------------------------------------------------------

@dataclass
class _Run:
    """One device op as it ran."""

    stream: int
    op: QueuedOp
    queued_by: int | None  # index of the host op that queued it; None: before the first op
    tick: int
    failed: bool


@dataclass
class _HostOp:
    index: int  # in trace.ops; len(trace.ops) for the teardown
    name: str
    start: int
    end: int = 0
    args: dict[str, Any] = field(default_factory=dict)


class _Recorder:
    """The queue observer: a logical clock, and every device op with the host op that queued it."""

    def __init__(self) -> None:
        self.clock = 0
        self.host: int | None = None
        self.queued_by: dict[tuple[int, int], int | None] = {}
        self.queued: dict[int | None, list[str]] = {}
        self.runs: list[_Run] = []

    def __call__(self, what: str, stream: int, op: QueuedOp) -> None:
        if what == "enqueued":
            self.queued_by[(stream, op.seq)] = self.host
            self.queued.setdefault(self.host, []).append(op.label)
            return
        queued_by = self.queued_by.get((stream, op.seq))
        self.runs.append(_Run(stream, op, queued_by, self.clock, what == "failed"))
        self.clock += 1


@dataclass
class _Replay:
    streams: list[str]
    hosts: list[_HostOp]
    runs: list[_Run]
    findings: list[Any]  # fuzz.engine.oracle.Finding
    stopped: str | None  # why the replay stopped early (an op the program cannot run), if it did
    stopped_at: int | None = None  # the index of the op it stopped at


def _replay(trace: Trace) -> _Replay:
    """Run the trace's ops as :func:`fuzz.engine.episode.run_ops` does, on the simulator, observed."""
    config = dataclasses.replace(trace.config, backend="sim", device=None)
    try:  # a factory that raises is a usage error (HarnessError, exit status 2): nothing to draw
        episode = Episode(config)
    except Exception as error:  # noqa: BLE001 - e.g. a zeroer that needs a GPU
        streams = ["main"] + [f"s{i}" for i in range(1, config.streams)]  # as Episode names them
        return _Replay(streams, [], [], [], f"replay stopped: {type(error).__name__}: {error}")
    recorder = _Recorder()
    # Attached once the episode exists: device work its zeroer factory queued shows as queued
    # "before the first op". (Episode builds its own runtime; no hook is needed before that.)
    episode.rt.queues.observers.append(recorder)
    hosts: list[_HostOp] = []
    stopped = stopped_at = None

    def host_op(index: int, name: str, fn: Any, args: dict[str, Any]) -> Any:
        recorder.host = index
        host = _HostOp(index, name, recorder.clock, args)
        hosts.append(host)
        try:
            return fn()
        finally:
            host.end = max(host.start + 1, recorder.clock)
            recorder.clock = host.end

    try:
        for index, op in enumerate(trace.ops):
            result = host_op(index, host_op_name(op), lambda op=op: episode.apply(op), {"op": op})
            if result is not None:
                hosts[-1].args["result"] = result
            if episode.new_hazard_findings():
                break  # like the fuzzer and the replayer: stop at the first hazard, then judge
        host_op(len(trace.ops), TEARDOWN, episode.finish,
                {"does": "synchronise once, then the oracle checks every read and every block"})
    except CodeUnderTestRaised:
        pass  # a finding of its own, already in episode.findings
    except (HarnessError, Exception) as error:  # noqa: BLE001 - draw what ran; the reason goes in the picture
        # A HarnessError (a BaseException): what the simulator cannot run (a Triton kernel its interpreter cannot).
        why = error.message if isinstance(error, HarnessError) else f"{type(error).__name__}: {error}"
        stopped = f"replay stopped{f' at op {hosts[-1].index} ({hosts[-1].name})' if hosts else ''}: {why}"
        stopped_at = hosts[-1].index if hosts else None
    finally:
        if not episode.finished:  # what is still queued runs now: draw it inside a teardown too
            host_op(len(trace.ops), TEARDOWN, episode.abandon,
                    {"does": "the replay stopped early: let every queued op run, judge nothing"})
    for host in hosts:
        host.args["queued"] = recorder.queued.get(host.index, [])
    streams = [s.name for s in episode.rt.streams]  # the episode's, then any a zeroer made itself
    return _Replay(streams, hosts, recorder.runs, list(episode.findings), stopped, stopped_at)


# -- the trace-event JSON --------------------------------------------------------------------

def _finding_place(finding: dict[str, Any], replay: _Replay) -> tuple[int, int]:
    """(tid, ts) of the instant for a finding, from the place it records (never from its text): the
    read it judged (``step`` and ``stream``), the step it was found at, the op a worker died in or
    the replay stopped at; else the teardown, where the oracle found it."""
    step, stream = finding.get("step"), finding.get("stream")
    if isinstance(step, int) and isinstance(stream, int):
        for run in replay.runs:  # the read: the kernel that step queued on that stream
            if run.stream == stream and run.queued_by == step - 1 and run.op.kind == "kernel":
                return stream_tid(stream), run.tick * TICK_US + HALF
    op = finding.get("op")
    index = step - 1 if isinstance(step, int) else op if isinstance(op, int) else None
    host = {h.index: h for h in replay.hosts}.get(index)  # None: no op named, or none with that index
    if host is None and replay.hosts:
        host = replay.hosts[-1]  # the teardown
    ts = (host.end - 1) * TICK_US + HALF if host is not None else 0
    return HOST_TID, ts


def build_timeline(trace: Trace) -> dict[str, Any]:
    """The trace-event JSON of one trace, replayed on the simulator (module docstring)."""
    replay = _replay(trace)
    config = trace.config
    title = f"{config.offloader or config.zeroer} on {config.geometry}: {trace.path.name} (simulator replay)"
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": PID, "tid": HOST_TID, "args": {"name": title}}]
    tracks = [(HOST_TID, "host")] + [(stream_tid(i), f"stream {i} '{name}'") for i, name in enumerate(replay.streams)]
    for sort_index, (tid, name) in enumerate(tracks):
        events.append({"ph": "M", "name": "thread_name", "pid": PID, "tid": tid, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": PID, "tid": tid, "args": {"sort_index": sort_index}})
    hosts = {h.index: h for h in replay.hosts}
    for host in replay.hosts:
        events.append({"ph": "X", "name": host.name, "cat": "host", "pid": PID, "tid": HOST_TID,
                       "ts": host.start * TICK_US, "dur": (host.end - host.start) * TICK_US,
                       "args": {"index": host.index, **host.args}})
    ran_at: dict[tuple[int, int], _Run] = {}
    for run in replay.runs:
        ran_at[(run.stream, run.op.seq)] = run
        queued_by = hosts.get(run.queued_by) if run.queued_by is not None else None
        args = {"label": run.op.label, "kind": run.op.kind, "position": run.op.seq,
                "queued by": f"op {queued_by.index}: {queued_by.name}" if queued_by else "before the first op",
                "queued at tick": queued_by.start if queued_by else 0, "ran at tick": run.tick}
        if run.failed:
            args["failed"] = True
        # ``copy#3 (ring.zero_block_ids#2([1]) [slot 1])``: the label less its stream, which the track says
        name = run.op.label.replace(f" on stream '{replay.streams[run.stream]}'", "", 1)
        events.append({"ph": "X", "name": name, "cat": run.op.kind,
                       "pid": PID, "tid": stream_tid(run.stream), "ts": run.tick * TICK_US, "dur": TICK_US, "args": args})
    flow = 0
    for run in replay.runs:
        if run.op.kind != "wait" or run.op.wait_for is None or run.op.wait_for not in ran_at:
            continue  # an unrecorded event (complete at once), or a record from before the replay
        record = ran_at[run.op.wait_for]
        flow += 1
        common = {"name": "event", "cat": "event", "id": flow, "pid": PID}
        events.append({**common, "ph": "s", "tid": stream_tid(record.stream), "ts": record.tick * TICK_US + HALF})
        events.append({**common, "ph": "f", "bp": "e", "tid": stream_tid(run.stream), "ts": run.tick * TICK_US + HALF})
    for message, finding in _findings(trace, replay):
        tid, ts = _finding_place(finding, replay)
        events.append({"ph": "i", "s": "t", "name": f"finding: {finding['kind']}", "cat": "finding",
                       "pid": PID, "tid": tid, "ts": ts, "args": {"message": message, **finding}})
    end = replay.hosts[-1].end if replay.hosts else 0
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "trace": str(trace.path), "zeroer": config.zeroer, "offloader": config.offloader, "geometry": config.geometry,
            "found on": config.backend, "replayed on": "sim", "campaign": trace.campaign, "seed": trace.seed,
            "clock": f"logical: 1 tick = {TICK_US} us on the ruler; a host op starts a tick, each device op that runs takes one",
            "ticks": end, **({"stopped": replay.stopped} if replay.stopped else {}),
        },
    }


PLACE = ("step", "stream", "op")  # a finding's recorded place (fuzz.engine.oracle.Finding, a crash's op)


def _findings(trace: Trace, replay: _Replay) -> list[tuple[str, dict[str, Any]]]:
    """The trace's findings, then any the replay found besides; each says whether both saw it, and
    where it was found (:data:`PLACE`) where that is recorded."""
    replayed = {f.message: f for f in replay.findings}
    out: dict[str, dict[str, Any]] = {}
    for finding in trace.findings:
        message = finding.get("message", "")
        place = {k: finding[k] for k in PLACE if finding.get(k) is not None}
        if not place and message in replayed:  # a trace written before findings kept their place
            place = _place(replayed[message])
        out[message] = {"kind": finding.get("kind", "finding"), "block": finding.get("block"),
                        "recorded in the trace": True, "found by this replay": message in replayed, **place}
    for message, found in replayed.items():
        if message not in out:
            out[message] = {"kind": found.kind, "block": found.block, "recorded in the trace": False,
                            "found by this replay": True, **_place(found)}
    if replay.stopped and replay.stopped not in out:
        out[replay.stopped] = {"kind": "replay stopped", "block": None, "recorded in the trace": False,
                               "found by this replay": True,
                               **({"op": replay.stopped_at} if replay.stopped_at is not None else {})}
    return list(out.items())


def _place(finding: Any) -> dict[str, int]:
    """A replayed finding's place (fuzz.engine.oracle.Finding), the parts it knows."""
    return {k: v for k, v in (("step", finding.step), ("stream", finding.stream)) if v is not None}


# -- the HTML page ---------------------------------------------------------------------------

PX_PER_TICK = 96
ROW = 30
LABEL_W = 150
COLOURS = {"host": "#5b6b82", "copy": "#3b82c4", "kernel": "#3c9a5f", "record": "#d08a2c",
           "wait": "#8a5cc2", "sleep": "#9aa0a6", "hold": "#8d6e63", "failed": "#c62828"}


def render_html(timeline: dict[str, Any]) -> str:
    """A self-contained page (inline SVG, hover titles, no script) drawing a timeline's tracks,
    slices, flows and findings; built from the JSON alone, so both always show the same."""
    events = timeline["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    rows = {tid: i for i, tid in enumerate(sorted(names))}
    title = next((e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"), "timeline")
    ticks = max([(e["ts"] + e.get("dur", 0)) // TICK_US for e in events if "ts" in e] + [1])
    width, height = LABEL_W + ticks * PX_PER_TICK + 20, 24 + len(rows) * ROW + 10
    x = lambda ts: LABEL_W + ts * PX_PER_TICK / TICK_US  # noqa: E731
    y = lambda tid: 24 + rows[tid] * ROW  # noqa: E731
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           '<defs><marker id="arrow" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" markerHeight="7" orient="auto">'
           '<path d="M0,0 L8,4 L0,8 z" fill="#444"/></marker></defs>']
    for tick in range(ticks + 1):
        svg.append(f'<line x1="{x(tick * TICK_US)}" y1="18" x2="{x(tick * TICK_US)}" y2="{height - 10}" stroke="#eee"/>')
        if tick % 5 == 0:
            svg.append(f'<text x="{x(tick * TICK_US) + 2}" y="13" fill="#888">{tick}</text>')
    for tid, row in rows.items():
        svg.append(f'<text x="4" y="{y(tid) + 18}" font-weight="bold">{html.escape(names[tid])}</text>')
    for e in events:
        if e["ph"] != "X":
            continue
        colour = COLOURS["failed"] if e["args"].get("failed") else COLOURS.get(e["cat"], "#777")
        tip = html.escape(e["name"] + "\n" + json.dumps(e["args"], indent=1, default=str))
        w = max(e["dur"] * PX_PER_TICK / TICK_US - 1, 2)
        svg.append(f'<svg x="{x(e["ts"])}" y="{y(e["tid"]) + 3}" width="{w}" height="{ROW - 6}"><title>{tip}</title>'
                   f'<rect width="100%" height="100%" rx="3" fill="{colour}"/>'
                   f'<text x="3" y="16" fill="white">{html.escape(e["name"])}</text></svg>')
    starts = {(e["id"]): e for e in events if e["ph"] == "s"}
    for e in events:
        if e["ph"] == "f" and e["id"] in starts:
            s = starts[e["id"]]
            x1, y1, x2, y2 = x(s["ts"]), y(s["tid"]) + ROW - 4, x(e["ts"]), y(e["tid"]) + 4
            svg.append(f'<path d="M{x1},{y1} C{x1},{y1 + 20} {x2},{y2 - 20} {x2},{y2}" fill="none" stroke="#444" '
                       f'stroke-width="1.2" marker-end="url(#arrow)"><title>event: record to wait</title></path>')
    findings = []
    for e in events:
        if e["ph"] == "i":
            message = html.escape(e["args"]["message"])
            cx, cy = x(e["ts"]), y(e["tid"]) + 4  # on the slice's top edge, clear of its name
            svg.append(f'<path d="M{cx},{cy - 7} L{cx + 6},{cy} L{cx},{cy + 7} L{cx - 6},{cy} z" fill="#e53935" '
                       f'stroke="white"><title>{html.escape(e["name"])}: {message}</title></path>')
            findings.append(f'<li><b>{html.escape(e["name"])}</b> ({html.escape(names[e["tid"]])}, tick '
                            f'{e["ts"] // TICK_US}): {message}</li>')
    svg.append("</svg>")
    other = timeline.get("otherData", {})
    legend = " ".join(f'<span style="background:{c};color:white;padding:1px 6px;border-radius:3px">{k}</span>'
                      for k, c in COLOURS.items())
    return "\n".join([
        "<!DOCTYPE html>", '<html><head><meta charset="utf-8">', f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:16px}.chart{overflow-x:auto;border:1px solid #ddd}"
        "li{margin:4px 0;font-size:13px}</style></head><body>",
        f"<h2>{html.escape(title)}</h2>",
        f"<p>{html.escape(str(other.get('clock', '')))}. Slices sit where they <i>ran</i>; hover one for its "
        "label, which host op queued it and when. Arrows: an event record to the wait on it. "
        "Red diamonds: findings. The JSON beside this page opens in ui.perfetto.dev (Open trace file).</p>",
        f"<p>{legend}</p>", f"<ul>{''.join(findings) or '<li>no finding</li>'}</ul>",
        f'<div class="chart">{"".join(svg)}</div>', "</body></html>", "",
    ])


# -- files -----------------------------------------------------------------------------------

def default_paths(trace_path: Path) -> tuple[Path, Path]:
    """``timelines/<stem>.json`` and ``timelines/<stem>.html`` beside the trace: in their own folder,
    so that ``*.json`` in a repro directory still lists its traces and nothing else."""
    folder = trace_path.parent / "timelines"
    return folder / f"{trace_path.stem}.json", folder / f"{trace_path.stem}.html"


def write_timeline(trace_path: Path, json_path: Path | None = None, html_path: Path | None = None) -> tuple[Path, Path]:
    """Replay ``trace_path`` on the simulator and write its timeline JSON and HTML (default:
    :func:`default_paths`); returns both paths. A trace that cannot be read raises
    :class:`fuzz.trace.TraceError`."""
    default_json, default_html = default_paths(Path(trace_path))
    timeline = build_timeline(load_trace(Path(trace_path)))
    json_path = write_json_atomically(json_path or default_json, timeline, default=str)
    html_path = write_text_atomically(html_path or default_html, render_html(timeline))
    return json_path, html_path
