"""Sharded runs and ``python -m fuzz.merge``: N shards cover every campaign exactly once, merging
their summaries gives an unsharded run's campaign list with the totals recomputed, the JUnit XML
has the structure test reporters read, the Markdown is one table row per campaign, bad input is
one line and exit 2, and the merge needs nothing but the standard library."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from fuzz.merge import main as merge_main
from fuzz.merge import merge, unexpected_traces, verdict
from fuzz.options import fuzz_options
from fuzz.plugin import _campaigns
from fuzz.reports import junit_xml, markdown

ROOT = Path(__file__).resolve().parents[1]
SHARDS = 3


def options_for(backend: str, shard: str | None):
    values = {
        "fuzz_backend": "sim", "cuda_mode": "both", "zeroer": None, "fuzz_profile": "quick", "fuzz_minutes": None,
        "repro_dir": "repro/failures", "fuzz_db": ".hypothesis/fuzz-db", "fuzz_summary": "repro/summary.json",
        "fuzz_journal": "auto", "hypothesis_seed": None, "fuzz_geometry": None, "fuzz_shard": shard,
        "fuzz_debug": False, "fuzz_shrink_seconds": None, "offloader": None, "host_memory": "both", "strict_caller": False,
    }
    options = fuzz_options(SimpleNamespace(getoption=lambda name, default=None: values[name]))
    return dataclasses.replace(options, backends=[backend])  # cuda's list is built without a GPU


@pytest.mark.parametrize("backend", ["sim", "cuda"])
@pytest.mark.parametrize("count", [2, SHARDS, 7])
def test_n_shards_cover_every_campaign_exactly_once(backend, count):
    everything = [c.id for c, _ in _campaigns(options_for(backend, None))]
    shards = [[c.id for c, _ in _campaigns(options_for(backend, f"{i}/{count}"))] for i in range(count)]
    assert sorted(sum(shards, [])) == sorted(everything)  # each once: no campaign in two shards, none left out
    assert all(shards) and max(map(len, shards)) - min(map(len, shards)) <= 1  # and evenly


# -- merging collected shards with fake results --------------------------------------------------


def start_pytest_fuzz(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", "pytest", "fuzz", "-p", "no:cacheprovider", "-p", "no:xdist",
                             "--backend", "sim", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def collected(process: subprocess.Popen) -> list[str]:
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    return re.findall(r"^fuzz/test_campaigns\.py::test_campaign\[(.+)\]$", output, re.MULTILINE)


def fake_record(campaign: str, violation: bool = False) -> dict:
    """A result as a campaign reports it: self-checks found their race, clean designs are clean
    unless ``violation``."""
    expect = "finds" if campaign.startswith(("ring-", "single_buffer-", "zoo.")) or "-fault-" in campaign else "clean"
    found = expect == "finds" or violation
    return {"campaign": campaign, "expect": expect, "zeroer": campaign.split("-")[0], "geometry": "tiny",
            "backend": "sim", "mode": "controlled", "examples": 10, "steps": 100, "runs": 1, "seconds": 1.5,
            "seeds": [7], "first_finding_s": 0.1 if found else None, "first_finding_examples": 3 if found else None,
            "found": found, "found_in_phase": "generate" if found else None, "reproduced": True,
            "trace": f"repro/failures/{campaign}.json" if found else None, "trace_ops": 3 if found else None,
            "findings": ["hazard at step 2: host write to pinned host buffer 1 | queued copy"] if found else []}


def shard_summary(records: list[dict], crashed=(), not_run=(), profile="nightly", partial=False) -> dict:
    return {"totals": {"profile": profile, "partial": partial, "campaigns": len(records)},
            "campaigns": records, "crashed": list(crashed), "not_run": list(not_run)}


def check_junit(text: str) -> ET.Element:
    """The JUnit structure test reporters read: testsuites > testsuite > testcase, each case with
    at most one of failure / error / skipped, counts that add up, unique names."""
    root = ET.fromstring(text)
    assert root.tag == "testsuites"
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    names = []
    for suite in root:
        assert suite.tag == "testsuite" and suite.get("name")
        cases = suite.findall("testcase")
        assert {child.tag for child in suite} <= {"properties", "testcase"}
        counts = dict.fromkeys(totals, 0)
        for case in cases:
            assert case.get("classname", "").startswith("fuzz.") and case.get("name")
            float(case.get("time"))
            outcomes = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            assert len(outcomes) <= 1
            assert all(child.tag in ("failure", "error", "skipped", "system-out") for child in case)
            for tag, key in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
                counts[key] += tag in outcomes
            counts["tests"] += 1
            names.append(case.get("name"))
        for key, value in counts.items():
            assert int(suite.get(key)) == value
            totals[key] += value
    assert {key: int(root.get(key)) for key in totals} == totals
    assert len(names) == len(set(names))
    return root


def test_merging_three_collected_shards_gives_the_campaign_list_of_an_unsharded_run(tmp_path):
    processes = [start_pytest_fuzz("--collect-only", "-q", "--fuzz-shard", f"{i}/{SHARDS}") for i in range(SHARDS)]
    unsharded = collected(start_pytest_fuzz("--collect-only", "-q"))
    shards = [collected(p) for p in processes]
    assert len(unsharded) > 50 and sorted(sum(shards, [])) == sorted(unsharded)

    # Fake results: shard 0 found a race in a clean design, shard 1 lost a worker, shard 2 was
    # interrupted before its last campaign.
    racy = next(c for c in shards[0] if fake_record(c)["expect"] == "clean")
    paths = []
    for i, ids in enumerate(shards):
        records = [fake_record(c, violation=(c == racy)) for c in ids[:-1]]
        crashed, not_run = ([ids[-1]], []) if i == 1 else ([], [ids[-1]]) if i == 2 else ([], [])
        if i == 0:
            records.append(fake_record(ids[-1]))
        paths.append(tmp_path / f"shard-{i}" / "summary.json")
        paths[-1].parent.mkdir()
        paths[-1].write_text(json.dumps(shard_summary(records, crashed, not_run, partial=(i == 2))))

    out = tmp_path / "merged"
    code = merge_main([*map(str, paths), "--json", str(out / "summary.json"), "--junit", str(out / "fuzz.xml"),
                       "--markdown", str(out / "fuzz.md"), "--unexpected-traces", str(out / "traces.txt")])
    assert code == 1  # an unexpected finding and a crash
    merged = json.loads((out / "summary.json").read_text())
    listed = [r["campaign"] for r in merged["campaigns"]] + merged["crashed"] + merged["not_run"]
    assert sorted(listed) == sorted(unsharded)
    assert merged["totals"] == {
        "profile": "nightly", "partial": True, "crashed": 1, "not_run": 1, "campaigns": len(unsharded) - 2,
        "examples": 10 * (len(unsharded) - 2), "steps": 100 * (len(unsharded) - 2),
        "seconds": round(1.5 * (len(unsharded) - 2), 3),
        "findings": 1 + sum(1 for r in merged["campaigns"] if r["expect"] == "finds"), "unexpected": 1,
        # records written before signatures: each finding is a bug of its own (fuzz.engine.bugs)
        "bugs": 1 + sum(1 for r in merged["campaigns"] if r["expect"] == "finds"),
        "resource_errors": 0, "harness_errors": 0,
    }
    assert (out / "traces.txt").read_text() == f"repro/failures/{racy}.json\n"

    root = check_junit((out / "fuzz.xml").read_text())
    assert [suite.get("name") for suite in root] == list(map(str, paths))  # one suite per shard
    assert int(root.get("tests")) == len(unsharded) and root.get("errors") == "1" and root.get("skipped") == "1"
    assert root.get("failures") == "1"
    case = root.find(f".//testcase[@name='{racy}']")
    assert case.find("failure").get("type") == "finding"
    assert f"replay: python -m repro replay repro/failures/{racy}.json" in case.find("failure").text

    report = (out / "fuzz.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| (?:clean|finds|) \|", report, re.MULTILINE)
    assert sorted(rows) == sorted(unsharded)
    assert "host write to pinned host buffer 1 \\| queued copy" in report  # a pipe in a finding stays in its cell


def test_a_campaign_in_two_summaries_is_an_input_error(tmp_path, capsys):
    one, two = tmp_path / "a.json", tmp_path / "b.json"
    one.write_text(json.dumps(shard_summary([fake_record("per_call-tiny-sim-k-torch-shard0")])))
    two.write_text(json.dumps(shard_summary([], crashed=["per_call-tiny-sim-k-torch-shard0"])))
    assert merge_main([str(one), str(two)]) == 2
    assert capsys.readouterr().err == (
        f"error: campaign 'per_call-tiny-sim-k-torch-shard0' is in {one} and in {two}: a campaign belongs to one "
        f"shard (shards of different --fuzz-shard i/N, or one summary given twice?)\n")


@pytest.mark.parametrize(("content", "message"), [
    (None, r"^error: {path}: cannot read it \(No such file or directory\)$"),
    ("{", r"^error: {path}: not JSON \(.*\)$"),
    ('{"campaigns": []}', r"^error: {path}: not a fuzz summary \(expected totals, campaigns, crashed and not_run, "
                          r"as pytest fuzz --fuzz-summary writes\)$"),
    ('{"totals": {"profile": "ci"}, "campaigns": [{"campaign": "x"}], "crashed": [], "not_run": []}',
     r"^error: {path}: a campaign record lacks expect, found, examples, steps, seconds$"),
])
def test_a_file_that_is_not_a_summary_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "summary.json"
    if content is not None:
        path.write_text(content)
    assert merge_main([str(path)]) == 2
    assert re.match(message.format(path=re.escape(str(path))), capsys.readouterr().err.rstrip("\n"))


def test_summaries_of_different_profiles_do_not_merge():
    with pytest.raises(ValueError, match=r"^the summaries ran different profiles \(ci in a, nightly in b\); "
                                         r"merge the shards of one run$"):
        merge([("a", shard_summary([], profile="ci")), ("b", shard_summary([], profile="nightly"))])


def test_a_clean_merge_exits_0_and_says_so_in_markdown():
    text, merged, sources = merge([("a", shard_summary([fake_record("per_call-tiny-sim-k-torch-shard0")])),
                                   ("b", shard_summary([fake_record("ring-tiny-sim-k-torch-shard0")]))])
    assert merged["totals"]["unexpected"] == 0 and merged["totals"]["findings"] == 1
    assert "Every design came out clean and every self-check found its race." in markdown(merged)
    root = check_junit(junit_xml(merged, sources))
    assert root.get("failures") == "0" and "found: examples 10" in root.find(".//testcase[@name='ring-tiny-sim-k-torch-shard0']/system-out").text


def test_a_missed_self_check_is_a_junit_failure_and_a_row_to_look_at():
    missed = {**fake_record("ring-tiny-sim-k-torch-shard0"), "found": False}
    _, merged, sources = merge([("a", shard_summary([missed]))])
    failure = check_junit(junit_xml(merged, sources)).find(".//failure")
    assert (failure.get("type"), failure.get("message")) == (
        "missed self-check", "the fuzzer missed the known race of 'ring' in 10 examples (seed 7): the self-check failed")
    assert "| `ring-tiny-sim-k-torch-shard0` | MISSED | the fuzzer missed the known race of 'ring'" in markdown(merged)


def test_a_resource_error_is_a_junit_error_and_a_row_to_look_at_never_a_verdict():
    """As in the run's own summary: a campaign the GPU ran out of memory for was not judged."""
    starved = {**fake_record("ring-tiny-cuda-controlled-k-torch-shard0"), "found": False,
               "resource_error": "CUDA out of memory"}
    _, merged, sources = merge([("a", shard_summary([starved]))])
    assert merged["totals"]["unexpected"] == 0 and merged["totals"]["resource_errors"] == 1
    root = check_junit(junit_xml(merged, sources))
    assert root.get("failures") == "0" and root.get("errors") == "1"
    error = root.find(".//error")
    assert (error.get("type"), error.get("message")) == (
        "resource error", "not judged: CUDA out of memory; run fewer workers (-n) on this GPU")
    assert ("| `ring-tiny-cuda-controlled-k-torch-shard0` | RESOURCE ERROR | not judged: CUDA out of memory"
            in markdown(merged))


