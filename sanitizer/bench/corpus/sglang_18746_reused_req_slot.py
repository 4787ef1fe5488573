"""SGLang #18746: a freed req_pool_idx is rewritten on the scheduler's stream while the forward stream still reads it. RACY (unordered-device-access).

Upstream (issue #18744; attempted fixes #18746 and #18803): with overlap scheduling SGLang processes
batch N-1's results on the default stream while batch N's forward pass runs on the forward stream.
A request found finished there released its ``req_pool_idx`` at once; a new request could take the
slot in the next iteration and ``prepare_for_decode`` rewrote that row of ``req_to_token`` on the
default stream while batch N's attention was still reading the row for the old request: device-side
"index out of bounds" asserts with MTP and wrong KV for the old request.

Here every iteration one request finishes and a new one takes its slot; the scheduler writes the
new request's KV locations into its ``req_to_token`` row on the default stream, the forward stream
waits for the scheduler and gathers every running request's KV through its row. The default
stream's ``req_to_token[slot, :CONTEXT].copy_(...)`` races with the previous iteration's forward-stream
``torch.index_select(kv_pool, 0, req_to_token.view(-1), ...)`` of the same row.
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
POOL_SIZE = 4  # request slots in req_to_token
CONTEXT = 8  # KV locations per request (every request the same length, for a simple check)


def slot_owners(steps: int) -> list[list[int]]:
    """Which request holds each slot at each iteration: at iteration i > 0 the request in slot
    i % POOL_SIZE has finished and request POOL_SIZE + i - 1 takes its slot."""
    owners, slots = [], list(range(POOL_SIZE))
    for iteration in range(steps):
        if iteration > 0:
            slots[iteration % POOL_SIZE] = POOL_SIZE + iteration - 1
        owners.append(list(slots))
    return owners


def kv_locations(request: int) -> torch.Tensor:
    return torch.arange(CONTEXT, dtype=torch.int64) + CONTEXT * request


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    schedule_stream = torch.cuda.current_stream()
    forward_stream = torch.cuda.Stream()
    num_requests = POOL_SIZE + steps
    kv_pool = torch.arange(num_requests * CONTEXT, dtype=torch.float32, device=device) * 10.0 + 1.0
    all_locations = torch.cat([kv_locations(r) for r in range(num_requests)]).view(num_requests, CONTEXT).to(device)
    req_to_token = torch.zeros(POOL_SIZE, CONTEXT, dtype=torch.int64, device=device)
    req_to_token.copy_(all_locations[:POOL_SIZE])  # the first requests' rows
    gathered = torch.zeros(steps, POOL_SIZE, CONTEXT, dtype=torch.float32, device=device)
    next_request = POOL_SIZE

    for iteration in range(steps):
        if iteration > 0:
            # Batch iteration-1's results said the request in this slot finished: the slot was freed at
            # once, and the new request takes it. prepare_for_decode writes its row on the default stream.
            slot = iteration % POOL_SIZE
            req_to_token[slot, :CONTEXT].copy_(all_locations[next_request])  # race: later
            next_request += 1
        forward_stream.wait_stream(schedule_stream)  # the forward pass sees the rows: correct
        with torch.cuda.stream(forward_stream):
            if sleep:
                torch.cuda._sleep(SLEEP_CYCLES)  # the forward pass is busy: its reads run ~10 ms from now
            torch.index_select(kv_pool, 0, req_to_token.view(-1), out=gathered[iteration].view(-1))  # race: queued

    torch.cuda.synchronize()
    got = gathered.cpu()
    kv_host = torch.arange(num_requests * CONTEXT, dtype=torch.float32) * 10.0 + 1.0
    for iteration, owners in enumerate(slot_owners(steps)):
        for slot, request in enumerate(owners):
            want = kv_host[kv_locations(request)]
            if not torch.equal(got[iteration, slot], want):
                raise AssertionError(f"iteration {iteration}: slot {slot} gathered KV {got[iteration, slot].tolist()}, "
                                     f"want request {request}'s {want.tolist()} (its row was rewritten for the next "
                                     f"request before the forward pass read it)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
