"""What a Triton kernel's source says of its arguments: which it writes, which are address tables.

A launch is one op to the happens-before checker, which must know what it reads and what it
writes. A kernel's source says it: a parameter is written when its name, directly or through
local assignments, reaches the pointer argument of a ``tl.store`` or an atomic. An address loaded
from a table (vLLM's zeroer writes through ``seg_addrs``) writes elsewhere, not through the table,
so ``tl.load(...)`` stops the flow. A kernel whose source cannot be read writes every argument.
What it touches through such a table follows from the table's values: the same reading of the
source names the tables (:func:`kernel_flow`, one pass for both).

Example::

    @triton.jit
    def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs) + 1, mask=offs < n)

    kernel_flow(add_one.fn).stored   # frozenset({'out_ptr'}): BLOCK is a constexpr
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
import types
from typing import Any, NamedTuple

_STORES = {"store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min", "atomic_and",
           "atomic_or", "atomic_xor", "atomic_sub"}


class KernelFlow(NamedTuple):
    """What a kernel's source says of its parameters (``constexpr`` ones aside)."""

    stored: frozenset[str]  # those that reach the pointer of a ``tl.store`` or atomic: the tensors it writes
    tables: frozenset[str]  # those it loads addresses, sizes or bounds from (address tables)
    deeper: bool  # a value that steers it is loaded through a loaded address (a table of tables)
    # Whether this reading saw all the kernel does: it calls only Triton's language and helpers,
    # Python's builtins and its values' methods (a ``@triton.jit`` helper's loads and stores are
    # not read here), so what it loads from an argument that is no table steers nothing.
    closed: bool = False


@functools.lru_cache(maxsize=None)
def kernel_flow(fn: Any) -> KernelFlow:
    """One reading of the kernel function ``fn``'s source, statement by statement, for what it
    stores through and what it loads through tables.

    *Stores*: a local name carries the parameters its last assignment was built from (inside a
    branch or a loop, those of every assignment so far), and a parameter counts when it reaches the
    first argument of a store. The happens-before checker then records the kernel as writing those
    tensors and only reading the others.

    *Tables*: a parameter is a table when a value loaded through it reaches the pointer of a load
    or a store, a ``mask=``, a loop's range or a ``while``/``if`` test: vLLM's
    ``_swap_blocks_kernel`` loads ``src``/``dst`` from ``src_addrs``/``dst_addrs`` and its bound
    from ``sizes``, all three tables. What the kernel then touches follows from the tables' values
    (a kernel that goes through no table touches only its arguments' memory). This reading is
    flow-insensitive (a name keeps every table it was ever built from: never fewer tables), and a
    loop's or branch's body is read twice, as its later iterations see its own assignments.

    Unreadable source: every argument may be written, no tables, not deeper.

    Example::

        kernel_flow(_swap_blocks_kernel.fn).tables   # frozenset({'src_addrs', 'dst_addrs', 'sizes'})
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return KernelFlow(frozenset(inspect.signature(fn).parameters), frozenset(), False)
    func = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None)
    if func is None:
        return KernelFlow(frozenset(), frozenset(), False)
    params = {a.arg for a in func.args.args if not _is_constexpr(a.annotation)}
    reached: set[str] = set()
    # A name's tokens for tables: "p:P" (its value is built from parameter P itself), "l:P" (loaded
    # through a pointer built from P), "deep" (loaded through a loaded pointer).
    steering: set[str] = set()
    Env = dict[str, set[str]]

    def sources(expression: ast.AST, env: Env) -> set[str]:
        """The parameters whose pointer ``expression`` may carry: a ``tl.load(...)`` (or an atomic's
        result) is data read through its argument, not that pointer (a loaded address writes elsewhere)."""
        if isinstance(expression, ast.Call) and isinstance(expression.func, ast.Attribute) \
                and expression.func.attr in ("load", "atomic_add", "atomic_cas"):
            return set()
        if isinstance(expression, ast.Name):
            return set(env.get(expression.id, {expression.id} if expression.id in params else set()))
        return set().union(*(sources(child, env) for child in ast.iter_child_nodes(expression)))

    def tokens(expression: ast.AST, env: Env) -> set[str]:
        if isinstance(expression, ast.Call) and isinstance(expression.func, ast.Attribute) \
                and expression.func.attr == "load":
            pointer = _pointer(expression)
            inner = tokens(pointer, env) if pointer is not None else set()
            loaded = {f"l:{t[2:]}" for t in inner if t.startswith("p:")}
            return loaded | ({"deep"} if any(t.startswith("l:") or t == "deep" for t in inner) else set())
        if isinstance(expression, ast.Name):
            return set(env.get(expression.id, {f"p:{expression.id}"} if expression.id in params else set()))
        return set().union(*(tokens(child, env) for child in ast.iter_child_nodes(expression)))

    def sink(expression: ast.AST | None, env: Env) -> None:
        if expression is not None:
            steering.update(t for t in tokens(expression, env) if not t.startswith("p:"))

    def calls(node: ast.AST, stores: Env | None, tables: Env | None) -> None:
        """The stores (into ``stores``' reading) and the loads and stores (into ``tables``') of ``node``."""
        for call in ast.walk(node):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                continue
            if stores is not None and call.func.attr in _STORES and (pointer := _pointer(call)) is not None:
                reached.update(sources(pointer, stores))
            if tables is not None and call.func.attr in _STORES | {"load"}:
                sink(_pointer(call), tables)
                sink(_mask(call), tables)

    def walk(statements: list[ast.stmt], stores: Env | None, tables: Env | None, branch: bool) -> None:
        """``stores``/``tables``: each reading's names so far (None: that reading skips these statements)."""
        for statement in statements:
            if isinstance(statement, (ast.For, ast.While, ast.If)):
                steer = statement.iter if isinstance(statement, ast.For) else statement.test
                calls(steer, stores, tables)
                if tables is not None:
                    sink(steer, tables)
                    if isinstance(statement, ast.For):
                        for name in (n.id for n in ast.walk(statement.target) if isinstance(n, ast.Name)):
                            tables[name] = tables.get(name, set()) | tokens(statement.iter, tables)
                walk(statement.body, stores, tables, True)
                if tables is not None:  # a loop's later iterations see its body's assignments
                    walk(statement.body, None, tables, True)
                walk(statement.orelse, stores, tables, True)
                continue
            if isinstance(statement, (ast.With, ast.Try)):
                if isinstance(statement, ast.With) and stores is not None:
                    calls(ast.Tuple(elts=[i.context_expr for i in statement.items], ctx=ast.Load()), stores, None)
                for block in ("body", "orelse", "finalbody"):
                    walk(getattr(statement, block, []), stores, tables, True)
                for handler in getattr(statement, "handlers", []):
                    walk(handler.body, stores, None, True)
                continue
            calls(statement, stores, tables)
            if isinstance(statement, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and statement.value is not None:
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                names = [n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)]
                if stores is not None:
                    value = sources(statement.value, stores)
                    keep = branch or isinstance(statement, ast.AugAssign)
                    for name in names:
                        stores[name] = (stores.get(name, set()) | value) if keep else set(value)
                if tables is not None:
                    value = tokens(statement.value, tables)
                    for name in names:
                        tables[name] = tables.get(name, set()) | value  # flow-insensitive: never fewer tables

    walk(func.body, {}, {}, False)
    return KernelFlow(frozenset(reached & params), frozenset(t[2:] for t in steering if t.startswith("l:")) & frozenset(params),
                      "deep" in steering, _closed(func, fn, params))


