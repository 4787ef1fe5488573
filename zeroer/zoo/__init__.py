"""The zoo: broken zeroers, each with one real bug class, to measure what the fuzzer finds.

Every entry is modelled on a vLLM issue or PR (named in its docstring with the symptom users
saw), is registered in :mod:`zeroer.registry` as ``zoo.<bug>``, and declares the geometry on which
its bug shows (:mod:`zeroer.zoo.entry`). Families, one module each:

* :mod:`~zeroer.zoo.staging`: host staging memory rewritten before its copy ran;
* :mod:`~zeroer.zoo.streams`: the zero on the wrong stream or at the wrong time;
* :mod:`~zeroer.zoo.arithmetic`: the kernel's offset width, block ratio and grid;
* :mod:`~zeroer.zoo.table`: the segment address table.

``python -m fuzz.bench.detect`` runs the fuzzer against every entry (docs/detection.md);
``pytest fuzz --zeroer zoo.side_stream`` fuzzes one on its geometry; docs/zoo.md lists them.

Example::

    from zeroer.zoo import ENTRIES
    sorted(ENTRIES)[:2]        # ['zoo.captured_stream', 'zoo.deferred_zero']
"""

from __future__ import annotations

from zeroer.zoo.arithmetic import Int32Offset, Int32Offset4GiB, LastChunkSkipped, RatioIgnored
from zeroer.zoo.entry import ZooEntry
from zeroer.zoo.kernel_model import KernelModelZeroer
from zeroer.zoo.staging import RingOverrun, SingleBuffer, UnprotectedStaging
from zeroer.zoo.streams import CapturedStream, DeferredZero, SharedDeviceIds, SideStream
from zeroer.zoo.table import PackedOverrun, SharedKOnly, StaleTable

_CLASSES: tuple[type[ZooEntry], ...] = (
    SingleBuffer,
    RingOverrun,
    UnprotectedStaging,
    SharedDeviceIds,
    SideStream,
    CapturedStream,
    DeferredZero,
    Int32Offset,
    Int32Offset4GiB,
    RatioIgnored,
    LastChunkSkipped,
    PackedOverrun,
    SharedKOnly,
    StaleTable,
)
ENTRIES: dict[str, type[ZooEntry]] = {cls.name: cls for cls in sorted(_CLASSES, key=lambda c: c.name)}

__all__ = ["ENTRIES", "KernelModelZeroer", "ZooEntry", *(cls.__name__ for cls in _CLASSES)]
