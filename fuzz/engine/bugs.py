"""Distinct bugs: the campaign records of a run (or of merged shards) grouped by the bug they show.

A racy zeroer is found by many campaigns (its geometries, seed shards, the ``x2`` campaign, both
cuda modes), and a reader wants one report per bug, not one per campaign. Each campaign record
(:func:`fuzz.engine.summary.result_record`) that found something carries its finding's
``signature`` (:mod:`fuzz.engine.signature`) and, when another campaign of its run had already
shrunk that bug, ``same_as``: that campaign's id (:mod:`fuzz.engine.known_bugs`). Grouping:

* a campaign with ``same_as`` joins the bug of that campaign;
* any other campaign that found something joins the bug of its signature: campaigns that shrank
  the same bug side by side, or in different shards (``python -m fuzz.merge``), are one bug with
  several traces;
* a record without a signature (a summary written before signatures existed) is a bug of its own.

A bug's ``trace`` is the shortest trace of its campaigns that shrank it (ties: the first campaign
id), and ``shrunk_by`` the campaign that wrote it. Standard library only, like the rest of a
summary's rendering: the merge job installs nothing.

Example::

    for bug in distinct_bugs(summary["campaigns"]):
        bug["campaigns"], bug["geometries"], bug["trace"], bug["shrunk_by"]
"""

from __future__ import annotations

import hashlib


def bug_id(signature: str) -> str:
    """The id of the bug with ``signature`` (the key its run's registry files it under)."""
    return hashlib.sha256(signature.encode()).hexdigest()[:16]


def same_bug_message(owner: str, trace: str | None) -> str:
    """The one line a campaign that stopped at a bug another campaign had shrunk fails with."""
    return (f"same bug as {owner}, not shrunk again here: see that campaign's failure and the fuzz summary's bug "
            f"block; trace: {trace}")


def distinct_bugs(records: list[dict]) -> list[dict]:
    """The bugs of ``records`` (campaign records of one or several runs), the unexpected ones
    first (a finding in a design that must be clean), then by their first campaign id."""
    found = sorted((r for r in records if r.get("found") and not r.get("resource_error") and not r.get("harness_error")),
                   key=lambda r: r["campaign"])
    # A group's key: ("signature", its signature), or ("campaign", an id) for a record without one.
    groups: dict[tuple[str, str], list[dict]] = {}
    owner_group: dict[str, tuple[str, str]] = {}
    for record in found:  # first the campaigns that shrank their own finding
        if record.get("same_as"):
            continue
        key = _key(record.get("signature"), record["campaign"])
        groups.setdefault(key, []).append(record)
        owner_group[record["campaign"]] = key
    for record in found:  # then the ones that stopped at a bug another campaign had shrunk
        if record.get("same_as"):
            # Its owner's record may be missing (its worker died after registering the bug): a
            # group of its own under the owner's name, with the owner's trace.
            key = owner_group.get(record["same_as"]) or _key(record.get("signature"), record["same_as"])
            groups.setdefault(key, []).append(record)
    bugs = [_bug(key, members) for key, members in groups.items()]
    return sorted(bugs, key=lambda b: (not b["unexpected"], b["campaigns"][0]))


def _key(signature: str | None, campaign: str) -> tuple[str, str]:
    return ("signature", signature) if signature else ("campaign", campaign)


def _bug(key: tuple[str, str], members: list[dict]) -> dict:
    shrunk = sorted((r for r in members if not r.get("same_as") and r.get("trace")),
                    key=lambda r: (r.get("trace_ops") or 0, r["campaign"]))
    # Without a campaign of its own trace (only duplicates here), the trace they point at.
    first = shrunk[0] if shrunk else min(members, key=lambda r: r["campaign"])
    signature = key[1] if key[0] == "signature" else None
    findings = first.get("findings") or [""]
    return {
        "id": bug_id(signature) if signature else None,
        "signature": signature,
        "zeroer": first.get("zeroer"),
        "finding": str(findings[0]).splitlines()[0] if findings[0] else "",
        "unexpected": any(r["expect"] == "clean" for r in members),
        "trace": first.get("trace"),
        "trace_ops": first.get("trace_ops"),
        "shrunk_by": first.get("same_as") or first["campaign"],
        "campaigns": sorted(r["campaign"] for r in members),
        "geometries": sorted({r.get("geometry") for r in members if r.get("geometry")}),
        "backends": sorted({r["backend"] if r.get("backend") in ("sim", None) else f"cuda-{r.get('mode')}" for r in members}),
        "traces": [{"campaign": r["campaign"], "trace": r["trace"], "trace_ops": r.get("trace_ops")} for r in shrunk],
        # stopped at the bug without shrinking it: their records' same_as names who did
        "not_shrunk": sorted(r["campaign"] for r in members if r.get("same_as")),
    }
