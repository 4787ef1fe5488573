"""``python -m repro timeline``: a trace replayed on the simulator becomes trace-event JSON with a
host track and one track per stream, flows from event records to their waits and the findings
marked, plus a self-contained HTML page; and the queue observer it is built on."""

from __future__ import annotations

import html
import importlib.metadata
import json
import re
import shutil
from pathlib import Path

import pytest

from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.oracle import Finding
from fuzz.engine.trace import write_trace
from fuzz.trace import load_trace
from repro.__main__ import main
from fuzz.timeline import HOST_TID, TICK_US, build_timeline, host_op_name, render_html, stream_tid, write_timeline
from kvdevice.runtime.queues import QueuedOp, StreamQueues

CASES = Path(__file__).resolve().parent.parent / "repro" / "cases"
STREAMS = {HOST_TID: "host", 2: "stream 0 'main'", 3: "stream 1 's1'", 4: "stream 2 's2'"}
MULTI = [  # a race-free design across three streams: waits, a delay, a free, syncs
    {"op": "start", "in_flight": 2}, {"op": "allocate", "n": 2, "stream": 0},
    {"op": "write", "block": 1, "stream": 1}, {"op": "read", "block": 1, "stream": 2},
    {"op": "advance", "stream": 2, "ops": 2}, {"op": "advance", "stream": 0, "ops": 4},
    {"op": "delay", "stream": 1, "amount": 2}, {"op": "end_step"}, {"op": "free", "block": 2},
    {"op": "sync_stream", "stream": 1}, {"op": "sync_device"},
]
MULTI_NAMES = [
    "start(in_flight=2)", "allocate_blocks(n=2, stream=0)", "write_block(block=1, stream=1)",
    "read_block(block=1, stream=2)", "advance_stream(stream=2, ops=2)", "advance_stream(stream=0, ops=4)",
    "delay_stream(stream=1, amount=2)", "end_step()", "free_block(block=2)", "synchronize_stream(stream=1)",
    "synchronize_device()", "teardown()",
]


def tracks(timeline: dict) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in timeline["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}


def slices(timeline: dict, tid: int | None = None) -> list[dict]:
    return [e for e in timeline["traceEvents"] if e["ph"] == "X" and tid in (None, e["tid"])]


def enclosing(timeline: dict, tid: int, ts: int) -> dict:
    (found,) = [s for s in slices(timeline, tid) if s["ts"] <= ts < s["ts"] + s["dur"]]
    return found


def instants(timeline: dict) -> list[dict]:
    return [e for e in timeline["traceEvents"] if e["ph"] == "i"]


def assert_well_formed(timeline: dict) -> None:
    """Host slices follow one another, no two slices of a track overlap, every flow start has
    one end, from an event record to a wait on it."""
    host = slices(timeline, HOST_TID)
    assert host[0]["ts"] == 0 and all(a["ts"] + a["dur"] == b["ts"] for a, b in zip(host, host[1:]))
    for tid in tracks(timeline):
        spans = sorted((s["ts"], s["ts"] + s["dur"]) for s in slices(timeline, tid))
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), tracks(timeline)[tid]
    starts = {e["id"]: e for e in timeline["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"]: e for e in timeline["traceEvents"] if e["ph"] == "f"}
    assert starts.keys() == ends.keys()
    for flow, start in starts.items():
        record, wait = enclosing(timeline, start["tid"], start["ts"]), enclosing(timeline, ends[flow]["tid"], ends[flow]["ts"])
        assert (record["cat"], wait["cat"]) == ("record", "wait") and record["ts"] < wait["ts"]


@pytest.fixture(scope="module")
def curated() -> dict:
    return build_timeline(load_trace(CASES / "single_buffer_pre_48085.json"))


@pytest.fixture(scope="module")
def multi(tmp_path_factory) -> dict:
    path = write_trace(tmp_path_factory.mktemp("multi"), EpisodeConfig(zeroer="per_call"), MULTI, [], seed=1)
    return build_timeline(load_trace(path))


