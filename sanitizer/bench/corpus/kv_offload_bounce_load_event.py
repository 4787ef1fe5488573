"""KV offload bounce buffer: each load waits for the previous load's event before refilling the bounce buffer. FIXED (twin of kv_offload_bounce_load_overwrite).

The pattern: one pinned bounce buffer carries KV blocks both ways between the GPU and a CPU store.
Stores synchronize before the host reads the buffer; loads fill it on the host and copy it to the
GPU non-blocking, so a load must not refill it while the previous load's copy is still queued.

Same offloader, the same steps and the same forced delay as the racy twin: an event recorded after
each load's host-to-device copy is synchronized before the next load refills the buffer.
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
BLOCK_ELEMS = 256  # one KV block, flattened
CPU_BLOCKS = 16
COMPUTE_SLOT = 0  # the GPU slot the forward pass writes
LOAD_SLOTS = (1, 2)  # the GPU slots loads go into
LOADS_PER_STEP = 2


def initial_cpu_block(block: int) -> torch.Tensor:
    return torch.arange(BLOCK_ELEMS, dtype=torch.float32) + 1000.0 * block


def computed_block(step: int) -> torch.Tensor:
    return -(torch.arange(BLOCK_ELEMS, dtype=torch.float32) + 1.0 + 1000.0 * step)


def store_target(step: int) -> int:
    return (3 * step) % CPU_BLOCKS


def load_sources(step: int) -> list[int]:
    return [(5 * step + 1 + 7 * j) % CPU_BLOCKS for j in range(LOADS_PER_STEP)]


class BounceOffloader:
    """Moves KV blocks between the GPU and a CPU store through one pinned bounce buffer."""

    def __init__(self, gpu_kv: torch.Tensor, cpu_store: torch.Tensor) -> None:
        self.gpu_kv = gpu_kv
        self.cpu_store = cpu_store
        self.bounce = torch.zeros(BLOCK_ELEMS, dtype=torch.float32, pin_memory=True)  # both directions
        self.loaded: torch.cuda.Event | None = None  # after the last load's copy out of the bounce buffer

    def store(self, slot: int, cpu_block: int) -> None:
        self.bounce.copy_(self.gpu_kv[slot], non_blocking=True)  # device to host
        stored = torch.cuda.Event()
        stored.record()
        stored.synchronize()  # the block is in the bounce buffer
        self.cpu_store[cpu_block].copy_(self.bounce)

    def load(self, cpu_block: int, slot: int, sleep: bool) -> None:
        if self.loaded is not None:
            self.loaded.synchronize()  # the previous load's copy has read the bounce buffer
        self.bounce.copy_(self.cpu_store[cpu_block])
        if sleep:
            torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: the copy below runs ~10 ms from now
        self.gpu_kv[slot].copy_(self.bounce, non_blocking=True)
        self.loaded = torch.cuda.Event()
        self.loaded.record()


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    cpu_store = torch.stack([initial_cpu_block(b) for b in range(CPU_BLOCKS)])  # plain CPU memory
    gpu_kv = torch.zeros(1 + len(LOAD_SLOTS), BLOCK_ELEMS, dtype=torch.float32, device=device)
    computed = torch.stack([computed_block(s) for s in range(steps)]).to(device)
    query = torch.linspace(0.0, 1.0, BLOCK_ELEMS, dtype=torch.float32, device=device)
    scores = torch.zeros(steps, LOADS_PER_STEP, dtype=torch.float32, device=device)
    offloader = BounceOffloader(gpu_kv, cpu_store)

    for step in range(steps):
        gpu_kv[COMPUTE_SLOT].copy_(computed[step])  # the forward pass writes a block
        offloader.store(COMPUTE_SLOT, store_target(step))  # and it is offloaded
        for j, cpu_block in enumerate(load_sources(step)):  # two blocks come back for attention
            slot = LOAD_SLOTS[j]
            offloader.load(cpu_block, slot, sleep)
            scores[step, j] = (gpu_kv[slot] * query).sum()

    torch.cuda.synchronize()
    reference = torch.stack([initial_cpu_block(b) for b in range(CPU_BLOCKS)])
    query_host = torch.linspace(0.0, 1.0, BLOCK_ELEMS, dtype=torch.float32)
    got = scores.cpu()
    for step in range(steps):
        reference[store_target(step)] = computed_block(step)
        for j, cpu_block in enumerate(load_sources(step)):
            want = (reference[cpu_block] * query_host).sum()
            if not torch.allclose(got[step, j], want):
                raise AssertionError(f"step {step}: attention over loaded CPU block {cpu_block} scored "
                                     f"{got[step, j].item()}, want {want.item()} (the GPU slot got another block)")
    if not torch.equal(cpu_store, reference):
        raise AssertionError("the CPU store does not hold the offloaded blocks")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
