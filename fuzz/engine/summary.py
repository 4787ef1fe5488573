"""The end-of-run summary: campaigns, examples, steps, and the distinct bugs found, each with the
campaigns that showed it and the trace that holds it (:mod:`fuzz.engine.bugs`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from racecheck.atomic_file import write_json_atomically
from fuzz.engine.bugs import distinct_bugs
from fuzz.engine.signature import violation_signature

if TYPE_CHECKING:  # only for the annotation: python -m fuzz.merge renders summaries with the standard library alone
    from fuzz.engine.campaigns import CampaignResult


def result_record(result: CampaignResult) -> dict:
    """What one campaign contributes to the summary (plain JSON, sent from xdist workers).

    ``signature`` is its finding's (fuzz.engine.signature); ``same_as`` the campaign of the run
    that had already shrunk the same bug, when this one stopped at its first failing example
    instead (fuzz.engine.known_bugs): its ``trace`` is then that campaign's."""
    violation = result.violation
    same = result.same_as
    signature = None if violation is None else violation_signature(violation)
    return {
        "campaign": result.campaign.id,
        "expect": result.campaign.expect,
        # offloader: an offload campaign's component under test
        **_fields(result.campaign.config, "zeroer", "offloader", "geometry", "backend", "mode"),
        # shrink: where it was shrunk, confirmed where, cut off by the bound (fuzz.engine.shrink)
        **_fields(result, "examples", "steps", "runs", "deepest_queue", "shrunk_by_hypothesis", "shrink"),
        "seconds": round(result.seconds, 3),
        "seeds": result.seeds,
        "first_finding_s": None if result.first_finding_s is None else round(result.first_finding_s, 3),
        **_fields(result, "first_finding_examples", "found", "found_in_phase", "reproduced", "reproduction"),
        "trace": same.trace if same else None if result.trace_path is None else str(result.trace_path),
        "trace_ops": same.trace_ops if same else None if violation is None else len(violation.trace),
        "signature": None if signature is None else str(signature),
        "same_as": None if same is None else same.campaign,
        "findings": [] if violation is None else [str(f) for f in violation.findings[:5]],
        **_fields(result, "resource_error", "harness_error", "harness_status", "harness_details"),
    }


def _fields(source: object, *names: str) -> dict:
    """The attributes ``names`` of ``source``, under their own names (what a record copies as is)."""
    return {name: getattr(source, name) for name in names}


def shrink_note(shrink: dict | None) -> str:
    """What a summary line says about how a finding was shrunk: only what is out of the ordinary
    (shrunk on the simulator for a GPU campaign, a fallback, the bound)."""
    if not shrink:
        return ""
    notes = []
    if shrink.get("confirmed_on"):
        notes.append(f"shrunk on {shrink['shrunk_on']}, confirmed on {shrink['confirmed_on']}")
    elif shrink.get("fallback") and shrink.get("by") == "minimize":
        notes.append(f"shrunk on {shrink['shrunk_on']}: {shrink['fallback']}")
    if shrink.get("cut_off"):
        notes.append(f"shrinking cut off by its {shrink.get('bound_s')} s bound: the smallest trace so far")
    return f" ({'; '.join(notes)})" if notes else ""


def not_judged(record: dict) -> bool:
    """A campaign that reached no verdict: the GPU ran out of memory, or the harness could not
    follow or run the zeroer (racecheck.resources, fuzz.engine.harness_error)."""
    return bool(record.get("resource_error") or record.get("harness_error"))


def harness_status(records: list[dict]) -> int | None:
    """The exit status the run's harness errors call for: 3 if any is a bug of ours, 2 if each is
    the user's to act on, None without any."""
    statuses = [r.get("harness_status") or 3 for r in records if r.get("harness_error")]
    return max(statuses) if statuses else None


def is_unexpected(record: dict) -> bool:
    """A judged campaign whose result is not what it expected: a finding on a race-free zeroer or
    a missed known race (a resource or harness error is not judged)."""
    return record["found"] != (record["expect"] == "finds") and not not_judged(record)


