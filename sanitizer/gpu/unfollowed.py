"""Something a program did that the GPU observer cannot follow, and where (one line, and the run is partial)."""

from __future__ import annotations

from dataclasses import dataclass

from sanitizer.sites import Site


@dataclass
class Unfollowed:
    """Something the program did that the sanitizer cannot follow, and where."""

    what: str
    site: Site

    def message(self) -> str:
        return f"kvz-sanitize cannot follow {self.what} at {self.site}"


__all__ = ["Unfollowed"]
