"""What an aten op does to device memory and the stream, as CUDA would run it.

Every op a plain torch zeroer runs on a device tensor falls in one kind; the simulator
(:mod:`kvdevice.intercept.sim_ops`) and the CUDA router (:mod:`kvdevice.intercept.cuda_ops`) act on
the kind, so both backends agree on what an op means:

* ``view``: metadata only (``x[1:3]``, ``x.view(...)``): made at once, no device work;
* ``alloc``: stream-ordered allocation with no contents (``torch.empty``): no device work;
* ``copy`` / ``to_copy``: ``copy_`` and ``.to()``/``.cpu()``: their meaning depends on the devices,
  on ``non_blocking`` and on whether host memory is pinned (:func:`copy_kind`);
* ``blocking``: the host needs a result (``.item()``, ``nonzero``: the output's shape depends on
  the data): CUDA synchronises the current stream, then the op runs;
* ``unsupported``: changes a tensor's metadata in place (``t_``, ``resize_``, ``set_``);
* ``queued``: everything else: enqueued on the current stream, run when it gets there.

Example::

    kind(torch.ops.aten.slice.Tensor)        # 'view'
    kind(torch.ops.aten.index_fill_.int_Scalar)   # 'queued'
    copy_kind(device_dst=True, device_src=False, non_blocking=True, pinned=True)   # 'h2d-async'
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

aten = torch.ops.aten


def _ops(*names: str) -> set:
    """The aten overloads ``names`` ("op.overload") that this torch has."""
    found = set()
    for name in names:
        op, _, overload = name.partition(".")
        packet = getattr(aten, op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return found


_ALLOC = _ops("empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
              "new_empty_strided.default", "empty_permuted.default")
_COPY = _ops("copy_.default")
_TO_COPY = _ops("_to_copy.default")
_UNSUPPORTED = _ops("set_.source_Storage", "set_.source_Tensor", "set_.default", "resize_.default",
                    "resize_as_.default", "set_.source_Storage_storage_offset")
# ``t.set_(storage, offset, size, stride)``: t now views other bytes (vLLM's register_kv_caches views a
# registered host buffer or a device storage in another shape); no byte is read or written.
SET_STORAGE = _ops("set_.source_Storage", "set_.source_Storage_storage_offset", "set_.source_Tensor")
# Output shape depends on the data: CUDA copies a count to the host, which synchronises.
_DATA_SHAPED = _ops("nonzero.default", "masked_select.default", "repeat_interleave.Tensor", "unique_dim.default",
                    "_unique2.default", "_unique.default", "unique_consecutive.default")


@functools.lru_cache(maxsize=None)
def kind(func: Any) -> str:
    """One of ``view``, ``alloc``, ``copy``, ``to_copy``, ``blocking``, ``unsupported``, ``queued``."""
    if func in _COPY:
        return "copy"
    if func in _TO_COPY:
        return "to_copy"
    if func in _ALLOC:
        return "alloc"
    if func in _UNSUPPORTED or torch.Tag.inplace_view in func.tags:
        return "unsupported"
    if getattr(func, "is_view", False):
        return "view"
    if torch.Tag.data_dependent_output in func.tags or func in _DATA_SHAPED:
        return "blocking"
    return "queued"


def index_needs_host(func: Any, args: tuple) -> bool:
    """``x[mask]`` with a boolean mask: its shape is the mask's count, which the host must read."""
    if func is not aten.index.Tensor and func is not aten.index_put_.default and func is not aten.index_put.default:
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def copy_kind(*, device_dst: bool, device_src: bool, non_blocking: bool, pinned: bool,
              temporary: bool = False) -> str:
    """How CUDA runs a copy between these memories.

    * ``d2d``: queued on the current stream;
    * ``h2d-async``: non-blocking from pinned memory: queued, reads the host bytes when it runs;
    * ``h2d-staged``: non-blocking from pageable memory: the bytes are staged before the call
      returns, the transfer is queued;
    * ``d2h-async``: non-blocking into pinned memory: queued, writes the host bytes when it runs;
    * ``sync``: any other host copy: the current stream is synchronised and the copy done then
      (a blocking copy, or a non-blocking one to pageable memory, which CUDA makes synchronous);
    * ``host``: host to host, no device involved.

    ``temporary``: torch passes the host side through a pageable temporary
    (:func:`host_temporary`), so pinned memory behaves as pageable.
    """
    if device_dst and device_src:
        return "d2d"
    if not device_dst and not device_src:
        return "host"
    if not non_blocking:
        return "sync"
    if device_dst:
        return "h2d-async" if pinned and not temporary else "h2d-staged"
    return "d2h-async" if pinned and not temporary else "sync"


