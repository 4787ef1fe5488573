"""Something a program did that the GPU observer cannot follow, and where (one line, and the run is partial)."""

from __future__ import annotations

from sanitizer.sites import Site


class Unfollowed:
    """Something the program did that the sanitizer cannot follow, and where."""

    def __init__(self, what: str, site: Site) -> None:
        self.what, self.site = what, site

    def message(self) -> str:
        return f"kvz-sanitize cannot follow {self.what} at {self.site}"


__all__ = ["Unfollowed"]
