"""A run's summary (the JSON ``pytest fuzz`` writes, or ``python -m fuzz.merge`` merges) as JUnit
XML and as a Markdown table, for CI: test reporters read the XML, ``$GITHUB_STEP_SUMMARY`` shows
the Markdown. Standard library only.

Every campaign is one JUnit ``testcase`` (class ``fuzz.<backend>``, name the campaign id), in one
``testsuite`` per summary file it came from (a shard):

* an unexpected finding (a race in a design that must be clean): ``<failure type="finding">``;
* a missed self-check (the fuzzer did not find a known race): ``<failure type="missed self-check">``;
* a crashed worker: ``<error type="crashed">``; the GPU out of memory: ``<error type="resource
  error">``; the harness unable to follow or run the zeroer: ``<error type="harness error">``;
* a campaign that did not run (skipped, or its shard was interrupted): ``<skipped>``;
* anything else passes; the counts, seeds and trace go to its ``<system-out>``.

Findings are reported once per distinct bug (:mod:`fuzz.engine.bugs`): the campaign that shrank a
bug carries the full failure and the list of the other campaigns that showed it; a campaign that
stopped at a bug another campaign had shrunk (``same_as``) fails with one line naming that campaign
and its trace. The Markdown lists each bug once, with its campaigns, geometries and trace.

Example::

    junit_xml(summary, {"ring-tiny-sim-k-torch-shard0": "shard-0/summary.json"})
    markdown(summary)
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from fuzz.engine.bugs import distinct_bugs, same_bug_message

FINDINGS_SHOWN = 5


def outcome(record: dict) -> str:
    """One word for a campaign's result: ``clean``, ``found``, ``VIOLATION``, ``MISSED``,
    ``RESOURCE ERROR`` (the GPU ran out of memory) or ``HARNESS ERROR`` (the harness could not
    follow or run the zeroer): the last two not judged, as in the run's own summary."""
    if record.get("resource_error"):
        return "RESOURCE ERROR"
    if record.get("harness_error"):
        return "HARNESS ERROR"
    if record["found"]:
        return "found" if record["expect"] == "finds" else "VIOLATION"
    return "MISSED" if record["expect"] == "finds" else "clean"


def backend_of(campaign: str, record: dict | None = None) -> str:
    """``sim``, ``cuda-controlled`` or ``cuda-free``, from the record or else from the id."""
    if record is not None:
        return record["backend"] if record["backend"] == "sim" else f"cuda-{record['mode']}"
    match = re.search(r"-(sim|cuda-controlled|cuda-free)(?=-)", campaign)
    return match.group(1) if match else "unknown"


def _detail(record: dict, bug: dict | None = None) -> str:
    """What a person needs about a result: findings, trace and replay command, or the miss;
    ``bug``: the distinct bug the record's finding is (the other campaigns that showed it)."""
    lines = []
    if record.get("resource_error"):
        lines.append(f"not judged: {record['resource_error']}; run fewer workers (-n) on this GPU")
    elif record.get("harness_error"):
        lines.append(f"not judged: {record['harness_error']}")
    elif record["found"] and record.get("same_as"):
        lines.append(same_bug_message(record["same_as"], record.get("trace")))
    elif record["found"]:
        lines += record.get("findings", [])[:FINDINGS_SHOWN]
        if not record.get("reproduced", True):
            lines.append("(did not show again on replay: timing-dependent)")
        if record.get("found_in_phase") == "reuse":
            lines.append("(replayed from the example database: an example saved by an earlier run)")
        if record.get("trace"):
            lines += [f"trace: {record['trace']}", f"replay: python -m repro replay {record['trace']}"]
        others = [c for c in (bug or {}).get("campaigns", []) if c != record["campaign"]]
        if others:
            lines.append(f"the same bug in {len(others)} other campaign{'s' if len(others) != 1 else ''} "
                         f"(on {', '.join(bug['geometries'])}): {', '.join(others)}")
    elif record["expect"] == "finds":
        seeds = ", ".join(str(s) for s in record.get("seeds", []))
        lines.append(f"the fuzzer missed the known race of {record['zeroer']!r} in {record['examples']} examples "
                     f"(seed {seeds}): the self-check failed")
    return "\n".join(lines)


