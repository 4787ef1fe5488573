"""CUDA copies issued around torch (NVIDIA's bindings, ctypes), followed as ops of the session.

Engines move KV blocks with the driver itself: vLLM's SimpleCPUOffload resolves
``cuMemcpyBatchAsync`` with ``cuda.bindings.driver.cuGetProcAddress``, wraps the pointer in a
``ctypes.CFUNCTYPE`` and calls it with numpy arrays of raw addresses (``data_ptr()`` plus block
times bytes per block), an attributes struct and ``stream.cuda_stream``. While a tool runs the
code (the simulator, or CUDA's controlled mode), these entry points are followed:

===========================================  =================================================
the code calls                               what it gets
===========================================  =================================================
``driver.cuGetProcAddress(b"cuMemcpyBatchAsync" / b"cuMemcpyAsync", v, f)``  ``(CUDA_SUCCESS, pointer, CU_GET_PROC_ADDRESS_SUCCESS)``:
                                             a real C function pointer (``CFUNCTYPE(...)(impl)``) whose calls land here
``driver.cuMemcpyAsync(dst, src, n, stream)``   followed, ``(CUDA_SUCCESS,)``
``runtime.cudaMemcpyAsync(dst, src, n, kind, stream)``  followed, ``(cudaSuccess,)``
``ctypes.CDLL("libcuda.so.1")`` / ``("libcudart.so")``  a library whose ``cuMemcpyBatchAsync``, ``cuMemcpyAsync`` and
                                             ``cudaMemcpyAsync`` are followed pointers; any other symbol is refused by name
===========================================  =================================================

Each (address, size) run is resolved to the memory it falls in: a device block of the simulator (the
KV cache's blocks for an offloader, by :class:`~zeroer.cache.block_map.CacheBlockMap`), a pinned
or registered host region; the call becomes one queued op on the stream its raw handle names
(:meth:`~kvdevice.intercept.cuda_api.CudaApi.from_handle`; 0 is the default stream) that declares
what it reads and writes, exactly as a ``copy_`` does. On the simulator the op moves the bytes
when the stream reaches it; on CUDA it is the real entry point, issued behind the op's gate.
``srcAccessOrder`` (``CUmemcpyAttributes``): ``STREAM`` reads the source in stream order;
``DURING_API_CALL`` reads it during the call (the simulator takes its bytes then); ``ANY`` may
read it any time until the copy completes (the simulator reads it when the stream gets there).
The checker takes each source read as a stream-ordered read: a read CUDA may make earlier is not
checked earlier (a miss, never a false race).

An address in no memory the harness knows (pageable memory, a wild pointer), a stream handle it did
not hand out, or any other entry point is :class:`~kvdevice.intercept.errors.InterceptError` naming
the call. A ``CFUNCTYPE`` callback cannot raise into its C caller: there the error is kept, the
call returns ``CUDA_ERROR_INVALID_VALUE``, and the session raises it at its next boundary
(:meth:`DriverCopies.raise_kept`); a program session reports it as a line it could not follow.

Example (inside an intercepted call)::

    err, ptr, _ = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
    batch = BATCH_TYPE(ptr)                     # the engine's own CFUNCTYPE
    batch(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, ctypes.addressof(attrs),
          ctypes.byref(idx), 1, ctypes.byref(fail), stream.cuda_stream)   # one queued op, checked
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils._mode_utils import no_dispatch

from kvdevice.intercept.driver_context import in_context, program_context
from kvdevice.intercept.errors import InterceptError, unroutable
from racecheck.placement import Placed, by_memory, place
from racecheck.ranges import merge

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NOT_FOUND = 500
SIZE_MAX = 2**64 - 1  # cuMemcpyBatchAsync's failIdx for an error of no one copy
#: CUmemcpySrcAccessOrder
SRC_ACCESS_ORDERS = {1: "STREAM", 2: "DURING_API_CALL", 3: "ANY"}
#: cudaMemcpyKind, for the runtime's cudaMemcpyAsync (4: cudaMemcpyDefault, by address)
MEMCPY_KINDS = (0, 1, 2, 3, 4)

BATCH_TYPE = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
MEMCPY_TYPE = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
CUDART_MEMCPY_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_void_p)


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (cuda.h), as the engines declare it for ``cuMemcpyBatchAsync``."""

    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


