"""``python -m repro {replay,export,regenerate}``: act on a finding.

* ``replay TRACE [--backend sim|cuda] [--mode controlled|free] [--repeat N]`` runs a trace through
  the fuzzer's own executor, prints the findings and ``reproduced k of N``; exit 1 when the bug
  shows, 0 when it does not.
* ``export TRACE -o repro/NAME.py`` writes a standalone script of the trace (no Hypothesis) that
  exits 1 when the bug shows.
* ``regenerate CAMPAIGN --seed N [--profile P]`` or ``regenerate --summary FILE`` reruns a
  campaign with a seed from a summary and writes the same shrunk trace again.

Exit status (:mod:`racecheck.cli`): 0 clean or not reproduced, 1 reproduced or found, 2 bad input (a
missing or malformed file, an unknown campaign: one line on stderr naming the value and the fix),
3 a bug in this tool; ``--debug`` adds the traceback. Replaying runs nothing from a trace but its
ops; the only code it imports is the zeroer factory the trace names.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from racecheck.atomic_file import write_text_atomically
from racecheck.cli import ArgumentParser, UsageError, check_output, run_main
from fuzz.engine.episode import EpisodeConfig
from fuzz.trace import TraceError, load_trace
from repro.export import check_output_name, render_script
from repro.regenerate import RegenerateError, Regeneration, from_summary, regenerate
from repro.replay import replay
from fuzz.timeline import write_timeline

PROG = "python -m repro"


def _replay(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise UsageError(f"--repeat {args.repeat} must be at least 1")
    trace = load_trace(args.trace)
    changes = {k: v for k, v in (("backend", args.backend), ("mode", args.mode)) if v is not None}
    config = dataclasses.replace(trace.config, **changes)
    _check_runs_here(args, config)
    try:
        recorded = frozenset(f["kind"] for f in trace.findings)  # load_trace checked each has a kind
        shown, first, other = replay(config, trace.ops, args.repeat, recorded)
    except ValueError as error:  # an op the episode refuses where it stands (run_ops): the trace's fault
        raise TraceError(f"{args.trace}: field 'ops': not a valid program: {error}") from error
    for finding in first[:10]:
        print(finding)
    where = config.backend + (f" ({config.mode})" if config.backend == "cuda" else "")
    print(f"reproduced {shown} of {args.repeat} on {where}")
    if other:  # still a finding (status 1), but not the one the trace recorded
        print(f"{other} of {args.repeat} showed a different finding than the trace recorded "
              f"({', '.join(sorted(recorded))}): the first is printed above")
    return 1 if shown or other else 0


def _check_runs_here(args: argparse.Namespace, config: EpisodeConfig) -> None:
    """The backend the replay runs on exists here, and the trace's zeroer runs on it."""
    import torch

    from zeroer.registry import load_zeroer

    if config.backend == "cuda" and not torch.cuda.is_available():
        given = "--backend cuda needs" if args.backend == "cuda" else f"{args.trace} was recorded on cuda and needs"
        raise UsageError(f"{given} a CUDA GPU, and none is visible here; replay on the simulator with --backend sim")
    from zeroer.registry import load_offloader

    where = config.backend + (f" ({config.mode})" if config.backend == "cuda" else "")
    parts = [("zeroer", config.zeroer, load_zeroer), ("offloader", config.offloader, load_offloader)]
    for kind, spec, load in parts:
        if spec is None:
            continue
        capabilities = load(spec).capabilities
        if not capabilities.runs_on(config.backend, config.mode):
            raise UsageError(f"{kind} {spec!r} of {args.trace} does not run on {where}; it runs on "
                             f"{', '.join(capabilities.backends)} (cuda modes: {', '.join(capabilities.cuda_modes)})")


def _export(args: argparse.Namespace) -> int:
    try:
        check_output_name(args.output)
    except ValueError as error:
        raise UsageError(str(error)) from None
    check_output("-o", args.output)
    trace = load_trace(args.trace)
    text = render_script(trace, str(args.output), title=args.title)
    write_text_atomically(args.output, text)
    print(f"wrote {args.output}: python {args.output} exits 1 when the bug shows")
    return 0


