"""The bugs a run has already shrunk, shared by its campaigns across pytest-xdist workers.

Many campaigns of one run find the same bug (a racy zeroer's geometries, seed shards and ``x2``
campaign), and each would then shrink it for seconds to a minute. Instead, the first campaign to
shrink a bug registers it, and every other campaign that meets the same bug (the same
:mod:`~fuzz.engine.signature`) stops at that failing example, unshrunk, and says whose trace holds
the bug.

Model. One ``pytest fuzz`` run has one registry: a directory the run's controlling process makes
when it starts and hands to its xdist workers (:mod:`fuzz.plugin`, through ``workerinput``). It is
a fresh temporary directory, not a file beside the traces, so that runs never see each other's
bugs: a bug fixed since the last run must be shown fixed, not waved through as known. In it, one
small JSON file per signature, named by the signature's key:

* **registering**: a campaign that shrank a finding registers it only once its trace file is
  written, with that trace's path, for the signature of its first failing example and that of
  its shrunk trace (Hypothesis took the one to the other, so both are this bug). Each file is
  written whole or not at all (:mod:`racecheck.atomic_file`); an entry that names a trace still on disk
  is kept, so the first campaign to finish stays the owner;
* **looking up**: every failing example of every campaign is looked up
  (:meth:`KnownBugs.check`, from ``CallerMachine._fail``). A hit raises :class:`SameBug`, an
  interruption that Hypothesis lets through at once instead of shrinking (as ``BudgetSpent``),
  and the campaign ends "same as <campaign>": a finding all the same, so the exit status does not
  change.

Nothing is claimed that is not on disk. A campaign cut off (Ctrl-C, a killed worker) before its
trace was written has registered nothing, so the others shrink the bug themselves; an entry whose
trace file is missing or unreadable is ignored. A registry directory this process cannot see (a
worker on another host) turns the sharing off: every campaign shrinks its own findings.

Example::

    bugs = KnownBugs(Path(run_registry), "ring-tiny-sim-k-torch-shard1")
    bugs.check(violation)                # raises SameBug if another campaign shrank this bug
    bugs.register(violation, trace)      # after the trace file is written
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from racecheck.atomic_file import write_json_atomically
from fuzz.engine.bugs import same_bug_message
from fuzz.engine.signature import Signature, violation_signature
from fuzz.engine.violation import ZeroerViolation


@dataclass(frozen=True)
class KnownBug:
    """A bug of the run, shrunk by ``campaign`` into the trace file ``trace`` (``trace_ops`` ops)."""

    signature: str
    campaign: str
    trace: str  # as the run shows it (relative to the working directory when --repro-dir is)
    trace_ops: int
    path: str  # the trace's absolute path, checked before a campaign is called the same

    def message(self) -> str:
        """The one line a campaign that stopped at this bug fails with (the full report is the
        shrinking campaign's, and the summary's bug block)."""
        return same_bug_message(self.campaign, self.trace)


class SameBug(KeyboardInterrupt):
    """This failing example is a bug another campaign of the run has already shrunk.

    An interruption, not a failure: Hypothesis lets it through without shrinking or replaying.
    :func:`~fuzz.engine.campaigns.run_campaign` keeps ``violation`` (the example as it failed) as
    the campaign's finding and ``known`` as where its shrunk trace is."""

    def __init__(self, violation: ZeroerViolation, known: KnownBug) -> None:
        super().__init__(f"same bug as {known.campaign}")
        self.violation = violation
        self.known = known


class KnownBugs:
    """Campaign ``campaign``'s view of the run's registry in ``directory``."""

    def __init__(self, directory: Path, campaign: str) -> None:
        self.directory = Path(directory)
        self.campaign = campaign
        self.first: Signature | None = None  # the signature of this campaign's first failing example

    @classmethod
    def at(cls, directory: str | os.PathLike | None, campaign: str) -> KnownBugs | None:
        """The registry at ``directory`` if this process can see it, else None (no sharing)."""
        if not directory or not Path(directory).is_dir():
            return None
        return cls(Path(directory), campaign)

    def check(self, violation: ZeroerViolation) -> None:
        """Raise :class:`SameBug` if ``violation``'s bug is one another campaign has shrunk."""
        signature = violation_signature(violation)
        if signature is None:
            return
        if self.first is None:
            self.first = signature
        known = self.lookup(signature)
        if known is not None and known.campaign != self.campaign:
            raise SameBug(violation, known)

    def lookup(self, signature: Signature) -> KnownBug | None:
        """The registered bug with ``signature`` whose trace file is there, or None."""
        try:
            data = json.loads((self.directory / f"{signature.key}.json").read_text())
            known = KnownBug(**data)
        except (OSError, ValueError, TypeError):  # not registered, or not an entry
            return None
        if known.signature != str(signature) or not _is_trace(Path(known.path)):
            return None
        return known

    def register(self, violation: ZeroerViolation, trace: Path) -> None:
        """Register ``violation``, shrunk and saved in ``trace``, under its signature and that of
        this campaign's first failing example. Call it only once ``trace`` is written."""
        final = violation_signature(violation)
        entry = {"campaign": self.campaign, "trace": str(trace), "trace_ops": len(violation.trace),
                 "path": os.path.abspath(trace)}
        for signature in dict.fromkeys(s for s in (self.first, final) if s is not None):
            if self.lookup(signature) is not None:  # another campaign got there first: it stays the owner
                continue
            try:
                write_json_atomically(self.directory / f"{signature.key}.json",
                                      asdict(KnownBug(signature=str(signature), **entry)))
            except OSError:  # the registry is gone (the run is ending): the others shrink for themselves
                return


def _is_trace(path: Path) -> bool:
    """Whether ``path`` holds a trace file (written whole: fuzz.engine.trace writes atomically)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("ops"), list)
