"""The import rules of docs/architecture.md, enforced: each package imports only the layers below it.

Every module of ``racecheck``, ``kvdevice``, ``zeroer``, ``fuzz``, ``repro`` and ``sanitizer`` is read (imports inside functions included) and
each project import is checked against :data:`RULES`, which docs/architecture.md shows as its
table (a test checks the two agree).

It also holds the rules for ``docs/data/`` (docs/results.md, "Data files"): every file there is
cited by a docs page and named for what it measures and when.
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("racecheck", "kvdevice", "zeroer", "fuzz", "repro", "sanitizer")

# unit -> the units it may import (besides itself and its own submodules). A unit is the most
# specific prefix listed here that names a module.
RULES: dict[str, tuple[str, ...]] = {
    "racecheck": (),
    "kvdevice.origin": ("racecheck",),
    "kvdevice.triton_cpu": (),
    "kvdevice.runtime": ("racecheck",),
    "kvdevice.intercept": ("racecheck", "kvdevice.runtime", "kvdevice.triton_cpu", "kvdevice.origin"),
    "zeroer.errors": ("racecheck",),
    "zeroer.id_containers": ("zeroer.errors",),
    "zeroer.cache": ("zeroer.errors",),
    "zeroer.runtime": ("kvdevice.runtime",),
    "zeroer.protocol": ("zeroer.errors", "zeroer.cache", "zeroer.id_containers"),
    "zeroer.kernel": ("zeroer.errors", "zeroer.cache"),
    "zeroer.offload": ("zeroer.errors", "zeroer.cache", "zeroer.id_containers", "zeroer.protocol"),
    "zeroer.designs": ("zeroer.errors", "zeroer.cache", "kvdevice.runtime", "zeroer.kernel", "zeroer.protocol"),
    "zeroer.zoo": ("zeroer.errors", "zeroer.cache", "kvdevice.runtime", "zeroer.kernel", "zeroer.protocol",
                   "zeroer.designs"),
    "zeroer.bind": ("zeroer.errors", "zeroer.cache", "zeroer.protocol", "zeroer.offload", "kvdevice.runtime",
                    "kvdevice.intercept", "kvdevice.origin"),
    "zeroer.registry": ("zeroer.errors", "zeroer.cache", "zeroer.protocol", "zeroer.designs", "zeroer.zoo",
                        "zeroer.bind", "zeroer.offload", "kvdevice.runtime"),
    "zeroer.engine_loop": ("racecheck", "zeroer.cache", "zeroer.protocol", "zeroer.registry"),
    "fuzz.engine": ("racecheck", "kvdevice", "zeroer"),
    "fuzz.trace": ("racecheck", "kvdevice", "zeroer", "fuzz.engine"),
    "fuzz.timeline": ("racecheck", "kvdevice", "zeroer", "fuzz.engine", "fuzz.trace"),
    "fuzz.plugin": ("racecheck", "kvdevice", "zeroer", "fuzz"),
    "fuzz.bench": ("racecheck", "kvdevice", "zeroer", "fuzz"),
    "fuzz": ("racecheck", "kvdevice", "zeroer", "fuzz"),
    "repro": ("racecheck", "kvdevice", "zeroer", "fuzz", "repro"),
    "sanitizer": ("racecheck", "kvdevice", "sanitizer"),
}
# What no module of a package may import, whatever the rules above allow.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "racecheck": ("kvdevice", "zeroer", "fuzz", "repro", "sanitizer"),
    "kvdevice": ("zeroer", "fuzz", "repro", "sanitizer"),
    "zeroer": ("fuzz", "repro", "sanitizer"),
    "fuzz": ("repro", "sanitizer"),
    "repro": ("sanitizer",),
    "sanitizer": ("zeroer", "fuzz", "repro"),
}


def unit_of(module: str) -> str:
    return max((u for u in RULES if module == u or module.startswith(u + ".")), key=len)


def allowed(importer: str, imported: str) -> bool:
    unit = unit_of(importer)
    if imported == unit or imported.startswith(unit + "."):
        return True
    for package, banned in FORBIDDEN.items():
        if importer.split(".")[0] == package and any(imported == b or imported.startswith(b + ".") for b in banned):
            return False
    return any(imported == a or imported.startswith(a + ".") for a in RULES[unit])


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


MODULES = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                 if "cases" not in p.parts and "failures" not in p.parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_module_imports_only_what_its_layer_allows(path):
    importer = module_name(path)
    bad = [f"line {line}: {name}" for line, name in project_imports(path) if not allowed(importer, name)]
    assert not bad, f"{importer} ({unit_of(importer)}) may import {RULES[unit_of(importer)]}, but imports " + ", ".join(bad)


def test_the_rules_are_the_table_in_docs_architecture():
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| `([\w.]+)` \| ([^|]*) \|", text, re.MULTILINE))
    documented = {unit: tuple(re.findall(r"`([\w.]+)`", cell)) for unit, cell in rows.items()}
    assert documented == RULES


def module_graph() -> dict[str, set[str]]:
    """Each project module and the project modules it imports: every import statement counts, at
    the top or inside a function or an ``if TYPE_CHECKING:`` (a deferred import is still a circle)."""
    names = {module_name(path): path for path in MODULES}

    def resolve(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in names.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.update(resolve(f"{node.module}.{alias.name}") or resolve(node.module) for alias in node.names)
        graph[module] = {d for d in deps if d is not None and d != module}
    return graph


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (its modules, the first repeated at the end), or []."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as error:
        return list(error.args[1])
    return []


def test_the_circle_finder_finds_a_circle_through_a_deferred_import():
    assert circle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    found = circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert found[0] == found[-1] and set(found) == {"a", "b", "c"}


def test_no_module_imports_itself_through_others():
    found = circle(module_graph())
    assert not found, f"an import circle: {' -> '.join(found)}; move what both sides need into a module below both"


def test_nothing_relative_imports_across_packages():
    for path in MODULES:
        tree = ast.parse(path.read_text())
        relative = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0]
        assert not relative, f"{path.relative_to(ROOT)}: relative import at lines {relative}"


# -- docs/data: what a results file is named and where it is cited (docs/results.md, "Data files") --

DATA = ROOT / "docs" / "data"
# MACHINE-WHAT-YYYY-MM.EXT, lower case, words joined by "-".
DATA_NAME = re.compile(r"[a-z0-9]+(-[a-z0-9]+)+-20\d\d-(0[1-9]|1[0-2])\.[a-z0-9]+")
# Words that say how the work was organised, not what a file measures.
ORGANISATIONAL = re.compile(r"session|part\d*|final|explore|exploration|hunt|new|old|tmp|temp|wip|draft|scratch"
                            r"|misc|attempt\d*|try\d*")


def data_files() -> list[Path]:
    return sorted(p for p in DATA.rglob("*") if p.is_file())


def docs_text() -> str:
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def test_every_data_file_is_cited_by_a_docs_page():
    text = docs_text()
    uncited = [p.relative_to(ROOT).as_posix() for p in data_files()
               if not re.search(r"(?<![\w.-])" + re.escape(p.name) + r"(?![\w-])", text)]
    assert data_files(), "docs/data is empty or missing"
    assert not uncited, (
        f"not cited by name in docs/*.md or README.md: {uncited}; cite each where its figures are shown, "
        "saying what it is, or remove it (git history keeps it)")


def test_every_data_file_is_named_for_what_it_measures_and_when():
    badly_named = [p.name for p in data_files() if not DATA_NAME.fullmatch(p.name)]
    assert not badly_named, f"docs/data files not named MACHINE-WHAT-YYYY-MM.EXT (docs/results.md): {badly_named}"
    organisational = [p.name for p in data_files()
                      if "session" in p.name.lower()
                      or any(ORGANISATIONAL.fullmatch(word) for word in re.split(r"[-.]", p.name.lower()))]
    assert not organisational, f"docs/data files named after how the work was organised: {organisational}"


def test_the_runtime_keeps_the_name_the_zeroer_api_gave_it():
    """The runtime is the device layer's (kvdevice.runtime); a runtime-API zeroer that imports it as
    zeroer.runtime (docs/zeroer-api.md, docs/runtime.md) gets the same objects."""
    import kvdevice.runtime
    import zeroer.runtime

    assert sorted(zeroer.runtime.__all__) == sorted(kvdevice.runtime.__all__)
    assert all(getattr(zeroer.runtime, name) is getattr(kvdevice.runtime, name) for name in kvdevice.runtime.__all__)


def test_raw_address_runs_are_placed_by_one_module_with_one_record():
    """Bytes placed in a memory are racecheck.placement's ``Placed``, resolved by its ``place``: the
    five records and the doubled helpers each tool once wrote for it stay gone (issue 52), and so do
    the two readings of a Triton kernel's source (racecheck.triton_stores.kernel_flow is one)."""
    gone = re.compile(r"^\s*(?:class (Touch|Span|_Key|RawDevice|Place)\b|def (_host_extents|stored_params"
                      r"|address_tables)\b)", re.MULTILINE)
    found = [f"{p.relative_to(ROOT)}: {''.join(m.groups(''))}" for p in MODULES for m in gone.finditer(p.read_text())]
    assert not found, f"write these with racecheck.placement (Placed, place) or kernel_flow instead: {found}"
