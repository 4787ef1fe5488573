"""vLLM #31841: the is_mm_embed mask is double-buffered, each pinned buffer guarded by an event. FIXED (twin of vllm_31841_mm_embed_one_buffer).

Upstream (issue #31679): vLLM rewrote its persistent pinned ``is_mm_embed`` mask for the next step
while the previous step's non-blocking copy of it could still be pending, crashing multimodal
servers under async scheduling. #31841 alternates between two pinned mask buffers.

Same runner and the same forced delay as the racy twin. Step N uses ``is_mm_embed_bufs[N % 2]``;
before the host rewrites a buffer it synchronizes the event recorded right after the copy that last
read it (two steps earlier), so no host write lands under a pending copy however far behind the
device is.
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
MAX_TOKENS = 32
HIDDEN = 8
TEXT_VALUE = 1.0  # every text token's embedding, per element
IMAGE_VALUE = 100.0  # every image token's embedding, per element


def num_tokens(step: int) -> int:
    """Tokens scheduled at ``step``: 24, 28 or 32."""
    return 24 + 4 * (step % 3)


def mm_spans(step: int) -> list[tuple[int, int]]:
    """(start, length) of the image placeholder spans in ``step``'s tokens, all inside the first 24."""
    first = step % 5
    return [(first, 3), (12 + step % 4, 4)]


class ModelRunner:
    def __init__(self, device: torch.device) -> None:
        self.is_mm_embed_bufs = [torch.zeros(MAX_TOKENS, dtype=torch.bool, pin_memory=True) for _ in range(2)]
        self.is_mm_embed_copied: list[torch.cuda.Event | None] = [None, None]  # after each buffer's last copy
        self.is_mm_embed_gpu = torch.zeros(MAX_TOKENS, dtype=torch.bool, device=device)
        self.text_embeds = torch.full((MAX_TOKENS, HIDDEN), TEXT_VALUE, device=device)
        self.mm_embeds = torch.full((MAX_TOKENS, HIDDEN), IMAGE_VALUE, device=device)

    def gather_mm_embeddings(self, step: int, out: torch.Tensor, sleep: bool) -> None:
        total = num_tokens(step)
        index = step % 2
        copied = self.is_mm_embed_copied[index]
        if copied is not None:
            copied.synchronize()  # the copy that last read this buffer has run
        is_mm_embed = self.is_mm_embed_bufs[index]
        is_mm_embed[:total] = False
        for start, length in mm_spans(step):
            is_mm_embed[start:start + length] = True
        if sleep:
            torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: the copy below runs ~10 ms from now
        self.is_mm_embed_gpu[:total].copy_(is_mm_embed[:total], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.is_mm_embed_copied[index] = copied
        mask = self.is_mm_embed_gpu[:total].unsqueeze(1)
        merged = torch.where(mask, self.mm_embeds[:total], self.text_embeds[:total])
        out[:total].copy_(merged.sum(dim=1))  # what the language model sees, per token


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    runner = ModelRunner(device)
    outputs = torch.zeros(steps, MAX_TOKENS, device=device)
    for step in range(steps):  # async scheduling: nothing waits for a step before the next is prepared
        runner.gather_mm_embeddings(step, outputs[step], sleep)

    torch.cuda.synchronize()
    got = outputs.cpu()
    for step in range(steps):
        total = num_tokens(step)
        want = torch.full((total,), TEXT_VALUE * HIDDEN)
        for start, length in mm_spans(step):
            want[start:start + length] = IMAGE_VALUE * HIDDEN
        if not torch.equal(got[step, :total], want):
            wrong = [i for i in range(total) if got[step, i] != want[i]]
            raise AssertionError(f"step {step}: tokens {wrong} got the wrong embedding (image where text was "
                                 f"scheduled or the reverse): the mask copied was another step's")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