def render_summary(records: list[dict], profile: str, *, selected: list[str] | None = None,
                   crashed: list[str] | None = None, partial: bool = False,
                   saved: list[dict] | None = None) -> tuple[str, dict]:
    """The summary's text and JSON. ``selected`` are the campaigns the run was to run: those with
    no result crashed (``crashed``: xdist reported their worker dead) or never ran (an
    interrupted run, ``partial``). ``saved``: ``{"campaign", "expect", "trace"}`` of each campaign
    that Ctrl-C cut off after a finding, whose program so far was saved (still listed as not run:
    it did not end); such a finding on a race-free design is unexpected, as at a campaign's end."""
    records = sorted(records, key=lambda r: r["campaign"])
    done = {r["campaign"] for r in records}
    crashed = sorted(set(crashed or ()))
    not_run = sorted(c for c in (selected or ()) if c not in done and c not in crashed)
    resources = [r for r in records if r.get("resource_error")]
    harness = [r for r in records if r.get("harness_error")]
    unexpected = [r for r in records if is_unexpected(r)]
    saved = sorted(saved or (), key=lambda s: s["campaign"])
    bugs = distinct_bugs(records)
    totals = {
        "profile": profile,
        "partial": partial,
        "crashed": len(crashed),
        "not_run": len(not_run),
        "campaigns": len(records),
        "examples": sum(r["examples"] for r in records),
        "steps": sum(r["steps"] for r in records),
        "seconds": round(sum(r["seconds"] for r in records), 3),
        "findings": sum(1 for r in records if r["found"]) + len(saved),
        "unexpected": len(unexpected) + sum(1 for s in saved if s["expect"] == "clean"),
        "bugs": len(bugs),  # distinct bugs among the campaigns with findings (fuzz.engine.bugs)
        "resource_errors": len(resources),
        "harness_errors": len(harness),
    }
    lines = [
        f"profile {profile}: {totals['campaigns']} campaigns, {totals['examples']} examples, "
        f"{totals['steps']} steps, {totals['findings']} with findings"
        + (f" ({len(bugs)} distinct bug{'s' if len(bugs) != 1 else ''})" if bugs else "")
        + f", {totals['unexpected']} unexpected"
        + (f", {len(crashed)} crashed" if crashed else "")
        + (f", {len(resources)} resource errors (not judged)" if resources else "")
        + (f", {len(harness)} harness errors (not judged)" if harness else "")
        + (f", {len(not_run)} not run (interrupted)" if partial and not_run else "")
    ]
    for s in saved:
        verdict = "found (expected)" if s["expect"] == "finds" else "VIOLATION"
        lines.append(f"  {s['campaign']}: {verdict} before the interruption; its program so far (maybe not fully "
                     f"shrunk) -> {s['trace']}")
    for campaign in crashed:
        lines.append(f"  {campaign}: CRASHED (its worker died; see the failure above for the saved trace)")
    errors: dict[tuple[str, str], list[str]] = {}  # one line per error, however many campaigns met it
    for r in records:
        if r.get("resource_error"):
            errors.setdefault(("RESOURCE ERROR", r["resource_error"]), []).append(r["campaign"])
        elif r.get("harness_error"):
            errors.setdefault(("HARNESS ERROR", r["harness_error"]), []).append(r["campaign"])
        elif not r["found"] and r["expect"] == "finds":
            lines.append(f"  {r['campaign']}: MISSED a known race in {r['examples']} examples")
    for (kind, message), campaigns in errors.items():
        where = campaigns[0] if len(campaigns) == 1 else f"{len(campaigns)} campaigns ({', '.join(campaigns)})"
        lines.append(f"  {where}: {kind}, not judged: {message}")
    by_id = {r["campaign"]: r for r in records}
    for number, bug in enumerate(bugs, 1):
        lines += bug_block(bug, by_id, number, len(bugs))
    data = {"totals": totals, "campaigns": records, "bugs": bugs, "crashed": crashed, "not_run": not_run}
    if saved:
        data["saved_at_interruption"] = saved
    return "\n".join(lines), data


def bug_block(bug: dict, records: dict[str, dict], number: int, count: int) -> list[str]:
    """One distinct bug (fuzz.engine.bugs): what it is and where it showed, then the line of each
    campaign that shrank it, then the campaigns that stopped at it without shrinking it again."""
    verdict = "VIOLATION" if bug["unexpected"] else "found (expected)"
    shown = len(bug["campaigns"])
    where = f"{', '.join(bug['geometries'])} ({', '.join(bug['backends'])})"
    lines = [f"  bug {number} of {count}: {verdict} in {shown} campaign{'s' if shown != 1 else ''} on {where}: "
             f"{bug['finding']}"]
    for campaign in bug["campaigns"]:
        record = records.get(campaign)
        if record is not None and not record.get("same_as"):
            lines.append(f"    {finding_line(record)}")
    if bug["not_shrunk"]:
        lines.append(f"    same bug, not shrunk again: {', '.join(bug['not_shrunk'])} (trace of {bug['shrunk_by']}: "
                     f"{bug['trace']})")
    return lines


def finding_line(record: dict) -> str:
    """A campaign that found something and shrank it: verdict, when, and its trace."""
    verdict = "found (expected)" if record["expect"] == "finds" else "VIOLATION"
    flaky = "" if record.get("reproduced", True) else " (did not show again on replay: timing-dependent)"
    replayed = " (replayed from the example database)" if record.get("found_in_phase") == "reuse" else ""
    return (f"{record['campaign']}: {verdict}{flaky}{replayed} after {record['first_finding_s']} s, "
            f"{record['trace_ops']} ops{shrink_note(record.get('shrink'))} -> {record['trace']}")


def write_summary(path: Path, data: dict) -> Path:
    """Write the summary at ``path``; a partial one never replaces a complete one there, it goes
    beside it (``summary.partial.json``). Returns where it went."""
    if data["totals"].get("partial"):
        try:
            previous = json.loads(path.read_text())
        except (OSError, ValueError):
            previous = None
        if isinstance(previous, dict) and not previous.get("totals", {}).get("partial", False):
            path = path.with_name(f"{path.stem}.partial{path.suffix}")
    write_json_atomically(path, data)
    return path
