"""The engines' own races: one racy program and its fixed twin per upstream bug.

Each pair reproduces, in a small plain torch script, a race that an inference engine shipped and
then fixed (vLLM, SGLang, TensorRT-LLM, LMCache: docs/sanitizer.md names each upstream issue and
pull request), plus three patterns with a public anchor rather than
one engine bug (a CUDA graph's static input, vLLM's async output thread, a two-way KV bounce
buffer). Every module is written the way those engines write such code (``CpuGpuBuffer``-style
pinned buffers with numpy views, fresh pinned tensors per call, copy streams, events,
``wait_stream``, ``record_stream``, helper threads, CUDA graphs) and follows the contract of
:mod:`sanitizer.bench.programs`, with two additions:

* ``main(steps=16, sleep=False)``; with ``sleep`` (``--sleep`` on the command line) the program
  holds the device back with ``torch.cuda._sleep(SLEEP_CYCLES)`` (about 10 ms on an H200) where
  that makes a racy program's race show as wrong values on a real GPU, every time; the twin makes
  the same calls at the same points and still computes the right values. That is the corpus's
  ground truth, independent of any sanitizer.
* every racy module marks its race's two lines, ``# race: queued`` and ``# race: later``
  (:func:`sanitizer.bench.programs.marked_lines` reads them); twins carry no markers.

Each module imports only torch, numpy and the standard library, never this project, and runs as a
script: ``python PATH --steps N [--sleep]``. :data:`CORPUS` lists the pairs, racy first.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from sanitizer.bench.programs import DEVICE_ACCESS, HOST_READ, HOST_WRITE, REUSE, Program, marked_lines, pair

__all__ = ["CORPUS", "BY_NAME", "DEVICE_ACCESS", "HOST_READ", "HOST_WRITE", "REUSE", "Program", "load",
           "marked_lines"]


_pair = functools.partial(pair, collection="corpus")  # (racy, twin, hazard, pattern, upstream)
CORPUS: tuple[Program, ...] = (
    *_pair("vllm_48085_zeroer_one_pinned_buffer", "vllm_48085_zeroer_fresh_pinned", HOST_WRITE,
           "KV block zeroer stages block ids through one persistent pinned buffer", "vLLM #48085"),
    *_pair("vllm_36013_read_before_event", "vllm_36013_event_then_read", HOST_READ,
           "host reads num_accepted_tokens_cpu before its device-to-host copy landed", "vLLM #36013"),
    *_pair("vllm_46278_store_no_compute_event", "vllm_46278_store_waits_compute_event", DEVICE_ACCESS,
           "CPU offload store stream not ordered after the compute that wrote the blocks", "vLLM #46278"),
    *_pair("vllm_31841_mm_embed_one_buffer", "vllm_31841_mm_embed_double_buffer", HOST_WRITE,
           "persistent pinned is_mm_embed mask rewritten while its async copy is pending", "vLLM #31841"),
    *_pair("vllm_24527_reused_input_buffers", "vllm_24527_prepare_inputs_event", HOST_WRITE,
           "async scheduling rewrites reused pinned input buffers while their copies are queued", "vLLM #24527"),
    *_pair("sglang_34076_no_record_stream", "sglang_34076_record_stream", REUSE,
           "index tensor read on the forward stream, dropped without record_stream, its memory reused",
           "SGLang #34076"),
    *_pair("sglang_34076_mixed_batch_no_record_stream", "sglang_34076_mixed_batch_record_stream", REUSE,
           "mixed batch's running indices gathered through on the forward stream, dropped without record_stream, "
           "their block reused by a tensor of another size", "SGLang #34076"),
    *_pair("sglang_36738_load_unfenced", "sglang_36738_load_waits_forward", DEVICE_ACCESS,
           "HiCache load-back into reused pages not ordered after the forward stream's writes", "SGLang #36738"),
    *_pair("sglang_27444_evict_in_flight_page", "sglang_27444_host_lock_until_loaded", HOST_WRITE,
           "cudaHostRegister'ed host KV page recycled while its load-back is in flight", "SGLang #27444"),
    *_pair("sglang_18746_reused_req_slot", "sglang_18746_write_waits_forward", DEVICE_ACCESS,
           "freed req_pool_idx's req_to_token row rewritten while the forward stream reads it", "SGLang #18746"),
    *_pair("trtllm_15546_persistent_offsets", "trtllm_15546_fresh_offsets", HOST_WRITE,
           "KV block offsets staged through one persistent pinned tensor under the overlap scheduler",
           "TensorRT-LLM #15546"),
    *_pair("lmcache_4830_free_before_copy", "lmcache_4830_sync_before_free", HOST_WRITE,
           "pinned-pool temporaries freed while their async host-to-device copies read them", "LMCache #4830"),
    *_pair("cuda_graph_static_input_rewritten", "cuda_graph_static_input_event", HOST_WRITE,
           "host rewrites a CUDA graph's static pinned input while the last replay is pending",
           "onnxruntime #32121"),
    *_pair("vllm_async_output_thread_no_sync", "vllm_async_output_thread_event_sync", HOST_READ,
           "main thread reads sampled ids a helper thread's device-to-host copy has not written yet", ""),
    *_pair("kv_offload_bounce_load_overwrite", "kv_offload_bounce_load_event", HOST_WRITE,
           "two-way pinned KV bounce buffer refilled by a load while the previous load's copy is queued", ""),
)
BY_NAME: dict[str, Program] = {p.name: p for p in CORPUS}


def load(name: str) -> ModuleType:
    """The program's module (``KeyError`` for a name not in :data:`CORPUS`)."""
    return importlib.import_module(f"{__name__}.{BY_NAME[name].name}")
