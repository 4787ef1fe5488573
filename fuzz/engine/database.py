"""The example database a campaign saves its failing and interesting examples in.

``--fuzz-db`` names it: a directory (Hypothesis's ``DirectoryBasedExampleDatabase``; every
campaign keys its examples by its own id, so one directory serves them all).

Example::

    example_database(".hypothesis/fuzz-db")
"""

from __future__ import annotations

from pathlib import Path

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase


def example_database(spec: str) -> ExampleDatabase:
    return DirectoryBasedExampleDatabase(str(Path(spec)))
