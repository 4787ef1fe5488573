#!/usr/bin/env python3
"""vLLM's zeroer before #48085: one persistent pinned staging buffer, rewritten by the host before
its queued copy ran, so block 1 is never zeroed.

Provenance:
  found by   campaign single_buffer-tiny-sim-k-torch-shard0, Hypothesis seed 435646881
  found on   the simulator: no GPU, torch 2.13.0+cpu, triton 3.9.0, python 3.11.7
  exported   2026-12-03 from repro/cases/single_buffer_pre_48085.json by `python -m repro export`
  finding: hazard at step 3: host write to pinned host buffer 1 by
  single_buffer.zero_block_ids#3([2]) while copy#3 on stream 'main'
  (single_buffer.zero_block_ids#2([1])) may not have read it yet: no event or synchronisation
  observed by the host orders the copy before the write (the vLLM #48085 hazard)

Run it from the repository root. Exit status: 1 when the bug shows, 0 when it does not, 2 for a
bad option or a zeroer that cannot run here, 3 for a bug of kvzero-fuzz (one line on stderr;
--debug adds the traceback).
    python repro/cases/single_buffer_pre_48085.py                              # the CPU simulator
    python repro/cases/single_buffer_pre_48085.py --backend cuda --repeat 20   # a GPU: gates force the recorded schedule
    python repro/cases/single_buffer_pre_48085.py --zeroer per_call            # the same steps on a race-free design: exits 0
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from fuzz.cli import ArgumentParser, run_main  # noqa: E402
from fuzz.environment import describe, environment  # noqa: E402
from fuzz.engine.episode import CodeUnderTestRaised, Episode, EpisodeConfig  # noqa: E402

# -- the episode, as found ----------------------------------------------------------------------
ZEROER = 'single_buffer'
GEOMETRY = 'tiny'
BACKEND = 'sim'  # sim or cuda; --backend overrides
MODE = 'controlled'  # cuda only: controlled (gates enforce the schedule) or free
KERNEL = 'torch'  # built-in staged designs: torch or triton (None: their default)
STREAMS = 3
CALLER_FAULT = None
FOUND_ON = {
    'cuda': None,
    'driver': None,
    'gpu': None,
    'hypothesis': '6.170.17',
    'platform': 'Linux-6.18.44-fc-v1098-x86_64-with-glibc2.36',
    'python': '3.11.7',
    'torch': '2.13.0+cpu',
    'triton': '3.9.0',
}


def steps(episode: Episode) -> None:
    """The ops in the order the fuzzer ran them (docs/trace-format.md says what each does)."""
    op = episode.apply
    op({"op": "start", "in_flight": 1})
    op({"op": "allocate", "n": 1, "stream": 0})  # zero_block_ids([1]) on stream 0
    op({"op": "allocate", "n": 1, "stream": 0})  # zero_block_ids([2]) on stream 0  <-- the happens-before checker fires here


def run_once(config: EpisodeConfig) -> list:
    """One episode of the steps, judged as the fuzzer and the replayer judge it (run_ops)."""
    episode = Episode(config)  # a factory that raises: a usage error (exit status 2), not a finding
    try:
        steps(episode)
        return episode.finish()  # one synchronisation, then the oracle checks every read and block
    except CodeUnderTestRaised:  # the code under test raised: a finding, with those made before it
        return list(episode.findings)
    finally:
        if not episode.finished:  # stopped by an error: still free the runtime (open every gate on cuda)
            episode.abandon()


def main(argv: list[str] | None = None) -> int:
    """The exit status: 1 reproduced, 0 not, 2 a bad option or a zeroer that cannot run here, 3 a bug
    of kvzero-fuzz; an error is one line on stderr (--debug adds the traceback)."""
    return run_main(_main, argv, Path(__file__).name)


def _main(argv: list[str]) -> int:
    parser = ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--backend', choices=('sim', 'cuda'), default=BACKEND)
    parser.add_argument('--mode', choices=('controlled', 'free'), default=MODE)
    parser.add_argument('--repeat', type=int, default=1, help='run the steps N times and count')
    parser.add_argument('--zeroer', default=ZEROER, help='another zeroer spec, e.g. a race-free design')
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f'--repeat {args.repeat} must be at least 1')
    kernel = KERNEL if args.zeroer == ZEROER else None
    config = EpisodeConfig(zeroer=args.zeroer, geometry=GEOMETRY, backend=args.backend, mode=args.mode,
                           kernel=kernel, streams=STREAMS, caller_fault=CALLER_FAULT)
    print(f'found on: {describe(FOUND_ON)}')
    print(f'running on: {describe(environment())}', flush=True)
    shown, first = 0, []
    for _ in range(args.repeat):
        findings = run_once(config)
        shown += bool(findings)
        first = first or findings
    for finding in first[:10]:
        print(finding)
    where = args.backend + (f' ({args.mode})' if args.backend == 'cuda' else '')
    print(f'{args.zeroer}: reproduced {shown} of {args.repeat} on {where}')
    return 1 if shown else 0


if __name__ == '__main__':
    sys.exit(main())