def _dense_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...] | None:
    """The strides (size-1 dimensions left out) of a layout without gaps or overlaps, else None."""
    kept = [(stride, size) for size, stride in zip(shape, strides) if size != 1]
    expected = 1
    for stride, size in sorted(kept):
        if stride != expected:
            return None
        expected *= size
    return tuple(stride for stride, _ in kept)


def _row_major(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """``is_contiguous()`` of this layout (size-1 dimensions may have any stride)."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def host_temporary(dst: Any, src: Any, *, to_device: bool) -> bool:
    """Whether torch's non-blocking copy between the host and a GPU goes through a pageable host
    temporary (aten/src/ATen/native/cuda/Copy.cu, ``copy_requires_temporaries``): where the two
    sides differ in dtype or layout, the device side is made contiguous on the GPU and the host
    side in ordinary memory. Into the host the transfer then lands in pageable memory (CUDA
    finishes it before returning: synchronous) unless ``dst`` is contiguous; to the device it
    reads a pageable copy made at the call (staged) unless ``src``, broadcast to ``dst``'s shape, is
    contiguous. vLLM's K/V planes (``kv[:, first:last]``) are such views. ``dst`` None: the fresh
    result of ``_to_copy``, laid out like a dense ``src`` and contiguous otherwise."""
    if dst is None:
        return to_device and _dense_strides(src.shape, src.stride()) is None
    if dst.numel() == 0:
        return False
    if dst.dtype == src.dtype and tuple(dst.shape) == tuple(src.shape):
        layout = _dense_strides(dst.shape, dst.stride())
        if layout is not None and layout == _dense_strides(src.shape, src.stride()):
            return False  # one cudaMemcpyAsync over both
    if not to_device:
        return not _row_major(dst.shape, dst.stride())
    lead = len(dst.shape) - len(src.shape)  # src.expand_as(dst): broadcast dimensions have stride 0
    strides = [0] * lead + [0 if size == 1 and dst.shape[lead + i] != 1 else stride
                            for i, (size, stride) in enumerate(zip(src.shape, src.stride()))]
    return not _row_major(dst.shape, strides)


@functools.lru_cache(maxsize=None)
def op_name(func: Any) -> str:
    """``func`` as a report names it: ``copy_``, ``index_select``, ``add.Tensor``."""
    return str(func).replace("aten.", "").replace(".default", "")


@functools.lru_cache(maxsize=None)  # asked on every op: a schema's answer never changes (callers only read it)
def written_args(func: Any) -> list[int]:
    """Positions of the arguments ``func`` writes (its schema's ``(a!)`` annotations)."""
    return [i for i, arg in enumerate(func._schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]


@functools.lru_cache(maxsize=None)
def aliased_returns(func: Any) -> list[int | None]:
    """For each return of ``func``, the position of the argument it aliases (in-place, out=), else None."""
    arguments = func._schema.arguments
    result: list[int | None] = []
    for ret in func._schema.returns:
        match = None
        if ret.alias_info is not None:
            for i, arg in enumerate(arguments):
                if arg.alias_info is not None and set(arg.alias_info.before_set) & set(ret.alias_info.before_set):
                    match = i
                    break
        result.append(match)
    return result


# -- ops that touch rows named by a device-side index tensor -----------------------------------------

# op -> (position of the indexed tensor, position of its dim (or a fixed dim), position of the index, writes)
_INDEXED: dict[Any, tuple[int, int | tuple[int], int, bool]] = {}
for _names, _spec in (
    (("index_select.default", "index_select.out", "gather.default", "gather.out"), (0, 1, 2, False)),
    (("index_copy_.default", "index_add_.default", "index_fill_.int_Scalar", "index_fill_.int_Tensor",
      "index_reduce_.default", "scatter_.src", "scatter_.value", "scatter_.reduce", "scatter_.value_reduce",
      "scatter_add_.default", "scatter_reduce_.two"), (0, 1, 2, True)),
    (("embedding.default",), (0, (0,), 1, False)),
):
    _INDEXED.update(dict.fromkeys(_ops(*_names), _spec))
_INDEX_LIST = dict.fromkeys(_ops("index.Tensor"), False)
_INDEX_LIST.update(dict.fromkeys(_ops("index_put_.default", "_index_put_impl_.default"), True))


class OpInfo:
    """What an overload's schema says, asked once per overload (the hot path of both tools asks it
    for every op; an OpOverload's ``__hash__`` is Python code, so the answers are looked up by id)."""

    __slots__ = ("func", "kind", "name", "written", "aliased", "fresh", "indexed", "index_list", "custom",
                 "positional", "composite")

    def __init__(self, func: Any) -> None:
        from racecheck.custom_ops import is_custom

        self.func = func  # held: the id stays this overload's
        self.custom = is_custom(func)
        schema = getattr(func, "_schema", None)
        self.kind = kind(func) if schema is not None and not self.custom else "queued"
        self.name = op_name(func)
        self.written: tuple[int, ...] = tuple(written_args(func)) if schema is not None else ()
        self.aliased: tuple[int | None, ...] = tuple(aliased_returns(func)) if schema is not None else ()
        # Positions of the returns that are new memory; None: every return (no return aliases an argument).
        fresh = [i for i, a in enumerate(self.aliased) if a is None]
        self.fresh: tuple[int, ...] | None = None if len(fresh) == len(self.aliased) else tuple(fresh)
        self.indexed = _INDEXED.get(func)
        self.index_list = _INDEX_LIST.get(func)
        # The schema's argument names past each count of positional arguments (keyword arguments by position).
        self.positional = tuple(a.name for a in schema.arguments) if schema is not None else ()
        # An op autograd decomposes before a dispatch mode sees it, except under torch.inference_mode()
        # (see decomposed): Tensor.to's aten.to.*, Tensor.pin_memory's aten.pin_memory.
        # One with a kernel of its own for the CPU or CUDA (silu_backward, mish_backward: the composite
        # serves other backends) runs that kernel without a mode, so it is handed on whole.
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        self.composite = (schema is not None and not self.custom and has(func.name(), "CompositeImplicitAutograd")
                          and not has(func.name(), "CPU") and not has(func.name(), "CUDA"))


_INFO: dict[int, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    """The cached :class:`OpInfo` of ``func``."""
    info = _INFO.get(id(func))
    if info is None or info.func is not func:
        info = _INFO[id(func)] = OpInfo(func)
    return info


def decomposed(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` run as the ops it decomposes into, each of them dispatched to ``mode`` (entered
    again for them); NotImplemented where it has no decomposition.

    Outside inference mode, autograd runs a CompositeImplicitAutograd op's decomposition before the
    Python dispatch key: a mode sees ``x.to("cuda", non_blocking=True)`` as ``aten._to_copy`` and
    ``x.pin_memory()`` as ``aten._pin_memory``. Under ``torch.inference_mode()`` (the decorator
    inference engines put on their forward passes and their tests) autograd is skipped and the mode
    gets ``aten.to.dtype_layout`` or ``aten.pin_memory`` whole: a copy to the device, or into pinned
    memory, that a tool reading the op's name would take for some kernel of the program's (seen on an
    H100 under ``pytest --kvz-sanitize``: every table staged by ``.to()`` in an inference-mode test
    was unknown). The simulator's tensors decompose such ops the same way (kvdevice.intercept.sim_ops);
    a mode has to enter itself again, as torch's FakeTensorMode does for its decompositions."""
    with mode:
        return func.decompose(*args, **kwargs)


def leaves(value: Any) -> list[Any]:
    """The leaves of an aten op's arguments or results (lists and tuples opened, at any depth): what
    ``torch.utils._pytree.tree_flatten`` gives for them, at a fraction of its cost on every op (an
    op's arguments hold no dicts: a dict of keyword arguments is passed as its values)."""
    found: list[Any] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        else:
            found.append(item)
    return found


def map_leaves(fn: Any, value: Any) -> Any:
    """``value`` with each leaf (lists and tuples opened, at any depth) replaced by ``fn(leaf)``."""
    if isinstance(value, list):
        return [map_leaves(fn, item) for item in value]
    if isinstance(value, tuple):  # a shape or a named tuple too: a plain tuple, as pytree makes it
        return tuple(map_leaves(fn, item) for item in value)
    return fn(value)


def args_by_position(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """``func``'s arguments by position, those passed by keyword included (None where absent)."""
    if not kwargs:
        names = op_info(func).positional
        return list(args) + [None] * (len(names) - len(args)) if len(names) > len(args) else list(args)
    return list(args) + [kwargs.get(name) for name in op_info(func).positional[len(args):]]


def _one_index(func: Any, args: tuple, kwargs: dict) -> tuple[int, Any, bool] | None:
    """For ``aten.index`` and ``index_put_`` indexing one dim by one tensor: (dim, index, writes)."""
    writes = op_info(func).index_list
    if writes is None:
        return None
    named = [(d, i) for d, i in enumerate(args_by_position(func, args, kwargs)[1] or ()) if i is not None]
    if len(named) != 1:
        return None
    dim, index = named[0]
    return dim, index, writes


def masked_rows(func: Any, args: tuple, kwargs: dict) -> tuple[int, int, torch.Tensor, bool] | None:
    """For ``x[mask]`` and ``x[mask] = v`` with one 1-D boolean mask (``aten.index`` and
    ``index_put_``): (0, the dim it masks, the mask, whether it writes). The rows are the mask's
    True positions, known only where its values can be read (a host mask); None for any other op."""
    found = _one_index(func, args, kwargs)
    if found is None:
        return None
    dim, mask, writes = found
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
        return None
    return 0, dim, mask, writes


def indexed_rows(func: Any, args: tuple, kwargs: dict) -> tuple[int, int, torch.Tensor, bool] | None:
    """For an op that reads or writes only the rows an index tensor names (``index_select``,
    ``index_copy_``, ``x[idx]``, ``x[idx] = v``, gathers and scatters, ``embedding``):
    (position of the indexed tensor, the dim, the index tensor, whether it writes). None for any
    other op, and for indexing this cannot reduce to rows of one dim (several index tensors,
    boolean masks)."""
    info = op_info(func)
    spec = info.indexed
    if spec is None and info.index_list is None:
        return None  # the common case: no index tensor names rows
    if spec is not None:
        given = args_by_position(func, args, kwargs)
        target, dim_at, index_at, writes = spec
        dim = dim_at[0] if isinstance(dim_at, tuple) else given[dim_at]
        index = given[index_at]
        if not isinstance(index, torch.Tensor) or not isinstance(dim, int):
            return None
        return target, dim, index, writes
    found = _one_index(func, args, kwargs)
    if found is None:
        return None
    dim, index, writes = found
    if not isinstance(index, torch.Tensor) or index.dtype in (torch.bool, torch.uint8):
        return None
    return 0, dim, index, writes