def junit_xml(summary: dict, sources: dict[str, str] | None = None) -> str:
    """``summary`` as JUnit XML; ``sources`` maps a campaign id to the file it came from (one
    ``testsuite`` each; all in one suite named ``fuzz`` without it)."""
    sources = sources or {}
    records = {r["campaign"]: r for r in summary["campaigns"]}
    bug_of = {campaign: bug for bug in distinct_bugs(summary["campaigns"]) for campaign in bug["campaigns"]}
    saved = {s["campaign"]: s for s in summary.get("saved_at_interruption", [])}
    cases = ([(c, "record") for c in records] + [(c, "crashed") for c in summary["crashed"]]
             + [(c, "not_run") for c in summary["not_run"]])
    root = ET.Element("testsuites", name="kvzero-fuzz")
    suites: dict[str, ET.Element] = {}
    for campaign, kind in sorted(cases, key=lambda case: (sources.get(case[0], "fuzz"), case[0])):
        source = sources.get(campaign, "fuzz")
        if source not in suites:
            suites[source] = ET.SubElement(root, "testsuite", name=source)
            properties = ET.SubElement(suites[source], "properties")
            ET.SubElement(properties, "property", name="profile", value=str(summary["totals"]["profile"]))
        record = records.get(campaign) if kind == "record" else None
        case = ET.SubElement(suites[source], "testcase", classname=f"fuzz.{backend_of(campaign, record)}",
                             name=campaign, time=f"{record['seconds'] if record else 0:.3f}")
        if kind == "crashed":
            ET.SubElement(case, "error", type="crashed",
                          message="its worker died (a CUDA fault, an OOM kill); the shard's repro dir holds the "
                                  "trace rescued from its journal")
        elif kind == "not_run" and saved.get(campaign, {}).get("expect") == "clean":
            message = f"found before its shard was interrupted; trace: {saved[campaign]['trace']}"
            ET.SubElement(case, "failure", type="finding", message=message).text = message
        elif kind == "not_run":
            ET.SubElement(case, "skipped", message="not run (skipped, or its shard was interrupted)")
        else:
            verdict, detail = outcome(record), _detail(record, bug_of.get(campaign))
            out = (f"{verdict}: examples {record['examples']}, steps {record['steps']}, {record['seconds']} s, "
                   f"seeds {record.get('seeds', [])}")
            if verdict in ("RESOURCE ERROR", "HARNESS ERROR"):
                error = ET.SubElement(case, "error", type=verdict.lower(), message=detail[:300])
                if verdict == "HARNESS ERROR":
                    error.text = record.get("harness_details") or detail
            elif verdict in ("VIOLATION", "MISSED"):
                kind_of = "finding" if verdict == "VIOLATION" else "missed self-check"
                failure = ET.SubElement(case, "failure", type=kind_of, message=(detail.splitlines() or [verdict])[0][:300])
                failure.text = detail
            elif detail:  # an expected finding: its trace, for the curious
                out += f"\n{detail}"
            ET.SubElement(case, "system-out").text = out
    for element in [*suites.values(), root]:  # each suite's counts, then the run's
        cases = list(element.iter("testcase"))
        element.set("tests", str(len(cases)))
        for name, tag in (("failures", "failure"), ("errors", "error"), ("skipped", "skipped")):
            element.set(name, str(sum(case.find(tag) is not None for case in cases)))
        element.set("time", f"{sum(float(case.get('time')) for case in cases):.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _bug_campaigns(bug: dict) -> str:
    """The campaigns that showed ``bug``, the one whose trace holds it first."""
    first = bug["shrunk_by"]
    return ", ".join(_code(c) for c in [first, *(c for c in bug["campaigns"] if c != first)])


def _bug_detail(bug: dict, records: dict[str, dict]) -> str:
    """An unexpected bug: the finding and trace of the campaign that shrank it, and where else it showed."""
    owner = records.get(bug["shrunk_by"])
    if owner is not None:
        return _detail(owner, bug)
    return "\n".join([bug["finding"], f"trace: {bug['trace']}", f"replay: python -m repro replay {bug['trace']}"])


def _cell(text: object) -> str:
    """Text for one cell of a GitHub Markdown table: no raw HTML, pipes escaped, lines as <br>."""
    text = str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


def _code(text: object) -> str:
    """A code span in a table cell (a campaign id, a path): only the pipe needs escaping."""
    return "`" + str(text).replace("`", "'").replace("|", "\\|") + "`"


def markdown(summary: dict, title: str = "kvzero-fuzz") -> str:
    """``summary`` as Markdown: the totals, what needs a person (each unexpected bug once, with the
    campaigns that showed it; each missed self-check, crash and error), then every distinct bug and
    every campaign (folded)."""
    t = summary["totals"]
    records = summary["campaigns"]
    by_id = {r["campaign"]: r for r in records}
    bugs = distinct_bugs(records)
    head = (f"### {title}: {t['profile']} profile, {t['campaigns']} campaigns"
            + (" (partial: a shard was interrupted)" if t["partial"] else ""))
    lines = [head, "",
             "| campaigns | examples | steps | with findings | distinct bugs | unexpected | crashed | not run "
             "| campaign-seconds |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {t['campaigns']} | {t['examples']:,} | {t['steps']:,} | {t['findings']} | {len(bugs)} | "
             f"{t['unexpected']} | {t['crashed']} | {t['not_run']} | {t['seconds']:,} |", ""]
    # (sort key, first cell, result, detail): an unexpected bug is one row, its campaigns in the first cell
    attention = [(r["campaign"], _code(r["campaign"]), outcome(r), _detail(r)) for r in records
                 if outcome(r) in ("MISSED", "RESOURCE ERROR", "HARNESS ERROR")]
    attention += [(b["shrunk_by"], _bug_campaigns(b), "VIOLATION", _bug_detail(b, by_id))
                  for b in bugs if b["unexpected"]]
    attention += [(s["campaign"], _code(s["campaign"]), "VIOLATION",
                   f"found before the shard was interrupted; trace: {s['trace']}")
                  for s in summary.get("saved_at_interruption", []) if s["expect"] == "clean"]
    attention += [(c, _code(c), "CRASHED", "its worker died; the shard's artifact holds the rescued trace")
                  for c in summary["crashed"]]
    if attention:
        lines += ["**Needs a look**", "", "| campaign | result | detail |", "|---|---|---|"]
        lines += [f"| {cell} | {result} | {_cell(detail)} |" for _, cell, result, detail in sorted(attention)]
        lines.append("")
    else:
        lines += ["Every design came out clean and every self-check found its race.", ""]
    if bugs:
        lines += [f"<details><summary>{len(bugs)} distinct bug{'s' if len(bugs) != 1 else ''}</summary>", "",
                  "| bug | result | campaigns | geometries | trace (shrunk by) |", "|---|---|---|---|---|"]
        for bug in bugs:
            trace = f"{_code(bug['trace'])} ({_code(bug['shrunk_by'])})" if bug.get("trace") else ""
            lines.append(f"| {_cell(bug['finding'])} | {'VIOLATION' if bug['unexpected'] else 'found'} | "
                         f"{_bug_campaigns(bug)} | {', '.join(bug['geometries'])} | {trace} |")
        lines += ["", "</details>", ""]
    lines += [f"<details><summary>All {len(records) + len(summary['crashed']) + len(summary['not_run'])} campaigns</summary>",
              "", "| campaign | expect | result | examples | steps | s | trace |", "|---|---|---|---:|---:|---:|---|"]
    rows = [(r["campaign"], r["expect"], outcome(r) + (" (replayed)" if r.get("found_in_phase") == "reuse" else "")
             + (f" (same bug as {_code(r['same_as'])})" if r.get("same_as") else ""),
             f"{r['examples']:,}", f"{r['steps']:,}", r["seconds"], _code(r["trace"]) if r.get("trace") else "")
            for r in records]
    rows += [(c, "", "CRASHED", "", "", "", "") for c in summary["crashed"]]
    rows += [(c, "", "not run", "", "", "", "") for c in summary["not_run"]]
    for campaign, expect, result, examples, steps, seconds, trace in sorted(rows):
        lines.append(f"| {_code(campaign)} | {expect} | {result} | {examples} | {steps} | {seconds} | {trace} |")
    lines += ["", "</details>", ""]
    return "\n".join(lines)