@pytest.mark.parametrize("status", [2, 3])
def test_a_harness_error_is_a_junit_error_and_a_row_to_look_at_and_exits_with_its_status(status):
    """A campaign the harness could not run reached no verdict: never a finding, never clean."""
    message = "harness error at step 1 in the zeroer's warmup, not a finding: InterceptError: planted"
    stuck = {**fake_record("mine.py:make-tiny-sim-shard0"), "found": False, "harness_error": message,
             "harness_status": status, "harness_details": "Traceback (most recent call last): planted"}
    clean = fake_record("per_call-tiny-sim-k-torch-shard0")
    _, merged, sources = merge([("a", shard_summary([stuck, clean]))])
    assert merged["totals"]["unexpected"] == 0 and merged["totals"]["harness_errors"] == 1
    assert verdict(merged) == status
    root = check_junit(junit_xml(merged, sources))
    assert root.get("failures") == "0" and root.get("errors") == "1"
    error = root.find(".//error")
    assert (error.get("type"), error.get("message"), error.text) == (
        "harness error", f"not judged: {message}", "Traceback (most recent call last): planted")
    assert f"| `mine.py:make-tiny-sim-shard0` | HARNESS ERROR | not judged: {message}" in markdown(merged)


def test_an_unexpected_finding_outranks_a_harness_error_in_the_exit_status():
    stuck = {**fake_record("mine.py:make-tiny-sim-shard0"), "found": False, "harness_error": "planted",
             "harness_status": 3}
    violation = {**fake_record("per_call-tiny-sim-k-torch-shard0"), "found": True}
    _, merged, _ = merge([("a", shard_summary([stuck, violation]))])
    assert verdict(merged) == 1


