"""Where a torch call was made (sanitizer/sites.py): the program's innermost frame above the hooks,
torch's and the sanitizer's frames skipped, and a directory counted as plumbing later taken at its word."""

from __future__ import annotations

import os

import torch

from sanitizer import sites
from sanitizer.sites import also_skip, caller_site


def _through_torch(call):
    """``call`` run below six frames of a file inside torch's package directory (plumbing)."""
    ns: dict = {}
    source = "def wrap(f, n):\n    if n == 0:\n        return f()\n    return wrap(f, n - 1)\n"
    exec(compile(source, os.path.join(os.path.dirname(torch.__file__), "kvz_test_plumbing.py"), "exec"), ns)
    return ns["wrap"](call, 6)


def test_the_site_is_the_programs_line_above_the_plumbing():
    for _ in range(2):  # decided on the first walk, remembered on the second
        site = _through_torch(caller_site)
        assert (site.function, site.line) == ("_through_torch", _through_torch.__code__.co_firstlineno + 5)


def test_a_directory_skipped_later_is_skipped_by_the_next_walk(tmp_path, monkeypatch):
    program = tmp_path / "helper.py"
    program.write_text("def helper(f):\n    return f()\n")
    ns: dict = {}
    exec(compile(program.read_text(), str(program), "exec"), ns)
    assert ns["helper"](caller_site).function == "helper"  # the program's own frame, decided and remembered
    monkeypatch.setattr(sites, "_ALSO", list(sites._ALSO))
    also_skip(tmp_path)
    try:
        assert ns["helper"](caller_site).function == "test_a_directory_skipped_later_is_skipped_by_the_next_walk"
    finally:
        sites._LIBRARY.clear()  # the answers under the patched list go with it
