"""SGLang #27444: host eviction recycles a cudaHostRegister'ed KV page while its load-back is in flight. RACY (host-write-vs-pending-copy).

Upstream (also #31427): SGLang's hierarchical cache keeps a host KV pool of plain CPU memory
page-locked with ``cudaHostRegister``. ``cache_controller.load()`` queues the host-to-device copies
of a cached prefix and returns at once; the load-back path held a lock on the device pages only,
and host eviction is governed by the host lock. Under host-pool pressure the source page could be
evicted, handed to new KV and overwritten while its copy was still in flight: intermittently
corrupted KV. #27444 takes the host lock before the load is queued and releases it only once the
load's finish event has completed.

Here each step loads one cached prefix page back to the device on the load stream, then needs a
host page for a prefetch from storage: eviction takes the page whose KV is now back on the device
(a duplicate), and the prefetch writes into it. The host write ``self.kv_buffer[page].copy_(...)``
races with the load's queued ``device_kv[...].copy_(self.host_pool.kv_buffer[page], non_blocking=True)``.
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
HOST_PAGES = 8
PAGE_ELEMS = 1024  # one KV page, flattened


def stored_page(key: int) -> torch.Tensor:
    """The KV of prefix page ``key`` as backed up to (or fetched into) the host pool."""
    return torch.arange(PAGE_ELEMS, dtype=torch.float32) + 10000.0 * (key + 1)


class HostKVPool:
    """Plain CPU memory, page-locked with cudaHostRegister, carved into pages."""

    def __init__(self, num_pages: int) -> None:
        self.kv_buffer = torch.zeros(num_pages, PAGE_ELEMS, dtype=torch.float32)
        self.nbytes = self.kv_buffer.numel() * self.kv_buffer.element_size()
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.kv_buffer.data_ptr(), self.nbytes, 0))
        self.key_of = list(range(num_pages))  # which prefix page each host page holds
        for page, key in enumerate(self.key_of):
            self.kv_buffer[page].copy_(stored_page(key))  # the initial backups

    def write_page(self, page: int, key: int) -> None:
        """A prefetch from storage lands in host page ``page``."""
        self.kv_buffer[page].copy_(stored_page(key))  # race: later
        self.key_of[page] = key

    def close(self) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.kv_buffer.data_ptr()))


class CacheController:
    def __init__(self, host_pool: HostKVPool, device_kv: torch.Tensor) -> None:
        self.host_pool = host_pool
        self.device_kv = device_kv
        self.load_stream = torch.cuda.Stream()
        self.evictable: list[int] = []  # host pages whose KV is back on the device, least recent first

    def load(self, page: int, device_page: int, sleep: bool) -> torch.cuda.Event:
        """Queue the load-back of host page ``page``; returns its finish event."""
        start_event = torch.cuda.Event()
        start_event.record()  # on the scheduler's stream: the load goes after what was queued there
        self.load_stream.wait_event(start_event)
        with torch.cuda.stream(self.load_stream):
            if sleep:
                torch.cuda._sleep(SLEEP_CYCLES)  # the load stream is busy: the copy runs ~10 ms from now
            self.device_kv[device_page].copy_(self.host_pool.kv_buffer[page], non_blocking=True)  # race: queued
            finish_event = torch.cuda.Event()
            finish_event.record(self.load_stream)
        self.evictable.append(page)  # BUG: no host lock: eviction may take the page while the copy reads it
        return finish_event

    def evict_one(self) -> int:
        return self.evictable.pop(0)


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    host_pool = HostKVPool(HOST_PAGES)
    try:
        device_kv = torch.zeros(steps, PAGE_ELEMS, dtype=torch.float32, device=device)
        scores = torch.zeros(steps, dtype=torch.float32, device=device)
        controller = CacheController(host_pool, device_kv)
        loaded_keys: list[int] = []
        for step in range(steps):
            page = step % HOST_PAGES  # the prefix this step's request hits in the host cache
            loaded_keys.append(host_pool.key_of[page])
            finish_event = controller.load(page, step, sleep)
            torch.cuda.current_stream().wait_event(finish_event)  # the forward pass reads the loaded KV
            scores[step] = device_kv[step].sum()
            # Host-pool pressure: a prefetch from storage needs a page; the duplicate just loaded goes.
            victim = controller.evict_one()
            host_pool.write_page(victim, HOST_PAGES + step)
        torch.cuda.synchronize()
        got, got_scores = device_kv.cpu(), scores.cpu()
    finally:
        torch.cuda.synchronize()
        host_pool.close()

    for step, key in enumerate(loaded_keys):
        want = stored_page(key)
        if not torch.equal(got[step], want):
            raise AssertionError(f"step {step}: loaded KV starts {got[step, 0].item()}, want prefix page {key}'s "
                                 f"{want[0].item()} (the host page was recycled while its load was in flight)")
        if not torch.allclose(got_scores[step], want.sum()):
            raise AssertionError(f"step {step}: the forward pass saw a sum of {got_scores[step].item()} over the "
                                 f"loaded page, want {want.sum().item()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
