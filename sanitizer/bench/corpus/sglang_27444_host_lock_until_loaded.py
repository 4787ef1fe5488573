"""SGLang #27444: a host page is held until its load-back's finish event has completed. FIXED (twin of sglang_27444_evict_in_flight_page).

Upstream (also #31427): SGLang's host KV pool (CPU memory page-locked with ``cudaHostRegister``)
could have a page evicted and overwritten while its asynchronous load-back was still reading it.
#27444 takes the host lock before queuing the load and releases it only after the load's finish
event has completed.

Same steps and the same forced delay as the racy twin. ``load()`` locks the host page; eviction
never recycles a locked page: when its choice is locked it first completes that load
(``finish_event.synchronize()``), which releases the lock, and only then hands the page out.
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
        self.kv_buffer[page].copy_(stored_page(key))
        self.key_of[page] = key

    def close(self) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.kv_buffer.data_ptr()))


class CacheController:
    def __init__(self, host_pool: HostKVPool, device_kv: torch.Tensor) -> None:
        self.host_pool = host_pool
        self.device_kv = device_kv
        self.load_stream = torch.cuda.Stream()
        self.evictable: list[int] = []  # host pages whose KV is back on the device, least recent first
        self.host_lock: dict[int, torch.cuda.Event] = {}  # host page -> finish event of its load in flight

    def load(self, page: int, device_page: int, sleep: bool) -> torch.cuda.Event:
        """Queue the load-back of host page ``page``; returns its finish event."""
        start_event = torch.cuda.Event()
        start_event.record()  # on the scheduler's stream: the load goes after what was queued there
        self.load_stream.wait_event(start_event)
        with torch.cuda.stream(self.load_stream):
            if sleep:
                torch.cuda._sleep(SLEEP_CYCLES)  # the load stream is busy: the copy runs ~10 ms from now
            self.device_kv[device_page].copy_(self.host_pool.kv_buffer[page], non_blocking=True)
            finish_event = torch.cuda.Event()
            finish_event.record(self.load_stream)
        self.host_lock[page] = finish_event  # held until the copy has read the page
        self.evictable.append(page)
        return finish_event

    def ack_load(self, page: int) -> None:
        """The load of ``page`` has completed: release its host lock."""
        self.host_lock.pop(page).synchronize()

    def evict_one(self) -> int:
        victim = self.evictable.pop(0)
        if victim in self.host_lock:
            self.ack_load(victim)  # never recycle a page a load is still reading
        return victim


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