def _regenerate(args: argparse.Namespace) -> int:
    check_output("--repro-dir", args.repro_dir, "directory")
    if args.summary is not None:
        if args.campaign or args.seed is not None:
            raise RegenerateError("give either --summary FILE or CAMPAIGN --seed N, not both")
        runs = from_summary(args.summary)
        if not runs:
            print(f"{args.summary}: no campaign with a finding")
            return 0
    else:
        if not args.campaign or args.seed is None:
            raise RegenerateError("give CAMPAIGN --seed N (from a summary), or --summary FILE")
        runs = [Regeneration(args.campaign, args.seed, args.profile)]
    missed = 0
    for run in runs:
        result = regenerate(run, args.repro_dir, args.zeroer, args.offloader)
        if result.trace_path is None:
            missed += 1
            print(f"{run.campaign} seed {run.seed} ({run.profile}): no finding this time")
            continue
        same = "" if run.expected_trace is None else (
            " (the same trace as the summary's)" if Path(run.expected_trace).name == result.trace_path.name else f" (the summary named {run.expected_trace})"
        )
        print(f"{run.campaign} seed {run.seed} ({run.profile}): {len(result.violation.trace)} ops -> {result.trace_path}{same}")
    return 1 if missed < len(runs) else 0


def _timeline(args: argparse.Namespace) -> int:
    check_output("-o", args.output)
    check_output("--html", args.html)
    json_path, html_path = write_timeline(args.trace, args.output, args.html)
    print(f"wrote {json_path}: open it at https://ui.perfetto.dev (\"Open trace file\") or in chrome://tracing")
    print(f"wrote {html_path}: open it in any browser (self-contained)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The exit status (:mod:`racecheck.cli`): 0 clean, 1 reproduced or found, 2 bad input, 3 a bug."""
    return run_main(_command, argv, PROG)


def _command(argv: list[str]) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("replay", help="replay a trace file")
    run.add_argument("trace", type=Path)
    run.add_argument("--backend", choices=("sim", "cuda"), default=None, help="default: the trace's backend")
    run.add_argument("--mode", choices=("controlled", "free"), default=None, help="cuda: gates (default) or real timing")
    run.add_argument("--repeat", type=int, default=1)
    export = sub.add_parser("export", help="write a standalone script of a trace")
    export.add_argument("trace", type=Path)
    export.add_argument("-o", "--output", type=Path, required=True, help="e.g. repro/cases/ring_overrun.py")
    export.add_argument("--title", default=None, help="the script's first line (default: zeroer, geometry and findings)")
    again = sub.add_parser("regenerate", help="rerun a campaign with a seed from a summary")
    again.add_argument("campaign", nargs="?", help="campaign id, e.g. single_buffer-tiny-sim-k-torch-shard0")
    again.add_argument("--seed", type=int, default=None, help="the seed the summary lists")
    again.add_argument("--profile", default="quick", help="the profile the run used (the summary's totals.profile)")
    again.add_argument("--summary", type=Path, default=None, help="regenerate every finding of this summary JSON")
    again.add_argument("--zeroer", default=None, help="the --zeroer SPEC of the run, for a campaign of an outside zeroer")
    again.add_argument("--offloader", default=None, help="the --offloader SPEC of the run, for an offload campaign (a summary names it itself)")
    again.add_argument("--repro-dir", type=Path, default=Path("repro/failures"))
    picture = sub.add_parser("timeline", help="draw a trace's host and stream tracks (Perfetto JSON and HTML)")
    picture.add_argument("trace", type=Path)
    picture.add_argument("-o", "--output", type=Path, default=None, help="default: timelines/<trace stem>.json beside the trace")
    picture.add_argument("--html", type=Path, default=None, help="default: timelines/<trace stem>.html beside the trace")
    args = parser.parse_args(argv)
    handlers = {"replay": _replay, "export": _export, "regenerate": _regenerate, "timeline": _timeline}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
