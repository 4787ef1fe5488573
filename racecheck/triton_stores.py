"""Which arguments of a Triton kernel it writes: those that reach the pointer of a ``tl.store``.

A launch is one op to the happens-before checker, which must know what it reads and what it
writes. A kernel's source says it: a parameter is written when its name, directly or through
local assignments, reaches the pointer argument of a ``tl.store`` or an atomic. An address loaded
from a table (vLLM's zeroer writes through ``seg_addrs``) writes elsewhere, not through the table,
so ``tl.load(...)`` stops the flow. A kernel whose source cannot be read writes every argument.

Example::

    @triton.jit
    def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs) + 1, mask=offs < n)

    stored_params(add_one.fn)        # frozenset({'out_ptr'})
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

_STORES = {"store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min", "atomic_and",
           "atomic_or", "atomic_xor", "atomic_sub"}


@functools.lru_cache(maxsize=None)
def stored_params(fn: Any) -> frozenset[str]:
    """Parameters of the kernel function ``fn`` that reach the pointer of a ``tl.store`` or atomic.

    A small data-flow reading of the source: a parameter counts when its name, directly or
    through local assignments, appears in the first argument of such a call. The happens-before
    checker then records the kernel as writing those tensors and only reading the others.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(inspect.signature(fn).parameters)  # unknown: every argument may be written
    func = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None)
    if func is None:
        return frozenset()
    params = {a.arg for a in func.args.args}
    flows: dict[str, set[str]] = {}
    reached: set[str] = set()
    for node in ast.walk(func):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            sources = _pointer_names(node.value) if node.value is not None else set()
            for target in targets:
                for name in (n.id for n in ast.walk(target) if isinstance(n, ast.Name)):
                    flows.setdefault(name, set()).update(sources)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _STORES:
            pointer = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "pointer"), None)
            if pointer is not None:
                reached.update(_pointer_names(pointer))
    frontier = list(reached)
    while frontier:
        for source in flows.get(frontier.pop(), ()):
            if source not in reached:
                reached.add(source)
                frontier.append(source)
    return frozenset(reached & params)


def _pointer_names(expression: ast.AST) -> set[str]:
    """Names whose pointer value ``expression`` may carry: a ``tl.load(...)`` yields data read
    through its argument, not that pointer (an address loaded from a table writes elsewhere)."""
    names: set[str] = set()
    stack = [expression]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("load", "atomic_add", "atomic_cas"):
            continue
        if isinstance(node, ast.Name):
            names.add(node.id)
        stack.extend(ast.iter_child_nodes(node))
    return names