def host_view(placed: Placed) -> torch.Tensor:
    """The bytes of ``placed`` (one run of host memory) as a CPU tensor: what the pinned-memory
    watch snapshots and compares."""
    with torch._C.DisableTorchFunction(), no_dispatch():
        return torch.frombuffer((ctypes.c_uint8 * (placed.end - placed.start)).from_address(placed.start),
                                dtype=torch.uint8)


# -- the process's followed entry points -------------------------------------------------------------
# Engines resolve an entry point once and keep it in a module global (vLLM's ``_batch_memcpy``), so a
# pointer handed out must stay valid for the process and reach whichever session runs the code now.
_ACTIVE: list["DriverCopies"] = []
_LOCK = threading.Lock()


class Follower(Protocol):
    """What takes the calls through the followed pointers while it is active: the fuzzer's and the
    simulator's :class:`DriverCopies`, the GPU sanitizer's :class:`sanitizer.gpu.driver.DriverCalls`."""

    def from_c(self, symbol: str, impl: Callable[..., int], args: tuple) -> int: ...

    def copy(self, call: str, runs: list[tuple[int, int, int, str]], handle: int, real: Any) -> None: ...


def active() -> "Follower | None":
    return _ACTIVE[-1] if _ACTIVE else None


def all_active() -> list["Follower"]:
    """Every session's followed copies active now, innermost last (the innermost takes the calls)."""
    return list(_ACTIVE)


@contextlib.contextmanager
def following(follower: "Follower") -> Iterator[None]:
    """Inside, calls through the followed pointers (from any thread) go to ``follower``."""
    _ACTIVE.append(follower)  # type: ignore[arg-type]
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            _ACTIVE.remove(follower)  # type: ignore[arg-type]


def _entry(symbol: str, impl: Callable[..., int]) -> Callable[..., int]:
    def call(*args: Any) -> int:
        copies = active()
        if copies is None:  # outside every tool's call: the program's own call, as it would run
            return call_real(symbol, args)
        return copies.from_c(symbol, impl, args)

    return call


def call_real(symbol: str, args: tuple) -> int:
    """A call through ``symbol``'s followed pointer while no tool follows it (the fuzzer's
    free-running mode, after a controlled campaign resolved it; the engine keeps the pointer in a
    module global): the real entry point, in the program's context. Where none was resolved (the
    simulator's machine has no driver), ``CUDA_ERROR_NOT_INITIALIZED``, as a driver never initialised."""
    real = _REAL.get(symbol)
    if real is None:
        return CUDA_ERROR_NOT_INITIALIZED
    with in_context(program_context(int(args[STREAM_ARG[symbol]] or 0))):
        return int(real(*args))


def batch_runs(dsts: int, srcs: int, sizes: int, count: int, attrs: int, attrs_idxs: int,
               num_attrs: int) -> list[tuple[int, int, int, str]] | None:
    """``cuMemcpyBatchAsync``'s arguments as (dst, src, bytes, source order) runs, one per copy (each
    copy takes the attributes of the last ``attrsIdxs`` entry at or before it); None where CUDA
    answers ``CUDA_ERROR_INVALID_VALUE``."""
    if count == 0 or num_attrs == 0 or num_attrs > count or not (dsts and srcs and sizes and attrs and attrs_idxs):
        return None  # CUDA's answer: every copy needs attributes
    dst = (ctypes.c_uint64 * count).from_address(dsts)
    src = (ctypes.c_uint64 * count).from_address(srcs)
    size = (ctypes.c_size_t * count).from_address(sizes)
    entries = (MemcpyAttributes * num_attrs).from_address(attrs)
    firsts = list((ctypes.c_size_t * num_attrs).from_address(attrs_idxs))
    if firsts[0] != 0 or any(b <= a for a, b in zip(firsts, firsts[1:])) or firsts[-1] >= count:
        return None
    orders = []
    for j, entry in enumerate(entries):
        if entry.srcAccessOrder not in SRC_ACCESS_ORDERS:
            return None
        last = firsts[j + 1] if j + 1 < num_attrs else count
        orders += [SRC_ACCESS_ORDERS[entry.srcAccessOrder]] * (last - firsts[j])
    return [(int(dst[i]), int(src[i]), int(size[i]), orders[i]) for i in range(count)]


