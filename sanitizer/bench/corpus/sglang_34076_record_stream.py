"""SGLang #34076: mix_running_indices is record_stream'd on the forward stream before it is dropped. FIXED (twin of sglang_34076_no_record_stream).

Upstream: SGLang's overlap scheduler read ``mix_running_indices`` (made on the scheduler's stream)
in a forward-stream gather and then freed it with no ``record_stream``, so the caching allocator
could give its memory to the next same-sized tensor on the scheduler's stream while the gather was
still pending (#34076). ``wait_stream`` orders execution but does not protect deallocation; the fix
calls ``mix_running_indices.record_stream(forward_stream)``.

Same loop and the same forced delay as the racy twin. With the tensor recorded on the forward
stream, the allocator keeps its block until the forward stream's work queued at the time it was
freed has completed, so ``out_cache_loc`` gets other memory.
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
            torch.index_select(token_map, 0, mix_running_indices, out=relayed[step])
        mix_running_indices.record_stream(forward_stream)  # in use on the forward stream too
        del mix_running_indices
        # The next batch's KV slots: same size, but the block above is not free until the gather ran.
        out_cache_loc = torch.empty(NUM_RUNNING, dtype=torch.int64, device=device)
        out_cache_loc.copy_(free_kv_slots[step * NUM_RUNNING:(step + 1) * NUM_RUNNING])
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
