"""SGLang #36738: HiCache load-back is fenced behind the forward stream. FIXED (twin of sglang_36738_load_unfenced).

Upstream: SGLang's hierarchical-cache load-back restored a cached prefix into freshly reallocated
device pages on the transfer engine's ``host_to_device_stream``, ordered only after the scheduler's
stream, while the forward pass of the request that had just freed those pages could still be
writing them (#36738). The fix points the cache controller's load fence at the forward stream:
``host_to_device_stream.wait_stream(forward_stream)`` before the load's copies are submitted.

Same rounds and the same forced delay as the racy twin; with the fence the load lands after every
forward-stream write queued before it, so the restored prefix survives.
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
PAGE_ELEMS = 64  # one KV page, flattened
PAGES_PER_REQ = 2
HOST_PAGES = 32


def page_range(round_: int) -> slice:
    """The device pages the request computed in ``round_`` occupies (two ranges, alternating)."""
    start = (round_ % 2) * PAGES_PER_REQ
    return slice(start, start + PAGES_PER_REQ)


def host_prefix(round_: int) -> slice:
    """The host pages holding the cached prefix that round ``round_`` loads back."""
    start = (round_ * 3 * PAGES_PER_REQ) % HOST_PAGES
    return slice(start, start + PAGES_PER_REQ)


def host_pool_values() -> torch.Tensor:
    """The host KV pool: page p holds 100000 + 1000 p + 0..63."""
    return torch.arange(PAGE_ELEMS, dtype=torch.float32) + 1000.0 * torch.arange(HOST_PAGES).unsqueeze(1) + 100000.0


def computed_kv(round_: int) -> torch.Tensor:
    """The KV the forward pass computes in ``round_`` (negative: never a host page's values)."""
    return -(torch.arange(PAGES_PER_REQ * PAGE_ELEMS, dtype=torch.float32) + 1.0 + 1000.0 * round_)


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    schedule_stream = torch.cuda.current_stream()
    forward_stream = torch.cuda.Stream()
    host_to_device_stream = torch.cuda.Stream()
    host_pool = host_pool_values().pin_memory()  # backed-up KV, written once
    device_pool = torch.zeros(2 * PAGES_PER_REQ, PAGE_ELEMS, dtype=torch.float32, device=device)
    new_kv = torch.stack([computed_kv(r).view(PAGES_PER_REQ, PAGE_ELEMS) for r in range(steps)]).to(device)
    restored = torch.zeros(steps, PAGES_PER_REQ, PAGE_ELEMS, dtype=torch.float32, device=device)
    loaded: torch.cuda.Event | None = None

    for round_ in range(steps):
        if round_ > 0:
            # Load-back: a request hits the host cache; its prefix goes into the pages just freed.
            pages = page_range(round_ - 1)
            start_event = torch.cuda.Event()
            start_event.record(schedule_stream)
            host_to_device_stream.wait_event(start_event)
            host_to_device_stream.wait_stream(forward_stream)  # the load fence: after the forward pass's writes
            with torch.cuda.stream(host_to_device_stream):
                device_pool[pages].copy_(host_pool[host_prefix(round_)], non_blocking=True)
                loaded = torch.cuda.Event()
                loaded.record(host_to_device_stream)
        forward_stream.wait_stream(schedule_stream)
        with torch.cuda.stream(forward_stream):
            if loaded is not None:
                forward_stream.wait_event(loaded)  # the forward pass reads the restored prefix after the load
                restored[round_].copy_(device_pool[page_range(round_ - 1)])
            if sleep:
                torch.cuda._sleep(SLEEP_CYCLES)  # the forward pass is slow: its KV writes land ~10 ms from now
            device_pool[page_range(round_)].copy_(new_kv[round_])
        # The request computed this round finishes: its pages are freed now, its writes maybe in flight.

    torch.cuda.synchronize()
    host = host_pool_values()
    got = restored.cpu()
    for round_ in range(1, steps):
        want = host[host_prefix(round_)]
        if not torch.equal(got[round_], want):
            first = got[round_, 0, 0].item()
            raise AssertionError(f"round {round_}: the restored prefix starts {first}, want {want[0, 0].item()} "
                                 f"(round {round_ - 1}'s KV writes landed on the loaded pages)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
