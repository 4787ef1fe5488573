"""Distinct bugs, not campaigns: the run's registry of shrunk bugs (fuzz/engine/known_bugs.py), the
grouping of campaign records into bugs (fuzz/engine/bugs.py), and how the summary, JUnit, Markdown
and merge report them.

A campaign that meets a bug another campaign of the run has already shrunk stops at that failing
example, unshrunk, and points at the other's trace; it is still a finding. The last test runs
``pytest fuzz -n 2`` for real: three campaigns of one race on two xdist workers and a zoo entry
make two bug blocks.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from fuzz.engine.bugs import distinct_bugs, same_bug_message
from fuzz.engine.campaigns import PROFILES, Campaign, run_campaign
from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.known_bugs import KnownBug, KnownBugs, SameBug
from fuzz.engine.oracle import Finding
from fuzz.engine.signature import violation_signature
from fuzz.engine.summary import render_summary, result_record
from fuzz.engine.violation import ZeroerViolation
from fuzz.merge import merge, unexpected_traces
from fuzz.plugin import BUGS_KEY, _bug_registry, pytest_configure_node
from fuzz.reports import junit_xml, markdown

ROOT = Path(__file__).resolve().parents[1]


def single_buffer(geometry: str = "tiny", shard: int = 0, zeroers: int = 1, expect: str = "finds") -> Campaign:
    return Campaign(EpisodeConfig(zeroer="single_buffer", geometry=geometry, kernel="torch", zeroers=zeroers), shard, expect)


def run(campaign: Campaign, tmp_path: Path, registry: Path):
    return run_campaign(campaign, PROFILES["quick"], tmp_path / "traces", known_bugs=KnownBugs(registry, campaign.id))


# -- the registry in a run ------------------------------------------------------------------------


def test_a_campaign_that_meets_a_bug_another_shrank_stops_at_its_first_failing_example(tmp_path):
    registry = tmp_path / "bugs"
    registry.mkdir()
    owner = run(single_buffer(), tmp_path, registry)
    assert owner.same_as is None and owner.trace_path.exists()
    assert owner.examples > owner.first_finding_examples  # it shrank: Hypothesis ran examples after the first failure
    assert len(list(registry.glob("*.json"))) >= 1

    for campaign in (single_buffer("mixed_dtypes", shard=1), single_buffer(zeroers=2)):
        duplicate = run(campaign, tmp_path, registry)
        assert duplicate.found and duplicate.same_as is not None
        assert duplicate.same_as.campaign == owner.campaign.id and duplicate.same_as.trace == str(owner.trace_path)
        # Stopped at its first failing example: no example after it, nothing shrunk, no trace of its own.
        assert duplicate.examples == duplicate.first_finding_examples
        assert duplicate.trace_path is None and duplicate.shrunk_by_hypothesis is None
        record, mine = result_record(duplicate), result_record(owner)
        assert record["same_as"] == owner.campaign.id and record["signature"] == mine["signature"]
        assert record["trace"] == mine["trace"] and record["trace_ops"] == mine["trace_ops"]


def test_without_the_owners_trace_on_disk_a_campaign_shrinks_the_bug_itself(tmp_path):
    """Ctrl-C or a killed worker may leave an entry whose trace is gone: "same as" is never
    claimed without the trace that shows the bug."""
    registry = tmp_path / "bugs"
    registry.mkdir()
    owner = run(single_buffer(), tmp_path, registry)
    owner.trace_path.unlink()
    again = run(single_buffer(shard=1), tmp_path, registry)
    assert again.found and again.same_as is None and again.trace_path.exists()
    assert again.examples > again.first_finding_examples


def violation(message: str = "hazard at step 3: host write to pinned host buffer 1 by single_buffer.zero_block_ids#3([2]) "
                             "while copy#3 on stream 'main' (single_buffer.zero_block_ids#2([1])) may not have read it yet",
              ops: int = 3) -> ZeroerViolation:
    config = EpisodeConfig(zeroer="single_buffer")
    return ZeroerViolation([Finding("hazard", None, message)], [{"op": "start"}] * ops, config)


def test_the_first_campaign_to_register_a_bug_stays_its_owner_and_entries_are_written_whole(tmp_path):
    registry = tmp_path / "bugs"
    registry.mkdir()
    traces = {name: tmp_path / f"{name}.json" for name in ("a", "b")}
    for path in traces.values():
        path.write_text(json.dumps({"ops": []}))
    first, second = KnownBugs(registry, "a"), KnownBugs(registry, "b")
    first.register(violation(), traces["a"])
    second.register(violation(), traces["b"])
    assert [p.name for p in registry.iterdir()] == [f"{violation_signature(violation()).key}.json"]  # no temp files
    with pytest.raises(SameBug) as stopped:
        second.check(violation(ops=9))
    assert stopped.value.known.campaign == "a" and stopped.value.violation.trace == [{"op": "start"}] * 9
    first.check(violation())  # its own bug: a campaign never stops at itself
    traces["a"].write_text("{ half a fi")  # a trace that cannot be read shows nothing: no claim
    second.check(violation())


def test_a_bug_is_registered_under_its_first_failing_example_and_its_shrunk_trace(tmp_path):
    """Hypothesis may shrink one finding into another (zoo.deferred_zero: a hazard first, a zero
    that never came once shrunk); a campaign meeting either has met this bug."""
    registry, trace = tmp_path / "bugs", tmp_path / "trace.json"
    registry.mkdir()
    trace.write_text(json.dumps({"ops": []}))
    hazard = violation()
    shrunk = ZeroerViolation([Finding("non-zero after zeroing", 1, "non-zero after zeroing: block 1, segment 0, word 0 "
                                      "(32 of 32 words differ) at the end of the episode: expected 0 (zeroed), observed "
                                      "0xffffffff (NaN poison: stale bytes never zeroed). History: ...")],
                             [{"op": "start"}] * 2, hazard.config)
    owner = KnownBugs(registry, "a")
    with pytest.raises(ZeroerViolation):  # what the machine does: check, then raise the finding
        owner.check(hazard)
        raise hazard
    owner.register(shrunk, trace)
    assert len(list(registry.glob("*.json"))) == 2
    for met in (hazard, shrunk):
        with pytest.raises(SameBug, match="^same bug as a$"):
            KnownBugs(registry, "b").check(met)


def test_a_registry_this_process_cannot_see_turns_the_sharing_off(tmp_path):
    assert KnownBugs.at(None, "a") is None and KnownBugs.at(tmp_path / "missing", "a") is None
    assert KnownBugs.at(tmp_path, "a") is not None


def test_the_controller_makes_one_registry_per_run_and_hands_it_to_each_worker(tmp_path):
    controller = SimpleNamespace(cleanups=[])
    controller.add_cleanup = controller.cleanups.append
    directory = _bug_registry(controller)
    assert Path(directory).is_dir() and Path(directory).name.startswith("kvzero-fuzz-bugs-")
    node = SimpleNamespace(config=SimpleNamespace(_fuzz_bugs=directory), workerinput={})
    pytest_configure_node(node)
    assert node.workerinput == {BUGS_KEY: directory}
    assert _bug_registry(SimpleNamespace(workerinput=node.workerinput)) == directory  # in the worker
    for cleanup in controller.cleanups:  # the end of the run
        cleanup()
    assert not Path(directory).exists()


def test_a_campaign_stopped_at_a_known_bug_fails_with_one_line():
    known = KnownBug("sig", "single_buffer-tiny-sim-k-torch-shard0", "repro/failures/t.json", 3, "/abs/t.json")
    assert re.fullmatch(r"same bug as single_buffer-tiny-sim-k-torch-shard0, not shrunk again here: see that "
                        r"campaign's failure and the fuzz summary's bug block; trace: repro/failures/t\.json",
                        known.message())
    assert known.message() == same_bug_message(known.campaign, known.trace)


# -- grouping and reports ---------------------------------------------------------------------------


def record(campaign: str, signature: str | None = "hazard | z | a race", *, same_as: str | None = None,
           expect: str = "clean", geometry: str = "tiny", trace_ops: int = 3, found: bool = True) -> dict:
    trace = f"repro/failures/{(same_as or campaign)}.json" if found else None
    return {"campaign": campaign, "expect": expect, "zeroer": "z", "geometry": geometry, "backend": "sim",
            "mode": "controlled", "examples": 5, "steps": 50, "runs": 1, "seconds": 1.0, "seeds": [1],
            "first_finding_s": 0.1, "first_finding_examples": 5, "found": found, "found_in_phase": "generate",
            "reproduced": True, "trace": trace, "trace_ops": trace_ops if found else None,
            "findings": [f"finding of {campaign}"] if found else [], "signature": signature if found else None,
            "same_as": same_as}


def summary_of(records: list[dict], profile: str = "quick") -> dict:
    return {"totals": {"profile": profile}, "campaigns": records, "crashed": [], "not_run": []}


RECORDS = [
    record("z-tiny-sim-shard0"),
    record("z-tiny-sim-shard1", same_as="z-tiny-sim-shard0"),
    record("z-ratio2-sim-shard0", same_as="z-tiny-sim-shard0", geometry="ratio2"),
    record("z-ratio2-sim-shard1", "hazard | z | another race", geometry="ratio2"),
    record("z-tiny-sim-x2-shard0", found=False),
]


def test_campaigns_group_into_one_bug_per_signature_and_same_as():
    bugs = distinct_bugs(RECORDS)
    assert [b["campaigns"] for b in bugs] == [
        ["z-ratio2-sim-shard0", "z-tiny-sim-shard0", "z-tiny-sim-shard1"], ["z-ratio2-sim-shard1"]]
    first = bugs[0]
    assert first["shrunk_by"] == "z-tiny-sim-shard0" and first["trace"] == "repro/failures/z-tiny-sim-shard0.json"
    assert first["not_shrunk"] == ["z-ratio2-sim-shard0", "z-tiny-sim-shard1"] and first["geometries"] == ["ratio2", "tiny"]
    assert first["finding"] == "finding of z-tiny-sim-shard0" and first["unexpected"]


def test_shards_that_each_shrank_one_bug_merge_into_one_bug_with_both_traces():
    shard_a = summary_of([record("z-tiny-sim-shard0", trace_ops=4)], "nightly")
    shard_b = summary_of([record("z-tiny-sim-shard1", trace_ops=3)], "nightly")
    _, merged, _ = merge([("a", shard_a), ("b", shard_b)])
    (bug,) = merged["bugs"]
    assert bug["shrunk_by"] == "z-tiny-sim-shard1"  # the shorter trace
    assert [t["campaign"] for t in bug["traces"]] == ["z-tiny-sim-shard1", "z-tiny-sim-shard0"]
    assert merged["totals"]["bugs"] == 1 and merged["totals"]["findings"] == 2 and merged["totals"]["unexpected"] == 2


def test_a_record_without_a_signature_or_whose_owner_is_missing_is_a_bug_of_its_own():
    old = record("z-tiny-sim-shard0", signature=None)
    orphan = record("z-tiny-sim-shard1", same_as="z-gone-sim-shard0")
    bugs = distinct_bugs([old, orphan, record("z-ratio2-sim-shard0", signature=None)])
    assert sorted(b["campaigns"] for b in bugs) == [["z-ratio2-sim-shard0"], ["z-tiny-sim-shard0"], ["z-tiny-sim-shard1"]]
    (gone,) = [b for b in bugs if b["campaigns"] == ["z-tiny-sim-shard1"]]
    assert gone["shrunk_by"] == "z-gone-sim-shard0" and gone["trace"] == "repro/failures/z-gone-sim-shard0.json"


def test_a_signature_that_reads_like_a_campaign_id_is_still_a_signature():
    # Groups were once keyed by text ("campaign <id>" for a record without a signature).
    bugs = distinct_bugs([record("z-tiny-sim-shard0", "campaign z-tiny-sim-shard0"), record("z-tiny-sim-shard1", None)])
    by_campaign = {b["campaigns"][0]: b for b in bugs}
    assert by_campaign["z-tiny-sim-shard0"]["signature"] == "campaign z-tiny-sim-shard0"
    assert by_campaign["z-tiny-sim-shard0"]["id"] is not None and by_campaign["z-tiny-sim-shard1"]["signature"] is None


def test_the_summary_prints_one_block_per_bug():
    text, data = render_summary(RECORDS, "quick")
    lines = text.splitlines()
    assert lines[0] == ("profile quick: 5 campaigns, 25 examples, 250 steps, 4 with findings (2 distinct bugs), "
                        "4 unexpected")
    assert lines[1:] == [
        "  bug 1 of 2: VIOLATION in 3 campaigns on ratio2, tiny (sim): finding of z-tiny-sim-shard0",
        "    z-tiny-sim-shard0: VIOLATION after 0.1 s, 3 ops -> repro/failures/z-tiny-sim-shard0.json",
        "    same bug, not shrunk again: z-ratio2-sim-shard0, z-tiny-sim-shard1 (trace of z-tiny-sim-shard0: "
        "repro/failures/z-tiny-sim-shard0.json)",
        "  bug 2 of 2: VIOLATION in 1 campaign on ratio2 (sim): finding of z-ratio2-sim-shard1",
        "    z-ratio2-sim-shard1: VIOLATION after 0.1 s, 3 ops -> repro/failures/z-ratio2-sim-shard1.json",
    ]
    assert data["totals"]["bugs"] == 2
    assert [b["campaigns"][0] for b in data["bugs"]] == ["z-ratio2-sim-shard0", "z-ratio2-sim-shard1"]


def test_junit_and_markdown_report_a_bug_once_and_its_other_campaigns_in_one_line():
    _, summary, sources = merge([("run", summary_of(RECORDS))])
    root = ET.fromstring(junit_xml(summary, sources))
    failures = {case.get("name"): case.find("failure") for case in root.iter("testcase") if case.find("failure") is not None}
    one_line = same_bug_message("z-tiny-sim-shard0", "repro/failures/z-tiny-sim-shard0.json")
    assert failures["z-tiny-sim-shard1"].get("message") == one_line
    assert failures["z-tiny-sim-shard1"].text == failures["z-tiny-sim-shard1"].get("message")
    assert failures["z-tiny-sim-shard0"].text.endswith(
        "the same bug in 2 other campaigns (on ratio2, tiny): z-ratio2-sim-shard0, z-tiny-sim-shard1")
    text = markdown(summary)
    needs_a_look = text.split("**Needs a look**")[1].split("<details>")[0]
    assert needs_a_look.count("| VIOLATION |") == 2  # two bugs, four campaigns
    assert ("| `z-tiny-sim-shard0`, `z-ratio2-sim-shard0`, `z-tiny-sim-shard1` | VIOLATION | "
            "finding of z-tiny-sim-shard0") in text
    assert "<summary>2 distinct bugs</summary>" in text
    assert unexpected_traces(summary) == ["repro/failures/z-tiny-sim-shard0.json", "repro/failures/z-ratio2-sim-shard1.json"]


# -- a real run on two xdist workers --------------------------------------------------------------


# Loaded into the run below (and so into each xdist worker): when each campaign ran, by the clock
# every process of the machine shares, one JSON line per campaign in a file per worker.
CALL_TIMES_PLUGIN = """
import json, os, time
import pytest

