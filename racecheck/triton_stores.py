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

    stored_params(add_one.fn)        # frozenset({'out_ptr'}): BLOCK is a constexpr
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
    """Parameters of the kernel function ``fn`` (``constexpr`` ones aside) that reach the pointer of
    a ``tl.store`` or atomic.

    A small data-flow reading of the source, statement by statement: a local name carries the
    parameters its last assignment was built from (inside a branch or a loop, those of every
    assignment so far), and a parameter counts when it reaches the first argument of a store. The
    happens-before checker then records the kernel as writing those tensors and only reading the
    others.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(inspect.signature(fn).parameters)  # unknown: every argument may be written
    func = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None)
    if func is None:
        return frozenset()
    params = {a.arg for a in func.args.args if not _is_constexpr(a.annotation)}
    reached: set[str] = set()

    def sources(expression: ast.AST, env: dict[str, set[str]]) -> set[str]:
        found: set[str] = set()
        for name in _pointer_names(expression):
            found |= env.get(name, {name} if name in params else set())
        return found

    def stores(node: ast.AST, env: dict[str, set[str]]) -> None:
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in _STORES:
                pointer = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "pointer"), None)
                if pointer is not None:
                    reached.update(sources(pointer, env))

    def walk(statements: list[ast.stmt], env: dict[str, set[str]], branch: bool) -> None:
        for statement in statements:
            if isinstance(statement, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
                for part in ("test", "iter", "items"):
                    if hasattr(statement, part):
                        stores(getattr(statement, part) if not isinstance(getattr(statement, part), list)
                               else ast.Tuple(elts=[i.context_expr for i in statement.items], ctx=ast.Load()), env)
                for block in ("body", "orelse", "finalbody"):
                    walk(getattr(statement, block, []), env, True)
                for handler in getattr(statement, "handlers", []):
                    walk(handler.body, env, True)
                continue
            stores(statement, env)
            if isinstance(statement, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and statement.value is not None:
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                value = sources(statement.value, env)
                for target in targets:
                    for name in (n.id for n in ast.walk(target) if isinstance(n, ast.Name)):
                        keep = branch or isinstance(statement, ast.AugAssign)
                        env[name] = (env.get(name, set()) | value) if keep else set(value)

    walk(func.body, {}, False)
    return frozenset(reached & params)


def _is_constexpr(annotation: ast.AST | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation)
    return text == "constexpr" or text.endswith(".constexpr")


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


@functools.lru_cache(maxsize=None)
def address_tables(fn: Any) -> tuple[frozenset[str], bool]:
    """The parameters the kernel ``fn`` loads addresses, sizes or bounds from, and whether any
    value that steers it is loaded through a loaded address (a table of tables).

    A parameter is a table when a value loaded through it reaches the pointer of a load or a
    store, a ``mask=``, a loop's range or a ``while``/``if`` test: vLLM's ``_swap_blocks_kernel``
    loads ``src``/``dst`` from ``src_addrs``/``dst_addrs`` and its bound from ``sizes``, all three
    tables. What the kernel then touches follows from the tables' values (a kernel that goes
    through no table touches only its arguments' memory). Unreadable source: no tables, not deeper.

    Example::

        address_tables(_swap_blocks_kernel.fn)   # (frozenset({'src_addrs', 'dst_addrs', 'sizes'}), False)
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(), False
    func = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None)
    if func is None:
        return frozenset(), False
    params = {a.arg for a in func.args.args if not _is_constexpr(a.annotation)}
    # A name's tokens: "p:P" (its value is built from parameter P itself), "l:P" (loaded through a
    # pointer built from P), "deep" (loaded through a loaded pointer).
    steering: set[str] = set()

    def tokens(expression: ast.AST, env: dict[str, set[str]]) -> set[str]:
        if isinstance(expression, ast.Call) and isinstance(expression.func, ast.Attribute) \
                and expression.func.attr == "load":
            pointer = expression.args[0] if expression.args else next(
                (k.value for k in expression.keywords if k.arg == "pointer"), None)
            inner = tokens(pointer, env) if pointer is not None else set()
            loaded = {f"l:{t[2:]}" for t in inner if t.startswith("p:")}
            return loaded | ({"deep"} if any(t.startswith("l:") or t == "deep" for t in inner) else set())
        if isinstance(expression, ast.Name):
            return set(env.get(expression.id, {f"p:{expression.id}"} if expression.id in params else set()))
        found: set[str] = set()
        for child in ast.iter_child_nodes(expression):
            found |= tokens(child, env)
        return found

    def sink(expression: ast.AST | None, env: dict[str, set[str]]) -> None:
        if expression is not None:
            steering.update(t for t in tokens(expression, env) if not t.startswith("p:"))

    def sinks(node: ast.AST, env: dict[str, set[str]]) -> None:
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in _STORES | {"load"}:
                sink(call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "pointer"), None), env)
                sink(next((k.value for k in call.keywords if k.arg == "mask"), None), env)

    def walk(statements: list[ast.stmt], env: dict[str, set[str]]) -> None:
        for statement in statements:
            if isinstance(statement, (ast.For, ast.While, ast.If)):
                steer = statement.iter if isinstance(statement, ast.For) else statement.test
                sinks(steer, env)
                sink(steer, env)
                if isinstance(statement, ast.For):
                    for name in (n.id for n in ast.walk(statement.target) if isinstance(n, ast.Name)):
                        env[name] = env.get(name, set()) | tokens(statement.iter, env)
                for _ in range(2):  # a loop's later iterations see its body's assignments
                    walk(statement.body, env)
                walk(statement.orelse, env)
                continue
            if isinstance(statement, (ast.With, ast.Try)):
                for block in ("body", "orelse", "finalbody"):
                    walk(getattr(statement, block, []), env)
                continue
            sinks(statement, env)
            if isinstance(statement, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and statement.value is not None:
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                value = tokens(statement.value, env)
                for target in targets:
                    for name in (n.id for n in ast.walk(target) if isinstance(n, ast.Name)):
                        env[name] = env.get(name, set()) | value  # flow-insensitive: never fewer tables

    walk(func.body, {})
    return frozenset(t[2:] for t in steering if t.startswith("l:")) & frozenset(params), "deep" in steering
