"""graph_ring's protocol with one rule broken each, for tests/test_direct.py: the fuzzer must find
every one on the simulator, which is what makes its clean campaigns mean something.
Loaded by path (``tests/graph_ring_mutants.py:NAME``), as ``--zeroer`` loads an outside design.
"""

from __future__ import annotations

from zeroer.designs.modelled_graph_ring import ModelledGraphRing


class ReusesBusySlots(ModelledGraphRing):
    """Takes the next slot without asking its event: the host rewrites ids a queued copy reads (#48085)."""

    def _done(self, slot) -> bool:
        return True


class KeepsStaleGraphs(ModelledGraphRing):
    """Keeps its graphs when the cache moves: they zero the old cache's pages."""

    def _retarget(self, table) -> None:
        self._table = table


class SkipsPadding(ModelledGraphRing):
    """Stages the ids without the -1 padding: the graph also zeroes the ids a longer call left."""

    def _stage(self, slot, ids) -> None:
        self.rt.write_host(slot.host, ids)