def test_the_curated_race_has_a_host_track_and_one_per_stream(curated):
    assert tracks(curated) == STREAMS
    names = [s["name"] for s in slices(curated, HOST_TID)]
    assert names == ["start(in_flight=1)", "allocate_blocks(n=1, stream=0)", "allocate_blocks(n=1, stream=0)", "teardown()"]
    assert_well_formed(curated)


def test_the_curated_race_shows_the_copy_running_after_the_host_rewrote_its_buffer(curated):
    device = {s["name"]: s for s in slices(curated, stream_tid(0))}
    for s in device.values():  # named by their label, less the stream the track already names
        assert s["name"] == s["args"]["label"].replace(" on stream 'main'", "")
    copy = device["copy#3 (single_buffer.zero_block_ids#2([1]))"]
    assert copy["cat"] == "copy" and copy["args"]["queued by"] == "op 1: allocate_blocks(n=1, stream=0)"
    rewrite = slices(curated, HOST_TID)[2]  # the third op stages block 2 in the same buffer
    assert copy["ts"] >= rewrite["ts"] + rewrite["dur"]
    assert "zero_kernel#4 (single_buffer.zero_block_ids#2([1]))" in device


def test_the_recorded_finding_is_marked_on_the_host_op_where_it_fired(curated):
    (recorded,) = load_trace(CASES / "single_buffer_pre_48085.json").findings
    (mark,) = [i for i in instants(curated) if i["args"]["message"] == recorded["message"]]
    assert mark["name"] == "finding: hazard" and mark["tid"] == HOST_TID
    assert mark["args"]["recorded in the trace"] and mark["args"]["found by this replay"]
    assert enclosing(curated, HOST_TID, mark["ts"]) is slices(curated, HOST_TID)[2]  # "hazard at step 3"


def test_a_finding_is_placed_by_the_step_it_records_never_by_its_text(tmp_path):
    # The text names step 1 and a read on stream 1; the place recorded says step 2. A finding whose
    # text looks placed but which records no place (and which this replay did not find) goes to the
    # teardown: messages are for people, and a zeroer's own label may say anything.
    findings = [Finding("hazard", None, "hazard at step 1: said by the text", step=2),
                Finding("clobbered", 1, "clobbered: at step 2 read_block on stream 1")]
    timeline = build_timeline(load_trace(write_trace(tmp_path, EpisodeConfig(zeroer="per_call"), MULTI[:4], findings, seed=1)))
    marks = {i["args"]["message"]: i for i in instants(timeline)}
    host = slices(timeline, HOST_TID)
    placed, unplaced = marks[findings[0].message], marks[findings[1].message]
    assert placed["tid"] == HOST_TID and enclosing(timeline, HOST_TID, placed["ts"]) is host[1]
    assert placed["args"]["step"] == 2
    assert unplaced["tid"] == HOST_TID and enclosing(timeline, HOST_TID, unplaced["ts"]) is host[-1]


def test_a_multi_stream_trace_has_a_slice_per_op_and_a_flow_per_wait(multi):
    assert tracks(multi) == STREAMS
    assert [s["name"] for s in slices(multi, HOST_TID)] == MULTI_NAMES
    assert_well_formed(multi)
    waits = [s for s in slices(multi) if s["cat"] == "wait"]
    flows = [e for e in multi["traceEvents"] if e["ph"] == "f"]
    assert len(waits) == len(flows) >= 2 and {s["tid"] for s in waits} == {stream_tid(1), stream_tid(2)}
    assert "delay(2)#12" in [s["name"] for s in slices(multi, stream_tid(1))]
    # sync_device ran the queued read on stream 2: its slice lies inside that host op's
    sync = slices(multi, HOST_TID)[-2]
    read = next(s for s in slices(multi, stream_tid(2)) if s["name"].startswith("read#"))
    assert sync["ts"] <= read["ts"] < sync["ts"] + sync["dur"]
    assert instants(multi) == []  # per_call is race-free