def test_a_finding_saved_when_a_shard_was_interrupted_is_carried_into_every_report():
    campaign = "per_call-tiny-sim-k-torch-shard0"
    saved = {"campaign": campaign, "expect": "clean", "trace": "repro/failures/per_call-tiny-0123456789abcdef.json"}
    shard = {**shard_summary([], not_run=[campaign], partial=True), "saved_at_interruption": [saved]}
    _, merged, sources = merge([("a", shard)])
    assert merged["saved_at_interruption"] == [saved] and merged["not_run"] == [campaign]
    assert merged["totals"]["unexpected"] == 1 and verdict(merged) == 1
    assert unexpected_traces(merged) == [saved["trace"]]
    failure = check_junit(junit_xml(merged, sources)).find(".//failure")
    assert failure.get("message") == f"found before its shard was interrupted; trace: {saved['trace']}"
    assert f"| `{campaign}` | VIOLATION | found before the shard was interrupted; trace: {saved['trace']} |" in markdown(merged)

def test_the_merge_runs_on_the_standard_library_alone(tmp_path):
    """The workflow's report job installs nothing: torch, Hypothesis and numpy are unimportable here."""
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(shard_summary([fake_record("per_call-tiny-sim-k-torch-shard0")])))
    blocked = "import sys; [sys.modules.__setitem__(m, None) for m in ('torch', 'hypothesis', 'numpy', 'triton')]; "
    run = "import runpy; sys.argv = ['fuzz.merge', sys.argv[1], '--markdown', sys.argv[2]]; runpy.run_module('fuzz.merge', run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", blocked + run, str(path), str(tmp_path / "fuzz.md")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "profile nightly: 1 campaigns" in done.stdout and (tmp_path / "fuzz.md").exists()