def set_fail_index(fail_idx: int, index: int) -> None:
    """``*failIdx = index``, as CUDA reports a failed batch (SIZE_MAX: no one copy's fault)."""
    if fail_idx:
        ctypes.c_size_t.from_address(fail_idx).value = index


def _batch_impl(copies: "Follower", dsts: int, srcs: int, sizes: int, count: int, attrs: int, attrs_idxs: int,
                num_attrs: int, fail_idx: int, stream: int) -> int:
    runs = batch_runs(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs)
    if runs is None:
        set_fail_index(fail_idx, SIZE_MAX)
        return CUDA_ERROR_INVALID_VALUE
    try:  # the fuzzer and the simulator answer later (None); the GPU sanitizer gives the driver's answer
        answer = copies.copy("cuMemcpyBatchAsync", runs, int(stream or 0), real=("cuMemcpyBatchAsync", (
            dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, stream)))
    except InterceptError as error:
        set_fail_index(fail_idx, getattr(error, "copy_index", SIZE_MAX))
        raise
    return CUDA_SUCCESS if answer is None else int(answer)


def _memcpy_impl(copies: "Follower", dst: int, src: int, n: int, stream: int) -> int:
    answer = copies.copy("cuMemcpyAsync", [(int(dst or 0), int(src or 0), int(n), "STREAM")], int(stream or 0),
                         real=("cuMemcpyAsync", (dst, src, n, stream)))
    return CUDA_SUCCESS if answer is None else int(answer)


def _cudart_memcpy_impl(copies: "Follower", dst: int, src: int, n: int, kind: int, stream: int) -> int:
    if kind not in MEMCPY_KINDS:
        return CUDA_ERROR_INVALID_VALUE  # cudaErrorInvalidValue
    answer = copies.copy("cudaMemcpyAsync", [(int(dst or 0), int(src or 0), int(n), "STREAM")], int(stream or 0),
                         real=("cudaMemcpyAsync", (dst, src, n, kind, stream)))
    return CUDA_SUCCESS if answer is None else int(answer)


#: symbol -> (its C type, what a call does)
SYMBOLS: dict[str, tuple[Any, Callable[..., int]]] = {
    "cuMemcpyBatchAsync": (BATCH_TYPE, _batch_impl),
    "cuMemcpyAsync": (MEMCPY_TYPE, _memcpy_impl),
    "cudaMemcpyAsync": (CUDART_MEMCPY_TYPE, _cudart_memcpy_impl),
}
#: symbol -> the position of its stream argument
STREAM_ARG = {"cuMemcpyBatchAsync": 8, "cuMemcpyAsync": 3, "cudaMemcpyAsync": 4}
_POINTERS: dict[str, Any] = {}  # symbol -> its CFUNCTYPE object, kept for the process
_REAL: dict[str, Any] = {}  # CUDA: symbol -> the real entry point the followed one issues


def resolve_real(symbol: str, resolve: Callable[[], tuple]) -> None:
    """CUDA: the real entry point behind ``symbol``'s followed pointer (``resolve``: the bindings' own
    ``cuGetProcAddress`` of it)."""
    if symbol not in _REAL:
        err, ptr, *_ = resolve()
        if int(err) != 0 or not ptr:
            raise unroutable(f"cuGetProcAddress({symbol!r})", f"the driver answered {err}",
                             "check the driver version")
        _REAL[symbol] = SYMBOLS[symbol][0](int(ptr))


