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
stream reaches the op, and that is registered as the op (``torch.library``, in the op's own
namespace, with the model's ``schema``) where the extension is absent, so the engine's own call
resolves. A pybind function's model names its module (``lmcache.c_ops``): while a tool runs,
:func:`extension_modules` wraps the real module's function, or installs a stand-in module whose
function is the model's, only where the real one is absent.

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
from racecheck.effects import (EffectModel, Effects, OpenRoute, ValueUnknown, define_references, effect_model,
                               extension_modules, host_values, is_custom, missing_model, model_for, models,
                               op_name, open_routes, register, route, routing, unregister, unrouted)

__all__ = ["EffectModel", "Effects", "OpenRoute", "ValueUnknown", "define_references", "effect_model",
           "extension_modules", "host_values", "is_custom", "missing_model", "model_for", "models", "op_name",
           "open_routes", "register", "route", "routing", "unregister", "unrouted"]