@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    start = time.monotonic()
    try:
        return (yield)
    finally:
        line = {"campaign": item.callspec.id, "start": start, "stop": time.monotonic()}
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(os.environ["KVZERO_CALL_TIMES"], worker + ".jsonl"), "a") as out:
            out.write(json.dumps(line) + "\\n")
"""


def test_a_run_on_two_workers_reports_one_block_per_bug_and_does_not_shrink_a_bug_twice(tmp_path):
    """Three self-checks of the single_buffer race (two geometries, two shards) and the zoo's
    side_stream on ``-n 2``: one report per distinct bug, and no campaign shrinks a bug that
    another campaign of the run had already shrunk, whichever worker either ran on.

    Which worker runs which campaign is xdist's choice, so nothing here depends on it. What is
    checked is the rule itself (docs/fuzzing.md, "One bug, many campaigns"), from when each
    campaign ran: a race campaign that started after another one had ended (on either worker; a
    bug is registered before its campaign ends) stopped at its first failing example, unshrunk,
    and points at the trace of one that shrank; two campaigns shrank the bug only if they ran side
    by side. Three race campaigns on two workers means two of them ran one after the other on one
    worker, so the rule is exercised in every schedule, and across workers whenever xdist
    happens to spread them out.
    """
    selection = "single_buffer-mixed_dtypes-sim-k-torch-shard0 or single_buffer-tiny-sim-k-torch-shard or zoo.side_stream"
    plugins, times_dir = tmp_path / "plugins", tmp_path / "times"
    plugins.mkdir()
    times_dir.mkdir()
    (plugins / "kvzero_call_times.py").write_text(CALL_TIMES_PLUGIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(plugins), env.get("PYTHONPATH", "")])
    env["KVZERO_CALL_TIMES"] = str(times_dir)
    done = subprocess.run([sys.executable, "-m", "pytest", "fuzz", "-p", "no:cacheprovider", "-p", "kvzero_call_times",
                           "-n", "2", "-v", "--backend", "sim", "-k", selection, "--repro-dir", str(tmp_path / "traces"),
                           "--fuzz-summary", str(tmp_path / "summary.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    race = ["single_buffer-mixed_dtypes-sim-k-torch-shard0", "single_buffer-tiny-sim-k-torch-shard0",
            "single_buffer-tiny-sim-k-torch-shard1"]
    zoo = "zoo.side_stream-tiny-sim-shard0"

    # One report per distinct bug: the three race campaigns in one block, the zoo entry in another.
    summary = json.loads((tmp_path / "summary.json").read_text())
    bugs = summary["bugs"]
    assert [b["campaigns"] for b in bugs] == [race, [zoo]]
    assert bugs[0]["geometries"] == ["mixed_dtypes", "tiny"] and summary["totals"]["bugs"] == 2
    assert "bug 1 of 2: found (expected) in 3 campaigns on mixed_dtypes, tiny (sim): hazard at step" in done.stdout

    records = {r["campaign"]: r for r in summary["campaigns"]}
    ran = {line["campaign"]: (line["start"], line["stop"])
           for path in times_dir.glob("*.jsonl") for line in map(json.loads, path.read_text().splitlines())}
    assert set(race) <= set(ran), ran

    def after_another(campaign: str) -> bool:
        """Whether ``campaign`` started after another race campaign had ended (and registered the bug)."""
        return any(ran[other][1] < ran[campaign][0] for other in race if other != campaign)

    assert any(after_another(c) for c in race), ran  # two of three on one of two workers: one after the other
    shrunk = [c for c in race if records[c]["same_as"] is None]
    assert shrunk, summary["campaigns"]  # somebody shrank it
    for campaign in race:
        if after_another(campaign):  # the bug was known when it began: it stops at its first failing example
            record = records[campaign]
            assert record["same_as"] and record["examples"] == record["first_finding_examples"], (campaign, ran, record)
    for one, other in itertools.combinations(shrunk, 2):  # a second shrink only side by side
        assert ran[one][0] < ran[other][1] and ran[other][0] < ran[one][1], (one, other, ran)

    for campaign in race:
        duplicate = records[campaign]
        if duplicate["same_as"] is None:
            continue
        # No trace of its own: it points at the shrunk one.
        assert duplicate["shrink"] is None and duplicate["same_as"] in shrunk
        owner = records[duplicate["same_as"]]
        assert duplicate["trace"] == owner["trace"] and Path(owner["trace"]).exists()
        assert duplicate["signature"] == owner["signature"]
        progress = f"{campaign}: found (expected) (same bug as {owner['campaign']}: not shrunk again)"
        assert progress in done.stdout
    # The traces on disk are the shrinking campaigns' and the zoo entry's, no others (a dot file
    # would be an in-flight journal, fuzz.engine.journal, not a trace).
    written = {str(p) for p in (tmp_path / "traces").glob("*.json") if not p.name.startswith(".")}
    assert written == {records[c]["trace"] for c in [*shrunk, zoo]}, (written, summary["campaigns"])
