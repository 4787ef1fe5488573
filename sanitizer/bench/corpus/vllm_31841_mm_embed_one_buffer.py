"""vLLM #31841: the persistent pinned is_mm_embed mask is rewritten while its async copy is pending. RACY (host-write-vs-pending-copy).

Upstream (issue #31679): for multimodal models vLLM's GPU model runner marks which scheduled tokens
take an image embedding in a persistent pinned boolean buffer, ``is_mm_embed``, and copies it to
the device non-blocking to merge the encoder outputs into the text embeddings. Under
``--async-scheduling`` the next step cleared and rewrote that CPU buffer while the previous step's
copy could still be reading it; Qwen3-VL servers died with ``EngineDeadError`` under sustained
multimodal load. #31841 double-buffers the mask: two pinned buffers, used alternately.

Here each step clears the mask for its scheduled tokens, sets the spans that hold image
placeholders, copies it to the device and merges image and text embeddings with ``torch.where``.
The host write ``is_mm_embed[:total] = False`` of the next step races with this step's queued
``self.is_mm_embed_gpu[:total].copy_(is_mm_embed[:total], non_blocking=True)``.
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
        self.is_mm_embed = torch.zeros(MAX_TOKENS, dtype=torch.bool, pin_memory=True)  # one buffer, every step
        self.is_mm_embed_gpu = torch.zeros(MAX_TOKENS, dtype=torch.bool, device=device)
        self.text_embeds = torch.full((MAX_TOKENS, HIDDEN), TEXT_VALUE, device=device)
        self.mm_embeds = torch.full((MAX_TOKENS, HIDDEN), IMAGE_VALUE, device=device)

    def gather_mm_embeddings(self, step: int, out: torch.Tensor, sleep: bool) -> None:
        total = num_tokens(step)
        is_mm_embed = self.is_mm_embed
        is_mm_embed[:total] = False  # race: later
        for start, length in mm_spans(step):
            is_mm_embed[start:start + length] = True
        if sleep:
            torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: the copy below runs ~10 ms from now
        self.is_mm_embed_gpu[:total].copy_(is_mm_embed[:total], non_blocking=True)  # race: queued
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