# -- a real sharded run --------------------------------------------------------------------------


def test_a_real_run_in_two_shards_merges_into_one_report(tmp_path):
    """single_buffer as an outside zeroer (so its races are violations) on tiny: its two seed
    shards are the 5th and 6th of its sorted campaigns, so --fuzz-shard 0/2 and 1/2 run one each."""
    selection = ("--zeroer", "single_buffer", "-k", "tiny and sim and not triton and not x2", "--fuzz-profile", "quick")
    processes = [start_pytest_fuzz(*selection, "--fuzz-shard", f"{i}/2", "--repro-dir", str(tmp_path / f"s{i}" / "traces"),
                                   "--fuzz-summary", str(tmp_path / f"s{i}" / "summary.json"), "-q") for i in range(2)]
    for process in processes:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 1 and "1 failed" in output, output
    done = subprocess.run([sys.executable, "-m", "fuzz.merge", str(tmp_path / "s0" / "summary.json"),
                           str(tmp_path / "s1" / "summary.json"), "--json", str(tmp_path / "merged.json"),
                           "--junit", str(tmp_path / "fuzz.xml")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [r["campaign"] for r in merged["campaigns"]] == [
        "single_buffer-tiny-sim-k-torch-shard0", "single_buffer-tiny-sim-k-torch-shard1"]
    assert merged["totals"]["unexpected"] == 2 and merged["totals"]["profile"] == "quick"
    root = check_junit((tmp_path / "fuzz.xml").read_text())
    assert root.get("failures") == "2" and len(root) == 2
