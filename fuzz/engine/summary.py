"""The end-of-run summary: campaigns, examples, steps, findings with their trace paths."""

from __future__ import annotations

from fuzz.engine.campaigns import CampaignResult


def result_record(result: CampaignResult) -> dict:
    """What one campaign contributes to the summary (plain JSON, sent from xdist workers)."""
    violation = result.violation
    return {
        "campaign": result.campaign.id,
        "expect": result.campaign.expect,
        "zeroer": result.campaign.config.zeroer,
        "geometry": result.campaign.config.geometry,
        "backend": result.campaign.config.backend,
        "mode": result.campaign.config.mode,
        "examples": result.examples,
        "steps": result.steps,
        "runs": result.runs,
        "seconds": round(result.seconds, 3),
        "seeds": result.seeds,
        "first_finding_s": None if result.first_finding_s is None else round(result.first_finding_s, 3),
        "first_finding_examples": result.first_finding_examples,
        "found": result.found,
        "reproduced": result.reproduced,
        "trace": None if result.trace_path is None else str(result.trace_path),
        "trace_ops": None if violation is None else len(violation.trace),
        "findings": [] if violation is None else [str(f) for f in violation.findings[:5]],
    }


def render_summary(records: list[dict], profile: str) -> tuple[str, dict]:
    records = sorted(records, key=lambda r: r["campaign"])
    unexpected = [r for r in records if r["found"] != (r["expect"] == "finds")]
    totals = {
        "profile": profile,
        "campaigns": len(records),
        "examples": sum(r["examples"] for r in records),
        "steps": sum(r["steps"] for r in records),
        "seconds": round(sum(r["seconds"] for r in records), 3),
        "findings": sum(1 for r in records if r["found"]),
        "unexpected": len(unexpected),
    }
    lines = [
        f"profile {profile}: {totals['campaigns']} campaigns, {totals['examples']} examples, "
        f"{totals['steps']} steps, {totals['findings']} with findings, {totals['unexpected']} unexpected"
    ]
    for r in records:
        if r["found"]:
            verdict = "found (expected)" if r["expect"] == "finds" else "VIOLATION"
            flaky = "" if r.get("reproduced", True) else " (did not show again on replay: timing-dependent)"
            lines.append(f"  {r['campaign']}: {verdict}{flaky} after {r['first_finding_s']} s, {r['trace_ops']} ops -> {r['trace']}")
        elif r["expect"] == "finds":
            lines.append(f"  {r['campaign']}: MISSED a known race in {r['examples']} examples")
    return "\n".join(lines), {"totals": totals, "campaigns": records}
