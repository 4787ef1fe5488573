"""LMCache's engine-driven transfer path in its shape: ``lmcache.c_ops.multi_layer_block_kv_transfer``
through a table of layer addresses, loads through pinned temporaries (LMCache #4830).

LMCache's multiprocess transfer context (``lmcache/v1/multiprocess/transfer_context/``) moves KV
between the engine's paged GPU layers and LMCache objects (``[2, NL, T, NH*HS]`` in CPU memory)
with one pybind call, ``lmcache.c_ops.multi_layer_block_kv_transfer(table, object pointers,
block ids, device, direction, shape desc, chunk tokens, KV format, skip)``: the engine's layers are
reached through a device table of their K and V planes' base addresses (built once from
``data_ptr()`` with numpy, ``uint64`` viewed as ``int64``; format ``TWO_X_NL_X_NBBS_NH_HS``), each
object through its raw address, the block ids a device ``int64`` tensor. Its schema marks nothing as written; the
kernel writes through those addresses. ``gather`` stores (D2H into a pinned object, then into the
host pool), ``scatter_cpu_to_paged_kv`` loads (H2D).

Before #4830 the scatter pinned each received chunk (pageable memory, as unpickled) into a
temporary with ``chunk.pin_memory()`` and returned while the kernel, queued on the transfer
stream, still read the temporary through its address: torch records no stream for a raw address,
so the temporary went back to the caching host allocator, and the next ``chunk.pin_memory()``
overwrote it under the copy (gsm8k 0.80 -> 0.00 on 8xH100, no error). The fix synchronizes the
transfer stream before returning when it pinned temporaries.

=====================================  ===================================================  =========
factory / program                      what it does                                         verdict
=====================================  ===================================================  =========
``temporaries_freed_on_return``        the scatter returns with its kernel still reading    racy
                                       the pinned temporaries (LMCache before #4830)
``temporaries_synced_before_return``   the transfer stream is synchronized first (#4830)    race-free
=====================================  ===================================================  =========

Run::

    python -m pytest fuzz --offloader examples/lmcache_transfer_context.py:temporaries_freed_on_return --backend sim
    python -m sanitizer --backend sim -- python examples/lmcache_transfer_context.py           # exit 1
    python -m sanitizer --backend sim -- python examples/lmcache_transfer_context.py --fixed   # exit 0

Where LMCache is not installed, both tools stand a reference implementation in for
``lmcache.c_ops`` (its effect model, ``racecheck.custom_ops``); run bare, the program needs LMCache.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque

import numpy as np
import torch

from zeroer.offload import OffloaderCapabilities

VERDICTS = {
    "temporaries_freed_on_return": "racy",
    "temporaries_synced_before_return": "race-free",
}

# Layers of one layout (K/V outermost, no row padding, one page shape and dtype): each K and V plane
# a contiguous [NB, BS, NH, HS], which the transfer op addresses through its table.
GEOMETRIES = ("kv_outer_bf16", "ratio2", "tiny")


class TransferContext:
    """The transfer context of one engine: the layer table and shape descriptor, made once; a
    transfer stream; an event per job, reported once it has completed."""

    def __init__(self, device_layers: list[torch.Tensor], host_layers: list[torch.Tensor], ratio: int, *,
                 sync_temporaries: bool) -> None:
        import lmcache.c_ops as lmc_ops  # the engine's import; a stand-in under a tool where LMCache is absent

        self.ops = lmc_ops
        self.device_layers, self.host_layers, self.ratio = device_layers, host_layers, ratio
        self.sync_temporaries = sync_temporaries
        first = device_layers[0]
        if any(t.dim() != 5 or t.shape[0] != 2 or t.shape[1:] != first.shape[1:] or t.dtype != first.dtype
               or not (t[0].is_contiguous() and t[1].is_contiguous()) for t in device_layers):
            raise ValueError("every layer must be a [2, NB, BS, NH, HS] tensor of one shape and dtype, "
                             "its K and V planes each contiguous")
        _, nb, bs, nh, hs = first.shape
        self.device = first.device
        # Every K plane's base address, then every V plane's (LMCache's kv pointers for K and V kept
        # apart, format TWO_X_NL_X_NBBS_NH_HS): built once on the host and sent to the device.
        planes = [t[0] for t in device_layers] + [t[1] for t in device_layers]
        addresses = np.array([p.data_ptr() for p in planes], dtype=np.uint64).view(np.int64)
        self.table = torch.from_numpy(addresses).to(device=self.device)
        self.format = lmc_ops.GPUKVFormat.TWO_X_NL_X_NBBS_NH_HS
        desc = lmc_ops.PageBufferShapeDesc()
        desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs = 2, len(device_layers), nb, bs, nh, hs
        desc.element_size = first.element_size()
        self.desc = desc
        self.chunk_tokens = ratio * bs  # one LMCache object per logical block
        self.object_shape = (2, len(device_layers), self.chunk_tokens, nh * hs)
        self.stream = torch.cuda.Stream()
        self.in_flight: deque[tuple[int, torch.cuda.Event, list | None]] = deque()

    def _kernel_blocks(self, blocks: list[int]) -> torch.Tensor:
        ids = [block * self.ratio + k for block in blocks for k in range(self.ratio)]
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _host_rows(self, layer: int, slot: int) -> torch.Tensor:
        """A host slot's rows of one layer, as the object lays them out: [2, T, NH*HS]."""
        rows = self.host_layers[layer][:, slot * self.ratio:(slot + 1) * self.ratio]
        return rows.reshape(2, self.chunk_tokens, -1)

    # -- store: gather paged blocks into LMCache objects, then into the host pool -------------------------
    def gather(self, job_id: int, block_ids: list[int], slot_ids: list[int]) -> None:
        objects = [torch.empty(self.object_shape, dtype=self.device_layers[0].dtype, pin_memory=True)
                   for _ in block_ids]
        self.stream.wait_stream(torch.cuda.current_stream())  # the forward wrote the blocks
        with torch.cuda.stream(self.stream):
            self.ops.multi_layer_block_kv_transfer(
                self.table, [obj.data_ptr() for obj in objects], self._kernel_blocks(block_ids), self.device,
                self.ops.TransferDirection.D2H, self.desc, self.chunk_tokens,
                self.format, 0)
            done = torch.cuda.Event()
            done.record()
        # The objects live until the kernel has filled them; then they are put in the host pool.
        self.in_flight.append((job_id, done, list(zip(objects, slot_ids))))

    def _put(self, stored: list[tuple[torch.Tensor, int]]) -> None:
        """A completed store's objects into their host slots (on the host: the kernel has written them)."""
        for obj, slot in stored:
            for layer in range(len(self.host_layers)):
                self._host_rows(layer, slot).copy_(obj[:, layer])

    # -- load: received chunks, pinned into temporaries, scattered into the paged blocks --------------
    def scatter_cpu_to_paged_kv(self, chunks: list[torch.Tensor], block_ids: list[int]) -> torch.cuda.Event:
        self.stream.wait_stream(torch.cuda.current_stream())  # the blocks' last use on the forward stream
        pinned_any = False
        with torch.cuda.stream(self.stream):
            temporaries = []
            for chunk in chunks:
                if not chunk.is_pinned():
                    chunk = chunk.pin_memory()  # race: later
                    pinned_any = True
                temporaries.append(chunk)
            self.ops.multi_layer_block_kv_transfer(  # race: queued
                self.table, [t.data_ptr() for t in temporaries], self._kernel_blocks(block_ids), self.device,
                self.ops.TransferDirection.H2D, self.desc, self.chunk_tokens,
                self.format, 0)
            done = torch.cuda.Event()
            done.record()
        if pinned_any and self.sync_temporaries:
            self.stream.synchronize()  # the kernel has read the temporaries before they go back (#4830)
        return done

    def receive(self, slot: int) -> torch.Tensor:
        """A stored object as the transfer context receives it: pageable CPU memory."""
        chunk = torch.empty(self.object_shape, dtype=self.device_layers[0].dtype)
        for layer in range(len(self.host_layers)):
            chunk[:, layer] = self._host_rows(layer, slot)
        return chunk

    def load(self, job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
        done = self.scatter_cpu_to_paged_kv([self.receive(slot) for slot in slot_ids], block_ids)
        self.in_flight.append((job_id, done, None))

    def get_finished(self) -> list[tuple[int, bool]]:
        finished, still = [], deque()
        for job_id, done, stored in self.in_flight:
            if done.query():
                self._put(stored or [])
                finished.append((job_id, True))
            else:
                still.append((job_id, done, stored))
        self.in_flight = still
        return finished

    def wait(self, job_ids: set[int]) -> None:
        for i, (job_id, done, stored) in enumerate(self.in_flight):
            if job_id in job_ids:
                done.synchronize()
                self._put(stored or [])
                self.in_flight[i] = (job_id, done, None)

    def close(self) -> None:
        self.stream.synchronize()


# -- the fuzzer's factories ---------------------------------------------------------------------------

class TransferContextOffloader:
    """The fuzzer's offloader over the harness's cache and host pool."""

    def __init__(self, cache, host_pool, *, sync_temporaries: bool) -> None:
        device_layers, host_layers, seen = [], [], set()
        for spec in cache.spec.tensors:
            if not spec.kv_outer or spec.row_padding:
                raise ValueError(f"geometry {cache.spec.name!r}: the transfer op's table takes K/V-outermost "
                                 f"layers without row padding; use one of {', '.join(GEOMETRIES)}")
            device = cache.layer_tensors[spec.layers[0]]
            if device.data_ptr() not in seen:
                seen.add(device.data_ptr())
                device_layers.append(device)
                host_layers.append(host_pool.layer_tensors[spec.layers[0]])
        ratio = cache.spec.block_size // cache.spec.kernel_block_size
        self.context = TransferContext(device_layers, host_layers, ratio, sync_temporaries=sync_temporaries)

    def store(self, job_id: int, block_ids: list[int], slot_ids: list[int]) -> None:
        self.context.gather(job_id, block_ids, slot_ids)

    def load(self, job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
        self.context.load(job_id, slot_ids, block_ids)

    def get_finished(self) -> list[tuple[int, bool]]:
        return self.context.get_finished()

    def wait(self, job_ids: set[int]) -> None:
        self.context.wait(job_ids)

    def close(self) -> None:
        self.context.close()


def temporaries_freed_on_return(cache, host_pool, runtime=None) -> TransferContextOffloader:
    return TransferContextOffloader(cache, host_pool, sync_temporaries=False)


def temporaries_synced_before_return(cache, host_pool, runtime=None) -> TransferContextOffloader:
    return TransferContextOffloader(cache, host_pool, sync_temporaries=True)


for _factory in (temporaries_freed_on_return, temporaries_synced_before_return):
    _factory.capabilities = OffloaderCapabilities(geometries=GEOMETRIES)


# -- the engine loop ------------------------------------------------------------------------------------

LAYERS, BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM = 2, 8, 4, 2, 8


def main(fixed: bool, steps: int = 4) -> list[float]:
    """Store blocks 0..steps-1 through the context, then retrieve each into block steps+i, one
    retrieve after another as requests arrive; returns each retrieved block's first value."""
    shape = (2, BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM)
    device_layers = [torch.zeros(shape, device="cuda") for _ in range(LAYERS)]
    host_layers = [torch.zeros(shape, pin_memory=True) for _ in range(LAYERS)]
    context = TransferContext(device_layers, host_layers, 1, sync_temporaries=fixed)
    for block in range(steps):
        for layer in device_layers:
            layer[:, block].fill_(block + 1.0)
    context.gather(0, list(range(steps)), list(range(steps)))
    context.wait({0})
    assert context.get_finished() == [(0, True)]  # the store is in the host pool
    for step in range(steps):
        context.load(step + 1, [step], [steps + step])
    context.close()
    return [float(device_layers[layer][kv, steps + step, 0, 0, 0])
            for step in range(steps) for layer in range(LAYERS) for kv in range(2)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="synchronize before the temporaries go (#4830)")
    args = parser.parse_args()
    got = main(args.fixed)
    want = [float(step + 1) for step in range(4) for _ in range(LAYERS) for _ in range(2)]
    print("VALUES OK" if got == want else f"VALUES WRONG: {got}")
    sys.exit(0 if got == want else 1)
