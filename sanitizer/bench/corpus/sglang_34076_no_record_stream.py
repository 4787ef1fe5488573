"""SGLang #34076: mix_running_indices is read on the forward stream, then dropped without record_stream. RACY (reuse-without-record-stream).

Upstream: in SGLang's overlap scheduler a mixed chunked-prefill batch aliases the running batch's
request-pool indices as ``mix_running_indices``, made on the scheduler's stream and read by a
gather on the forward stream. Once nothing kept the old batch alive the tensor was freed with no
``record_stream``, so the caching allocator could hand its memory to the next same-sized tensor on
the scheduler's stream, which wrote it while the forward stream's gather could still be reading
the old indices. With expandable segments or cudaMallocAsync it corrupted 19 of 20 runs (0 of 40
with the default allocator, whose free-list timing hid it). #34076 adds
``mix_running_indices.record_stream(forward_stream)``.

Here each step builds the running requests' pool indices on the scheduler (current) stream, the
forward stream gathers their last tokens from a token map (after ``wait_stream``, correctly), the
indices are dropped, and the scheduler allocates and fills the next batch's ``out_cache_loc``, the
same size. The forward stream's ``torch.index_select(token_map, 0, mix_running_indices, ...)`` races
with the scheduler stream's ``out_cache_loc.copy_(...)`` into the memory it reused.
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
NUM_RUNNING = 8  # running requests mixed into every step's batch
POOL_SIZE = 64  # request-pool slots; the token map has one entry per slot
KV_SLOTS = 4096


def running_slot(step: int, i: int) -> int:
    """The request-pool slot of running request ``i`` at ``step``."""
    return (5 * step + 3 * i + 1) % POOL_SIZE


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    schedule_stream = torch.cuda.current_stream()
    forward_stream = torch.cuda.Stream()
    token_map = torch.arange(POOL_SIZE, dtype=torch.int64, device=device) * 10 + 7  # last token per pool slot
    free_kv_slots = torch.arange(KV_SLOTS, dtype=torch.int64, device=device) % POOL_SIZE  # valid as pool slots too
    relayed = torch.zeros(steps, NUM_RUNNING, dtype=torch.int64, device=device)
    cache_locs = torch.zeros(steps, NUM_RUNNING, dtype=torch.int64, device=device)

    for step in range(steps):
        # The scheduler mixes the running batch into this step: its pool indices, on its stream.
        mix_running_indices = torch.arange(NUM_RUNNING, dtype=torch.int64, device=device)
        mix_running_indices.mul_(3).add_(5 * step + 1).remainder_(POOL_SIZE)
        forward_stream.wait_stream(schedule_stream)  # the forward stream sees the indices: correct
        with torch.cuda.stream(forward_stream):
            if sleep:
                torch.cuda._sleep(SLEEP_CYCLES)  # the forward stream is busy: the gather runs ~10 ms from now
            torch.index_select(token_map, 0, mix_running_indices, out=relayed[step])  # race: queued
        del mix_running_indices  # BUG: no record_stream(forward_stream): its block is free on the schedule stream
        # The next batch's KV slots: same size, so the allocator hands out the block just freed.
        out_cache_loc = torch.empty(NUM_RUNNING, dtype=torch.int64, device=device)
        out_cache_loc.copy_(free_kv_slots[step * NUM_RUNNING:(step + 1) * NUM_RUNNING])  # race: later
        cache_locs[step].copy_(out_cache_loc)

    torch.cuda.synchronize()
    got = relayed.cpu()
    for step in range(steps):
        want = [running_slot(step, i) * 10 + 7 for i in range(NUM_RUNNING)]
        if got[step].tolist() != want:
            raise AssertionError(f"step {step}: the forward stream relayed tokens {got[step].tolist()}, want {want} "
                                 f"(it gathered with the next batch's out_cache_loc as its indices)")
    want_locs = (torch.arange(steps * NUM_RUNNING) % POOL_SIZE).view(steps, NUM_RUNNING)
    if not torch.equal(cache_locs.cpu(), want_locs):
        raise AssertionError("the scheduler's out_cache_loc values were not what it copied")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