def resolve_library_symbol(symbol: str, lookup: Callable[[], Any]) -> None:
    """CUDA: the real entry point behind ``symbol``'s followed pointer, ``lookup()`` of the library
    the program loaded through ``ctypes`` (a ``_FuncPtr``, given the followed pointer's C type)."""
    if symbol not in _REAL:
        fn = lookup()
        fn.argtypes, fn.restype = SYMBOLS[symbol][0]._argtypes_, SYMBOLS[symbol][0]._restype_
        _REAL[symbol] = fn


def real_entry(symbol: str) -> Any:
    """The real entry point behind ``symbol``'s followed pointer, None where none was resolved."""
    return _REAL.get(symbol)


def pointer(symbol: str) -> Any:
    """The followed C function of ``symbol`` (made once, never freed: engines keep its address)."""
    with _LOCK:
        fn = _POINTERS.get(symbol)
        if fn is None:
            ctype, impl = SYMBOLS[symbol]
            fn = _POINTERS[symbol] = ctype(_entry(symbol, impl))
        return fn


def address_of(symbol: str) -> int:
    return ctypes.cast(pointer(symbol), ctypes.c_void_p).value or 0


# -- cuGetProcAddress through ctypes on libcuda --------------------------------------------------------
#: CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
#: CUdriverProcAddressQueryResult *symbolStatus); the unsuffixed export is the first version, without the status
GET_PROC_TYPES = {
    "cuGetProcAddress_v2": ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int,
                                            ctypes.c_uint64, ctypes.c_void_p),
    "cuGetProcAddress": ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int,
                                         ctypes.c_uint64),
}
_REAL_GET_PROC: dict[str, Any] = {}  # CUDA: the real library's cuGetProcAddress(_v2)


def _get_proc_entry(version: str) -> Callable[..., int]:
    def call(name: bytes | None, pfn: int, cuda_version: int, flags: int, *status: int) -> int:
        text = (name or b"").decode("ascii", "replace")
        real = _REAL_GET_PROC.get(version)
        if text in SYMBOLS and not text.startswith("cuda"):
            if real is not None and text not in _REAL:
                out = ctypes.c_void_p(0)
                if real(name, ctypes.byref(out), cuda_version, flags, *((None,) if status else ())) == 0 and out.value:
                    _REAL[text] = SYMBOLS[text][0](out.value)
            if pfn:
                ctypes.c_void_p.from_address(pfn).value = address_of(text)
            if status and status[0]:
                ctypes.c_int.from_address(status[0]).value = 0  # CU_GET_PROC_ADDRESS_SUCCESS
            return CUDA_SUCCESS
        copies = active()
        if copies is None:  # the program's own call, no tool following: the driver answers
            return int(real(name, pfn, cuda_version, flags, *status)) if real is not None else \
                CUDA_ERROR_NOT_INITIALIZED

        def refuse(_copies: Any) -> int:
            raise unroutable(f"ctypes {version}({bytes(text, 'ascii', 'replace')!r})",
                             "the harness follows the pointers of cuMemcpyBatchAsync and cuMemcpyAsync, and no other "
                             "driver entry point (it can neither simulate nor gate its calls)")

        return copies.from_c(version, refuse, ())

    return call


def get_proc_pointer(version: str, real: Callable[[], Any] | None = None) -> Any:
    """The followed ``cuGetProcAddress`` (or ``_v2``) of ``ctypes.CDLL("libcuda...")``: the pointers
    it hands out for the followed symbols are this module's; ``real`` (CUDA) resolves the real ones."""
    with _LOCK:
        if real is not None and version not in _REAL_GET_PROC:
            fn = real()
            fn.argtypes, fn.restype = GET_PROC_TYPES[version]._argtypes_, GET_PROC_TYPES[version]._restype_
            _REAL_GET_PROC[version] = fn
        fn = _POINTERS.get(version)
        if fn is None:
            fn = _POINTERS[version] = GET_PROC_TYPES[version](_get_proc_entry(version))
        return fn


