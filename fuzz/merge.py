"""``python -m fuzz.merge SUMMARY.json... [--json OUT] [--junit OUT.xml] [--markdown OUT.md]``:
one report from the summaries of a sharded run.

Each shard of a sharded run (``pytest fuzz --fuzz-shard i/N``, i = 0..N-1) writes its own
summary (``--fuzz-summary``; the schema is :mod:`fuzz.engine.summary`'s). Merged, their
campaigns, crashed and not-run lists are concatenated and the totals recomputed by the code that
writes a summary; the result is partial if any shard was. A campaign that appears in two
summaries is an input error (shards of different ``N``, or one summary given twice), and so are
summaries of different profiles. The merged ``bugs`` list groups the campaigns of every shard by
the bug they showed (:mod:`fuzz.engine.bugs`): shards run apart, so each shrank its own trace of a
bug they share, and the merged bug lists them all.

Outputs: ``--json`` the merged summary (same schema), ``--junit`` JUnit XML, ``--markdown`` a
table for ``$GITHUB_STEP_SUMMARY`` (:mod:`fuzz.reports`), ``--unexpected-traces`` the trace
paths of the unexpected findings, one a line (the nightly workflow replays them on later nights).
The text summary goes to stdout. Exit status: 0 when every design came out clean and every
self-check found its race, 1 when not (an unexpected finding, a missed self-check or a crash),
2 bad input (one line on stderr), or only resource errors or harness errors the user can act on,
3 when a harness error is a bug of kvzero-fuzz.

Only the standard library is needed, so a report job needs no torch and no Hypothesis.

Example::

    python -m fuzz.merge shards/*/summary.json --junit fuzz.xml --markdown fuzz.md --json summary.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from racecheck.atomic_file import write_json_atomically, write_text_atomically
from racecheck.cli import CLEAN, FINDING, USAGE, ArgumentParser, UsageError, check_output, run_main
from fuzz.engine.summary import harness_status, render_summary
from fuzz.reports import junit_xml, markdown

RECORD_FIELDS = ("campaign", "expect", "found", "examples", "steps", "seconds")


class MergeError(UsageError, ValueError):
    """A summary that cannot be merged; the message names the file and what is wrong."""


def load_summary(path: Path) -> dict:
    """A summary file, checked for the parts a merge reads."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise MergeError(f"{path}: cannot read it ({error.strerror or error})") from None
    except ValueError as error:
        raise MergeError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("campaigns", "crashed", "not_run")) \
            or not isinstance(data.get("totals"), dict) or "profile" not in data["totals"]:
        raise MergeError(f"{path}: not a fuzz summary (expected totals, campaigns, crashed and not_run, as "
                         f"pytest fuzz --fuzz-summary writes)")
    for record in data["campaigns"]:
        missing = [f for f in RECORD_FIELDS if not isinstance(record, dict) or f not in record]
        if missing:
            raise MergeError(f"{path}: a campaign record lacks {', '.join(missing)}")
    return data


def merge(summaries: list[tuple[str, dict]]) -> tuple[str, dict, dict[str, str]]:
    """Merge ``(name, summary)`` pairs: the text and JSON of the merged summary, and which name
    each campaign came from."""
    if not summaries:
        raise MergeError("no summaries to merge")
    sources: dict[str, str] = {}
    for name, data in summaries:
        ids = [r["campaign"] for r in data["campaigns"]] + list(data["crashed"]) + list(data["not_run"])
        for campaign in ids:
            if campaign in sources:
                where = "twice in " + name if sources[campaign] == name else f"in {sources[campaign]} and in {name}"
                raise MergeError(f"campaign {campaign!r} is {where}: a campaign belongs to one shard (shards of "
                                 f"different --fuzz-shard i/N, or one summary given twice?)")
            sources[campaign] = name
    records, crashed, not_run, saved = ([item for _, data in summaries for item in data.get(part, [])]
                                        for part in ("campaigns", "crashed", "not_run", "saved_at_interruption"))
    profiles = {data["totals"]["profile"] for _, data in summaries}
    if len(profiles) > 1:
        each = ", ".join(f"{data['totals']['profile']} in {name}" for name, data in summaries)
        raise MergeError(f"the summaries ran different profiles ({each}); merge the shards of one run")
    partial = any(data["totals"].get("partial", False) for _, data in summaries)
    text, merged = render_summary(records, profiles.pop(), selected=[*sources], crashed=crashed, partial=partial,
                                  saved=saved)
    return text, merged, sources


def unexpected_traces(summary: dict) -> list[str]:
    """The trace files of the findings in designs that must be clean (a campaign's, or one saved
    when Ctrl-C cut its campaign off), each once: campaigns that stopped at a bug another campaign
    had shrunk name that campaign's trace."""
    traces = ([r["trace"] for r in summary["campaigns"] if r["found"] and r["expect"] == "clean" and r.get("trace")]
              + [s["trace"] for s in summary.get("saved_at_interruption", []) if s["expect"] == "clean"])
    return list(dict.fromkeys(traces))


def verdict(summary: dict) -> int:
    """0 when every design came out clean and every self-check found its race; 1 on an unexpected
    result or a crash; else 3 or 2 when harness errors stood in the way (fuzz.engine.harness_error:
    3 when one is a bug of kvzero-fuzz), 2 when only resource errors did (the GPU out of memory)."""
    if summary["totals"]["unexpected"] or summary["crashed"]:
        return FINDING
    harness = harness_status(summary["campaigns"])
    if harness:
        return harness
    return USAGE if summary["totals"].get("resource_errors") else CLEAN  # GPU out of memory: no verdict (racecheck.resources)


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, "python -m fuzz.merge")


def _main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m fuzz.merge", description=__doc__.splitlines()[0])
    parser.add_argument("summaries", nargs="+", type=Path, metavar="SUMMARY.json", help="one summary per shard")
    parser.add_argument("--json", type=Path, help="write the merged summary here")
    parser.add_argument("--junit", type=Path, metavar="OUT.xml", help="write JUnit XML here")
    parser.add_argument("--markdown", type=Path, metavar="OUT.md", help="write a Markdown report here")
    parser.add_argument("--title", default="kvzero-fuzz", help="the Markdown report's heading")
    parser.add_argument("--unexpected-traces", type=Path, metavar="OUT.txt",
                        help="write the trace paths of unexpected findings here, one a line")
    args = parser.parse_args(argv)
    for flag in ("json", "junit", "markdown", "unexpected_traces"):
        check_output(f"--{flag.replace('_', '-')}", getattr(args, flag))
    text, merged, sources = merge([(str(path), load_summary(path)) for path in args.summaries])
    print(text)
    if args.json:
        write_json_atomically(args.json, merged)
    if args.junit:
        write_text_atomically(args.junit, junit_xml(merged, sources))
    if args.markdown:
        write_text_atomically(args.markdown, markdown(merged, args.title))
    if args.unexpected_traces:
        write_text_atomically(args.unexpected_traces, "".join(f"{t}\n" for t in unexpected_traces(merged)))
    return verdict(merged)


if __name__ == "__main__":
    sys.exit(main())