def test_a_zeroers_own_stream_gets_a_track_and_a_bad_read_is_marked_on_its_stream(tmp_path):
    ops = [{"op": "start", "in_flight": 1}, {"op": "allocate", "n": 1, "stream": 0}, {"op": "read", "block": 1, "stream": 1}]
    timeline = build_timeline(load_trace(write_trace(tmp_path, EpisodeConfig(zeroer="zoo.side_stream"), ops, [], seed=1)))
    assert tracks(timeline) == {**STREAMS, 5: "stream 3 'zoo.side_stream side'"}
    assert_well_formed(timeline)
    marks = {i["args"]["message"].split(":")[0]: i for i in instants(timeline)}
    assert marks["hazard at step 3"]["tid"] == HOST_TID
    bad_read = next(i for i in instants(timeline) if "at step 3 read_block on stream 1" in i["args"]["message"])
    assert bad_read["tid"] == stream_tid(1) and not bad_read["args"]["recorded in the trace"]
    assert enclosing(timeline, stream_tid(1), bad_read["ts"])["name"].startswith("read#")


def test_an_op_the_program_cannot_run_stops_the_replay_and_is_marked_where_it_stopped(tmp_path):
    ops = [{"op": "start", "in_flight": 1}, {"op": "allocate", "n": 1, "stream": 0}, {"op": "write", "block": 5, "stream": 1}]
    timeline = build_timeline(load_trace(write_trace(tmp_path, EpisodeConfig(zeroer="per_call"), ops, [], seed=1)))
    host = slices(timeline, HOST_TID)
    assert [s["name"] for s in host] == ["start(in_flight=1)", "allocate_blocks(n=1, stream=0)", "write_block(block=5, stream=1)", "teardown()"]
    (mark,) = instants(timeline)
    assert mark["args"]["message"] == "replay stopped at op 2 (write_block(block=5, stream=1)): ValueError: write block 5: it is free, not live"
    assert enclosing(timeline, HOST_TID, mark["ts"]) is host[2]
    assert timeline["otherData"]["stopped"] == mark["args"]["message"]
    assert_well_formed(timeline)  # what was still queued ran inside the teardown


def test_host_ops_are_named_like_the_fuzzers_program():
    assert host_op_name({"op": "allocate", "n": 2}) == "allocate_blocks(n=2, stream=0)"
    assert host_op_name({"op": "allocate", "n": 2, "stream": 1, "cache": 1, "ids_as": "tensor"}) == \
        "allocate_blocks_handed(n=2, stream=1, cache=1, ids_as='tensor')"
    assert host_op_name({"op": "write", "block": 3, "stream": 1, "cache": 0}) == "write_block(block=3, stream=1)"
    assert host_op_name({"op": "sync_device"}) == "synchronize_device()"


def test_the_html_page_is_self_contained_and_holds_every_slice_and_finding(curated):
    page = render_html(curated)
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    for s in slices(curated):
        assert html.escape(s["name"]) in page
    for mark in instants(curated):
        assert html.escape(mark["args"]["message"]) in page


def test_the_cli_writes_both_files_in_a_timelines_folder_beside_the_trace_by_default(tmp_path, capsys):
    trace = tmp_path / "ring_overrun.json"
    shutil.copy(CASES / "ring_overrun.json", trace)
    assert main(["timeline", str(trace)]) == 0
    out = capsys.readouterr().out
    json_path, html_path = tmp_path / "timelines" / "ring_overrun.json", tmp_path / "timelines" / "ring_overrun.html"
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["ring_overrun.json"]  # traces only
    assert f"wrote {json_path}: open it at https://ui.perfetto.dev (\"Open trace file\")" in out and f"wrote {html_path}" in out
    timeline = json.loads(json_path.read_text())
    assert timeline["displayTimeUnit"] == "ms" and timeline["otherData"]["replayed on"] == "sim"
    assert "copy#3 (ring.zero_block_ids#2([1]) [slot 1])" in html_path.read_text()
    assert write_timeline(trace, tmp_path / "a.json", tmp_path / "b.html") == (tmp_path / "a.json", tmp_path / "b.html")