def _mask(call: ast.Call) -> ast.AST | None:
    """The mask of a load (``tl.load(pointer, mask, other)``), a store or an atomic (``tl.store(pointer,
    value, mask)``), by keyword or by position."""
    given = next((k.value for k in call.keywords if k.arg == "mask"), None)
    if given is not None:
        return given
    at = 1 if call.func.attr == "load" else None if call.func.attr == "atomic_cas" else 2  # type: ignore[attr-defined]
    return call.args[at] if at is not None and len(call.args) > at else None


def _closed(func: ast.FunctionDef, fn: Any, params: set[str]) -> bool:
    """Whether every call in the kernel's source is to Triton's language or helpers (``tl.load``,
    ``tl.math.exp``, ``triton.cdiv``), to a Python builtin, or a method of one of its own values
    (``x.to(...)``, a descriptor's ``load``): nothing it does lies in source this reading skips."""
    scope = getattr(fn, "__globals__", {})
    local = params | {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for call in (n for n in ast.walk(func) if isinstance(n, ast.Call)):
        callee = call.func
        if isinstance(callee, ast.Name):
            if callee.id in local or callee.id in scope or not hasattr(builtins, callee.id):
                return False  # a helper (a @triton.jit function), or a name bound to one
            continue
        while isinstance(callee, ast.Attribute):
            callee = callee.value
        if isinstance(callee, ast.Call):
            continue  # a method of a call's result (tl.load(p).to(...)): the inner call is checked on its own
        if not isinstance(callee, ast.Name):
            return False
        if callee.id in local:
            continue  # a method of one of the kernel's values
        owner = scope.get(callee.id)
        name = getattr(owner, "__name__", "") if isinstance(owner, types.ModuleType) else ""
        if name != "triton" and not name.startswith("triton.language"):
            return False
    return True


def _pointer(call: ast.Call) -> ast.AST | None:
    """The pointer argument of a load, a store or an atomic."""
    return call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "pointer"), None)


def _is_constexpr(annotation: ast.AST | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation)
    return text == "constexpr" or text.endswith(".constexpr")