class FollowedLibrary:
    """What ``ctypes.CDLL("libcuda...")`` gives the code under a tool: the followed symbols, and a
    refusal naming any other."""

    def __init__(self, name: str, real: Any = None) -> None:
        self._name = name
        self._real = real  # CUDA: the library itself

    def __getattr__(self, symbol: str) -> Any:
        if symbol.startswith("_"):
            raise AttributeError(symbol)
        return self[symbol]

    def __getitem__(self, symbol: str) -> Any:
        if symbol in GET_PROC_TYPES:
            return get_proc_pointer(symbol, None if self._real is None else lambda: self._real_symbol(symbol))
        if symbol in SYMBOLS:
            if self._real is not None:
                resolve_library_symbol(symbol, lambda: self._real_symbol(symbol))
            return pointer(symbol)
        raise unroutable(f"ctypes.CDLL({self._name!r}).{symbol}",
                         "the harness follows cuMemcpyBatchAsync, cuMemcpyAsync, cudaMemcpyAsync and cuGetProcAddress "
                         "of the CUDA libraries, and no other raw CUDA call (it can neither simulate nor gate it)")


    def _real_symbol(self, symbol: str) -> Any:
        # as CDLL.__getitem__ makes it: the CDLL's own lookup is the followed one while the tool runs
        return self._real._FuncPtr((symbol, self._real))


