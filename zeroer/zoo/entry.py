"""What every zoo entry declares besides its bug: where the bug shows and how to show it.

A zoo entry is a zeroer class with one real bug (its ``capabilities`` come from the design it
breaks: :mod:`zeroer.protocol`). Besides ``zero_block_ids`` it carries data the
detection run (``python -m fuzz.bench.detect``), ``pytest fuzz --zeroer zoo.NAME`` and the tests use:

* ``name``: its registered name, ``zoo.<bug>``;
* ``geometry``: the KV-cache preset on which the bug can show (``zeroer.cache.geometries``);
* ``upstream``: the vLLM issue or PR it is modelled on, in a few words;
* ``scenario``: a short hand-written program of op records (``fuzz.engine.episode``) on which it
  misbehaves and every race-free design does not (``tests/test_zoo.py``).

Example::

    from zeroer.zoo import ENTRIES
    entry = ENTRIES["zoo.single_buffer"]
    entry.geometry, entry.scenario[1]      # ('tiny', {'op': 'allocate', 'n': 1, 'stream': 0})
"""

from __future__ import annotations

from typing import ClassVar


class ZooEntry:
    """Mixin with the declarations above; see the module docstring."""

    name: ClassVar[str] = "zoo.?"
    geometry: ClassVar[str] = "tiny"
    upstream: ClassVar[str] = ""
    scenario: ClassVar[tuple[dict, ...]] = ()


def start(in_flight: int = 1) -> dict:
    return {"op": "start", "in_flight": in_flight}


def allocate(n: int = 1, stream: int = 0) -> dict:
    return {"op": "allocate", "n": n, "stream": stream}


def write(block: int, stream: int = 0) -> dict:
    return {"op": "write", "block": block, "stream": stream}


def advance(stream: int, ops: int) -> dict:
    return {"op": "advance", "stream": stream, "ops": ops}
