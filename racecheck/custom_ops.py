"""Custom ops: what an op of a C++ extension reads and writes, said by an effect model.

Engines move KV bytes with ops of their own: ``torch.ops._C_cache_ops.swap_blocks`` (vLLM),
``torch.ops.sgl_kernel.transfer_kv_all_layer`` (SGLang's HiCache), ``lmcache.c_ops.
multi_layer_block_kv_transfer`` (LMCache, a pybind function). Their schemas mark no argument as
written, destinations included, and the all-layer ops reach their layers only through tables of
``uint64`` addresses: a schema says nothing of what such an op touches. An :class:`EffectModel`
says it, from the op's arguments, as byte runs read and written (:class:`Effects`); each tool
resolves every run to the memory it falls in (a KV block, a pinned host slot, a device tensor)
and declares it to the happens-before checker, on the stream current at the call.

A model may also carry a ``reference``: a plain CPU implementation the simulator runs when the
stream reaches the op. While a tool runs (:func:`extension_modules`), a name the program calls is
the program's wherever it has one, and a stand-in only where nothing else answers to it:
``torch.ops.<namespace>.<op>`` of a modelled op nothing defines is a stand-in that routes the call
(nothing is registered with torch, so the program's own ``torch.library`` definition or extension
wins, before or after the tool started); a pybind function's module (``lmcache.c_ops``) is the
real one, its function wrapped, wherever an import finder finds it, and a stand-in module only
where none does (a stand-in package gives way to the program's own once that can be imported).
:func:`failed_inside` names the stand-in or model a program failed inside, so that a failure there
is never called the program's own.

A ``torch.ops`` op outside torch's own namespaces with no model is never passed silently: the
fuzzer stops with a harness error, the sanitizer says it in one line (the run is partial);
:func:`missing_model` is that message.

Example (a user's op, in a few lines)::

    from racecheck.custom_ops import effect_model

    @effect_model("mylib::gather_rows", schema="gather_rows(Tensor src, Tensor(a!) dst, Tensor rows) -> ()")
    def gather_rows(fx, src, dst, rows):
        fx.read(rows)                                  # the index tensor itself
        fx.read_rows(src, 0, fx.values(rows))          # the rows it names (values read when known)
        fx.write(dst)
"""

from __future__ import annotations

from racecheck import engine_ops  # noqa: F401 - the engines' models, registered at import
from racecheck.effects import (EffectModel, Effects, NeedsExtension, OpenRoute, ValueUnknown, effect_model,
                               extension_modules, failed_inside, host_values, is_custom, known_values, missing_model,
                               model_for, models, op_name, open_routes, reference_values, register, route, routing,
                               unregister, unrouted)

__all__ = ["EffectModel", "Effects", "NeedsExtension", "OpenRoute", "ValueUnknown", "effect_model", "extension_modules",
           "failed_inside", "host_values", "is_custom", "known_values", "missing_model", "model_for", "models", "op_name",
           "open_routes", "reference_values", "register", "route", "routing", "unregister", "unrouted"]