class DriverCopies:
    """The followed driver and runtime copies of one session (see the module docstring)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.kept: InterceptError | None = None  # an error a C caller could not be given
        self._stand_ins: tuple[tuple, list[tuple[Any, dict[str, Any]]]] | None = None

    # -- activation (kvdevice.intercept.unroutable) ------------------------------------------------------
    def __enter__(self) -> "DriverCopies":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def stand_ins(self, modules: list[tuple[str, Any]], entry_points: Callable[[str, Any], tuple[str, ...]],
                  refusal: Callable[[str, str], Any]) -> list[tuple[Any, dict[str, Any]]]:
        """Per binding module: its ``entry_points(name, module)`` and their stand-ins, :meth:`binding`
        or else ``refusal(module_name, name)``; made once per session and set of modules, since the
        guard swaps them in around every op (it once cost the fuzzer 1 ms an op)."""
        key = tuple(id(module) for _, module in modules)
        if self._stand_ins is None or self._stand_ins[0] != key:
            made = []
            for module_name, module in modules:
                stand_ins = {}
                for name in entry_points(module_name, module):
                    followed = self.binding(module, module_name, name, getattr(module, name))
                    stand_ins[name] = followed if followed is not None else refusal(module_name, name)
                made.append((module, stand_ins))
            self._stand_ins = (key, made)
        return self._stand_ins[1]

    def binding(self, module: Any, module_name: str, name: str, original: Any) -> Callable[..., Any] | None:
        """The followed stand-in of ``module_name.name``, None where it is not followed."""
        copies = self
        if name == "cuGetProcAddress":
            def get_proc_address(symbol: Any, cuda_version: int = 0, flags: int = 0, *rest: Any) -> tuple:
                text = symbol.decode() if isinstance(symbol, (bytes, bytearray)) else str(symbol)
                if text not in SYMBOLS or text.startswith("cuda"):
                    raise unroutable(f"{module_name}.cuGetProcAddress({bytes(text, 'ascii')!r})",
                                     "the harness follows the pointers of cuMemcpyBatchAsync and cuMemcpyAsync, and "
                                     "no other driver entry point (it can neither simulate nor gate its calls)")
                if not copies.session.backend == "sim":
                    copies.resolve_real(text, lambda: original(symbol, cuda_version, flags, *rest))
                return (module.CUresult.CUDA_SUCCESS, address_of(text),
                        module.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS)
            return get_proc_address
        if name == "cuMemcpyAsync":
            def cu_memcpy_async(dst: Any, src: Any, n: int, stream: Any) -> tuple:
                def call() -> tuple:
                    copies.copy(f"{module_name}.cuMemcpyAsync", [(raw_int(dst), raw_int(src), int(n), "STREAM")],
                                raw_int(stream), real=lambda: original(dst, src, n, stream))
                    return (module.CUresult.CUDA_SUCCESS,)
                return copies.guarded(call, module.CUresult.CUDA_ERROR_INVALID_VALUE)
            return cu_memcpy_async
        if name == "cudaMemcpyAsync":
            def cuda_memcpy_async(dst: Any, src: Any, n: int, kind: Any, stream: Any = 0) -> tuple:
                if raw_int(kind) not in MEMCPY_KINDS:
                    return (module.cudaError_t.cudaErrorInvalidValue,)
                def call() -> tuple:
                    copies.copy(f"{module_name}.cudaMemcpyAsync", [(raw_int(dst), raw_int(src), int(n), "STREAM")],
                                raw_int(stream), real=lambda: original(dst, src, n, kind, stream))
                    return (module.cudaError_t.cudaSuccess,)
                return copies.guarded(call, module.cudaError_t.cudaErrorInvalidValue)
            return cuda_memcpy_async
        return None

    def resolve_real(self, symbol: str, resolve: Callable[[], tuple]) -> None:
        resolve_real(symbol, resolve)

    # -- calls from C -------------------------------------------------------------------------------------
    def from_c(self, symbol: str, impl: Callable[..., int], args: tuple) -> int:
        """A call through a followed pointer: what it returns to C (an error is kept, see the module docstring)."""
        try:
            return impl(self, *args)
        except InterceptError as error:
            if not self.session.cannot_follow(error):
                self.kept = self.kept or error
            return CUDA_ERROR_INVALID_VALUE

    def guarded(self, call: Callable[[], tuple], failed: Any) -> tuple:
        """A bindings call: raised where the session stops at what it cannot follow, else ``(failed,)``."""
        try:
            return call()
        except InterceptError as error:
            if not self.session.cannot_follow(error):
                raise
            return (failed,)

    def raise_kept(self) -> None:
        """At a boundary of the session: an error a followed pointer could not raise to its C caller."""
        if self.kept is not None:
            raise self.kept

    # -- one copy call ------------------------------------------------------------------------------------
    def stream(self, handle: int, call: str) -> Any:
        rt = self.session.rt
        if handle == 0:
            return rt.default_stream
        try:
            return self.session.cuda_api.from_handle(handle).runtime_stream
        except InterceptError:
            raise unroutable(f"{call} on stream handle {handle:#x}",
                             "it is not the .cuda_stream of a stream the harness made, so it can neither order "
                             "nor schedule the copy",
                             "pass stream.cuda_stream of a torch.cuda.Stream() made while the tool runs") from None

    def place(self, address: int, size: int, call: str, role: str) -> Placed:
        """The memory ``[address, address + size)`` lies in."""
        session = self.session
        memories = [m for m in (session.memory, session.host.regions,
                                getattr(session, "cuda_ops", None) if session.backend != "sim" else None) if m is not None]
        placed, unplaced = place([(address, address + size)], memories)
        if unplaced:
            raise unroutable(f"{call}: {role} {address:#x} ({size} bytes)",
                             f"it is {session.describe_address(address)}, not inside one allocation the harness "
                             f"knows (device memory, pinned or registered host memory)",
                             "copy between device tensors and pinned host memory made while the tool runs")
        return placed[0]

    def copy(self, call: str, runs: list[tuple[int, int, int, str]], handle: int, real: Any) -> None:
        """One queued op on the stream ``handle`` names, moving ``runs`` (dst, src, bytes, source order)."""
        lock = getattr(self.session, "lock", None)  # a program session: one step, whichever thread calls
        with lock if lock is not None else contextlib.nullcontext():
            self._copy(call, runs, handle, real)

    def _copy(self, call: str, runs: list[tuple[int, int, int, str]], handle: int, real: Any) -> None:
        session = self.session
        session.boundary(call)
        stream = self.stream(handle, call)
        moves = []
        for index, (dst, src, n, order) in enumerate(runs):
            if n <= 0:
                continue
            try:
                moves.append((self.place(dst, n, call, "destination"), self.place(src, n, call, "source"), order))
            except InterceptError as error:
                error.copy_index = index  # type: ignore[attr-defined]  # the batch's failIdx
                raise
        reads, writes, cache = self.accesses([src for _, src, _ in moves], [dst for dst, _, _ in moves])
        if session.backend == "sim":
            staged = {i: ctypes.string_at(src.start, src.end - src.start)
                      for i, (_, src, order) in enumerate(moves) if order == "DURING_API_CALL"}

            def run() -> None:
                for i, (dst, src, _) in enumerate(moves):
                    source = staged.get(i)
                    if source is None:
                        ctypes.memmove(dst.start, src.start, dst.end - dst.start)
                    else:
                        ctypes.memmove(dst.start, source, len(source))
        else:
            issue = real if callable(real) else self._real_call(*real)
            # The real call may be issued on another thread (a gate's executor): it gets the context
            # the program's call would act in, taken here on the program's thread (issue 53).
            ctx = program_context(handle)

            def run() -> None:
                with in_context(ctx):
                    result = issue()
                err = result[0] if isinstance(result, tuple) else result
                if int(err) != 0:
                    raise unroutable(call, f"the driver answered {err}", "check the call's arguments")

        with session.rt.use_stream(stream):
            stamp = session.enqueue(run, name=call, reads=reads, writes=writes, cache_written=cache)
        for dst, src, _ in moves:
            if src.kind == "pinned":
                view = host_view(src)
                session.host.note_read(src.memory, view, stamp)
                session.host.used_by_copy(view, stream)
            if dst.kind == "pinned":
                view = host_view(dst)
                session.host.note_device_write(dst.memory, view, stamp)
                session.host.used_by_copy(view, stream)

    def accesses(self, read: list[Placed], written: list[Placed]) -> tuple[list, list, Any]:
        """(reads, writes, the cache) as ``Runtime.launch`` takes them, as a ``copy_`` of those bytes
        declares them (:meth:`kvdevice.intercept.sim_ops.SimOps._accesses`), pinned memory left out:
        device memory by its runs; the KV cache's bytes as a
        :class:`~kvdevice.intercept.cache_access.CacheAccess` for an offloader, as "the cache is
        written" for a zeroer."""
        from kvdevice.intercept.cache_access import CacheAccess

        def cache(places: list[Placed]) -> list[tuple[int, int]]:
            return merge([r for p in places if p.kind == "cache" for r in p.ranges])

        if self.session.block_map is not None:
            return by_memory(read, ("device",)), by_memory(written, ("device",)), CacheAccess(cache(read), cache(written))
        return by_memory(read, ("device", "cache")), by_memory(written, ("device",)), bool(cache(written))

    def _real_call(self, symbol: str, args: tuple) -> Callable[[], int]:
        fn = _REAL.get(symbol)
        if fn is None:
            raise unroutable(f"{symbol} through a pointer the harness did not resolve",
                             "resolve it with cuda.bindings.driver.cuGetProcAddress while the tool runs")
        return lambda: fn(*args)


def raw_int(value: Any) -> int:
    """A raw pointer or handle as the bindings take it (an int, a ``CUdeviceptr``, a ``CUstream``)."""
    if value is None:
        return 0
    if hasattr(value, "getPtr") and not isinstance(value, int):
        try:
            return int(value)
        except TypeError:
            return int(value.getPtr())
    return int(value)