def test_a_bad_trace_path_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["timeline", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: {re.escape(str(tmp_path / 'nope.json'))}: no such file\n", err)


def test_the_queue_observer_hears_every_enqueue_and_run_in_order():
    heard = []
    q = StreamQueues(execute=lambda op: None, observers=[lambda what, stream, op: heard.append((what, stream, op.label))])
    a, b = q.add_stream("a"), q.add_stream("b")
    q.enqueue(a, QueuedOp("kernel", "k1"))
    pos = q.enqueue(a, QueuedOp("record", "e1"))
    q.enqueue(b, QueuedOp("wait", "w1", wait_for=(a, pos)))
    q.run_until(b, 1)
    assert heard == [("enqueued", 0, "k1"), ("enqueued", 0, "e1"), ("enqueued", 1, "w1"),
                     ("executed", 0, "k1"), ("executed", 0, "e1"), ("executed", 1, "w1")]


def test_the_queue_observer_hears_an_op_that_failed():
    heard = []

    def boom() -> None:
        raise RuntimeError("kernel fault")

    q = StreamQueues(execute=lambda op: op.action())
    q.observers.append(lambda what, stream, op: heard.append((what, op.label)))
    s = q.add_stream("s")
    q.enqueue(s, QueuedOp("kernel", "k1", action=boom))
    with pytest.raises(RuntimeError, match=r"^kernel fault$"):
        q.advance(s, 1)
    assert heard == [("enqueued", "k1"), ("failed", "k1")] and q.executed == [1]


@pytest.mark.parametrize("which", ["curated", "multi"])
def test_perfetto_reads_the_tracks_slices_and_flows(which, request, tmp_path):
    """Perfetto's own trace processor loads the JSON of the curated race and of a multi-stream
    trace (skipped where it cannot start: the ``perfetto`` package downloads its
    ``trace_processor_shell`` on first use; one on PATH is used instead)."""
    api = pytest.importorskip("perfetto.trace_processor", reason="pip install perfetto")
    timeline = request.getfixturevalue(which)
    version = importlib.metadata.version("perfetto")
    path = tmp_path / f"{which}.json"
    path.write_text(json.dumps(timeline))
    shell = shutil.which("trace_processor_shell") or shutil.which("trace_processor")
    try:
        tp = api.TraceProcessor(trace=str(path), config=api.TraceProcessorConfig(bin_path=shell))
    except Exception as error:  # noqa: BLE001 - offline: the binary cannot be fetched
        pytest.skip(f"perfetto {version}: trace_processor_shell cannot start here ({type(error).__name__}: {error}); "
                    f"put one on PATH to run this check offline")
    try:
        threads = {row.tid: row.name for row in tp.query("select tid, name from thread where tid is not null and tid > 0")}
        rows = list(tp.query(
            "select thread.tid as tid, slice.name as name, slice.dur as dur, slice.category as cat from slice "
            "join thread_track on slice.track_id = thread_track.id join thread using (utid) order by slice.ts"))
        flows = list(tp.query("select slice_out, slice_in from flow"))
    finally:
        tp.close()
    assert threads == tracks(timeline)
    host = sorted((s for s in slices(timeline, HOST_TID) if s["cat"] == "host"), key=lambda s: s["ts"])
    assert [r.name for r in rows if r.tid == HOST_TID and r.cat == "host"] == [s["name"] for s in host]
    if which == "multi":
        assert [s["name"] for s in host] == MULTI_NAMES
    device = [(r.tid, r.name, r.dur) for r in rows if r.tid != HOST_TID and r.cat != "finding"]
    assert device == [(s["tid"], s["name"], TICK_US * 1000) for s in sorted(slices(timeline), key=lambda s: s["ts"])
                      if s["tid"] != HOST_TID]
    # A thread-scoped instant is a slice of no length on its thread's track.
    findings = sorted((r.tid, r.name, r.dur) for r in rows if r.cat == "finding")
    assert findings == sorted((e["tid"], e["name"], 0) for e in instants(timeline))
    assert bool(findings) is (which == "curated")
    assert len(flows) == len([e for e in timeline["traceEvents"] if e["ph"] == "s"])
