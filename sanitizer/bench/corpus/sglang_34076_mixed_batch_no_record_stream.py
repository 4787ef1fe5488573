"""SGLang #34076, in its mixed-batch shape: the running batch's pool indices, gathered through on the forward stream, dropped without record_stream and reused at another size. RACY (reuse-without-record-stream).

Upstream: with the overlap scheduler and mixed chunked prefill, ``mix_with_running`` aliases the
running batch's ``req_pool_indices`` (made on the scheduler's stream) as ``mix_running_indices``;
on the forward stream ``resolve_forward_inputs`` copies the prefill tokens to the device and
gathers the decode tokens with ``output_tokens_buf[mix_running_indices]``, then concatenates them
into ``input_ids``. Once nothing kept the running batch alive the indices were freed with no
``record_stream``, and the caching allocator handed their block to the scheduler stream's next
allocation, which wrote it while the gather could still be pending. #34076 (open) adds
``mix_running_indices.record_stream(forward_stream)``; it measured 19 of 20 runs corrupted under
expandable segments or cudaMallocAsync.

The tensor that takes the block need not be the same size: CUDA's caching allocator rounds every
small request up to a multiple of 512 bytes and gives it the smallest free block of its stream
that holds it. Here the running batch has 8 to 11 requests (64 to 88 bytes of indices) and the
next batch's ``out_cache_loc`` has 20 slots (160 bytes): the same 512-byte block. The forward
stream's ``output_tokens_buf[mix_running_indices]`` races with the scheduler stream's
``out_cache_loc.copy_(...)`` into the memory it reused. (``sglang_34076_no_record_stream`` is the
same race with tensors of one size.)
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
POOL_SIZE = 64  # request-pool slots; output_tokens_buf has one entry per slot
PREFILL_TOKENS = 4  # the chunked prefill's tokens mixed into every step
EXTEND_SLOTS = 20  # KV slots of the next batch's extend: out_cache_loc's length
KV_SLOTS = 4096


def running_size(step: int) -> int:
    """How many running requests are mixed into the batch at ``step`` (8 to 11)."""
    return 8 + step % 4


def running_slots(step: int) -> list[int]:
    """The request-pool slots of the running requests at ``step``."""
    return [(5 * step + 3 * i + 1) % POOL_SIZE for i in range(running_size(step))]


def prefill_tokens(step: int) -> list[int]:
    return [1000 + PREFILL_TOKENS * step + i for i in range(PREFILL_TOKENS)]


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    schedule_stream = torch.cuda.current_stream()
    forward_stream = torch.cuda.Stream()
    output_tokens_buf = torch.arange(POOL_SIZE, dtype=torch.int64, device=device) * 10 + 7  # last token per slot
    free_kv_slots = torch.arange(KV_SLOTS, dtype=torch.int64, device=device) % POOL_SIZE  # valid as pool slots too
    width = PREFILL_TOKENS + running_size(3)
    input_ids_seen = torch.zeros(steps, width, dtype=torch.int64, device=device)
    cache_locs = torch.zeros(steps, EXTEND_SLOTS, dtype=torch.int64, device=device)

    for step in range(steps):
        # The running batch's pool indices, made on the scheduler's stream; the mixed batch aliases them.
        req_pool_indices = torch.tensor(running_slots(step), dtype=torch.int64).to(device, non_blocking=True)
        mix_running_indices = req_pool_indices
        forward_stream.wait_stream(schedule_stream)  # the forward stream sees the indices: correct
        with torch.cuda.stream(forward_stream):  # resolve_forward_inputs
            prefill = torch.tensor(prefill_tokens(step), dtype=torch.int64).to(device, non_blocking=True)
            if sleep:
                torch.cuda._sleep(SLEEP_CYCLES)  # the forward stream is busy: the gather runs ~10 ms from now
            decode = output_tokens_buf[mix_running_indices]  # race: queued
            input_ids = torch.cat([prefill, decode])
            input_ids_seen[step, :input_ids.numel()].copy_(input_ids)
        # The running batch ages out: BUG, no mix_running_indices.record_stream(forward_stream), so
        # its block is free on the schedule stream at once.
        del req_pool_indices, mix_running_indices
        # The next batch's KV slots: 160 bytes where the indices took 64 to 88, one 512-byte block.
        out_cache_loc = torch.empty(EXTEND_SLOTS, dtype=torch.int64, device=device)
        out_cache_loc.copy_(free_kv_slots[step * EXTEND_SLOTS:(step + 1) * EXTEND_SLOTS])  # race: later
        cache_locs[step].copy_(out_cache_loc)

    torch.cuda.synchronize()
    check(input_ids_seen.cpu(), cache_locs.cpu(), steps)


def check(input_ids_seen: torch.Tensor, cache_locs: torch.Tensor, steps: int) -> None:
    """The forward stream's input ids are the prefill tokens and the running requests' last tokens."""
    for step in range(steps):
        want = prefill_tokens(step) + [slot * 10 + 7 for slot in running_slots(step)]
        got = input_ids_seen[step, :len(want)].tolist()
        if got != want:
            raise AssertionError(f"step {step}: the forward stream's input_ids were {got}, want {want} "
                                 f"(it gathered with the next batch's out_cache_loc as its indices)")
    want_locs = (torch.arange(steps * EXTEND_SLOTS) % POOL_SIZE).view(steps, EXTEND_SLOTS)
    if not torch.equal(cache_locs, want_locs):
        raise AssertionError("the scheduler's out_cache_loc values were not what it copied")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
