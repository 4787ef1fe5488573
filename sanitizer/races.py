"""What the sanitizer reports: a race between a queued op and a later access, with its locations.

A :class:`Race` names its kind, the memory, where that memory was allocated, the queued op (what it
was, on which stream, at which line of the program) and the later access that may overtake it (a
host write, or an op on another stream), and, when the window was forced open, the values that
arrived. Two races are the same bug when their :meth:`Race.signature` matches: kind and the two
code locations, never addresses, buffers, op numbers or stream handles, so a loop that races on
every step, or a helper that races on every buffer it is given, is reported once.

The kinds:

* ``host-write-vs-pending-copy``: the host rewrote pinned memory that a queued non-blocking copy
  (or a kernel reading pinned memory, or a replayed CUDA graph) may not have read yet, or that a
  queued device-to-host copy may still overwrite (vLLM #48085);
* ``host-read-vs-pending-copy``: the host read pinned memory that a queued device-to-host copy may
  not have written yet (vLLM #36013);
* ``unordered-device-access``: two streams touch the same device memory, one writing, with no event
  path between them;
* ``reuse-without-record-stream``: the caching allocator handed memory another stream may still be
  using to a new tensor (its first owner was used on another stream without ``record_stream``);
* ``host-read-vs-pending-event``: the host read an event's time (``elapsed_time``) before it saw the
  event complete: a job reported finished before its copy ran.

Example::

    race = Race("host-write-vs-pending-copy", "pinned host buffer (8 x int64)", Site("p.py", 4, "main"),
                Access("copy_ (non-blocking H2D)", "the default stream", Site("p.py", 7, "main")),
                Access("host write", "host", Site("p.py", 6, "main")))
    print(race.format())
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from racecheck.hb import EVENT_READ
from sanitizer.sites import Site

_HEADLINES = {
    "host-write-vs-pending-copy": "host write to pinned memory a queued copy may not have read yet",
    "host-read-vs-pending-copy": "host read of pinned memory a queued copy may not have written yet",
    "unordered-device-access": "device memory accessed from two streams with no event between them",
    "reuse-without-record-stream": "device memory reused while another stream may still use it",
    "host-read-vs-pending-event": "host read of an event's time before the host saw the event complete",
}

_ADVICE = {
    "host-read-vs-pending-copy": (
        "make the host wait for the copy before it reads the buffer: record an event after the copy on "
        "its stream and call event.synchronize() (vLLM #36013), or synchronize the copy's stream"
    ),
    "host-write-vs-pending-copy": (
        "make the host wait for the copy before it rewrites the buffer (an event recorded after the "
        "copy on its stream, then event.synchronize()), or stage each call in a fresh pinned tensor (vLLM #48399)"
    ),
    "unordered-device-access": (
        "order the streams: record an event after the first access and wait on it on the second "
        "stream (stream.wait_event / wait_stream)"
    ),
    "reuse-without-record-stream": (
        "call tensor.record_stream(other_stream) before dropping a tensor another stream used, or "
        "make the allocating stream wait for that stream first"
    ),
    "host-read-vs-pending-event": (
        "see the event the then: line names complete before timing it or reporting its job finished: its query() "
        "answered True, or its synchronize() (the end event's covers a start recorded before it on the same "
        "stream); until then CUDA answers elapsed_time with cudaErrorNotReady or not, by timing"
    ),
}

# The second side of a race on a pinned block torch's caching host allocator handed out again.
HANDED_OUT_AGAIN = "pinned memory handed out again by torch's caching host allocator"
_FREED_ADVICE = (
    "keep the pinned tensor until the device work that reads or writes it has run: synchronize its stream, or an "
    "event recorded after it, before the last reference goes (LMCache #4830); the allocator itself waits only "
    "for copy_(..., non_blocking=True), not for kernels or other uses of the tensor's pointer"
)


@dataclass(frozen=True)
class Access:
    """One side of a race: ``what`` happened, on which ``stream`` (``host`` for host code), where."""

    what: str
    stream: str
    site: Site | None
    until: Site | None = None  # a host write seen between ``site`` and ``until``
    reused: bool = False  # the write is the caching host allocator handing the bytes out again

    def where(self) -> str:
        if self.site is None:
            return "(outside the sanitizer's view)"
        if self.until is not None and self.until != self.site:
            return f"between {self.site} and {self.until}"
        return f"at {self.site}"


class Label(str):
    """An op's or a host access's label in the happens-before checker, carrying what a report says
    of it (the checker treats labels as plain strings)."""

    access: Access
    generations: dict[int, int]  # device address -> its allocation count when this op used it

    @classmethod
    def of(cls, text: str, access: Access) -> "Label":
        label = cls(text)
        label.access, label.generations = access, {}
        return label


@dataclass(frozen=True)
class Race:
    """One race, phrased for the person who has to fix it (see the module docstring)."""

    kind: str
    resource: str
    allocated_at: Site | None
    queued: Access
    later: Access
    values: str = ""  # force mode: what the queued copy delivered instead of what was staged
    where: str = field(default="", compare=False)  # the test (pytest node id) or the script

    def signature(self) -> tuple:
        """What makes two races the same bug: no addresses, buffers, op numbers or stream handles."""
        queued = self.queued.site.short if self.queued.site else "?"
        later = self.later.site.short if self.later.site else "?"
        return (self.kind, queued, later)

    def format(self) -> str:
        """The multi-line report (docs/sanitizer.md shows one)."""
        allocated = f"allocated at {self.allocated_at}" if self.allocated_at else "allocated outside the sanitizer's view"
        lines = [
            f"kvz-sanitize: {_HEADLINES[self.kind]} [{self.kind}]",
            f"  event:   {self.resource}" if self.kind == EVENT_READ else f"  memory:  {self.resource}, {allocated}",
            f"  queued:  {self.queued.what} on {self.queued.stream}, {self.queued.where()}",
            f"  then:    {self.later.what} on {self.later.stream}, {self.later.where()}",
            "  no event or synchronisation the second side observed orders the queued op before it",
        ]
        if self.values:
            lines.append(f"  forced:  {self.values}")
        lines.append(f"  fix:     {_FREED_ADVICE if self.later.reused else _ADVICE[self.kind]}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["signature"] = list(self.signature())
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Race":
        def site(value: Any) -> Site | None:
            return Site(**value) if value else None

        def access(value: dict) -> Access:
            return Access(value["what"], value["stream"], site(value["site"]), site(value.get("until")),
                          bool(value.get("reused", False)))

        return cls(data["kind"], data["resource"], site(data["allocated_at"]), access(data["queued"]),
                   access(data["later"]), data.get("values", ""), data.get("where", ""))


@dataclass
class Unfollowed:
    """Something the program did that the sanitizer cannot follow, and where (one line, and the run
    is partial)."""

    what: str
    site: Site

    def message(self) -> str:
        return f"kvz-sanitize cannot follow {self.what} at {self.site}"


def distinct(races: list[Race]) -> list[tuple[Race, list[Race]]]:
    """Races grouped by :meth:`Race.signature`, in the order each was first seen: (first, all)."""
    groups: dict[tuple, list[Race]] = {}
    for race in races:
        groups.setdefault(race.signature(), []).append(race)
    return [(members[0], members) for members in groups.values()]
