"""LMCache's engine-driven transfer path (examples/lmcache_transfer_context.py), tested as LMCache
tests its GPU connectors: pytest, parametrized over layer counts and dtypes, paged KV filled with
known values, stored through ``multi_layer_block_kv_transfer`` (D2H) and retrieved into other
blocks (H2D), one retrieve after another, the blocks compared once the transfer stream is done.

``ENGINE_STYLE_PLANTED_RACE=1`` retrieves as LMCache did before #4830 (the pinned temporaries are
dropped while the transfer kernel still reads them). Where LMCache is not installed the test runs
only under a tool that stands ``lmcache.c_ops`` in (``pytest --kvz-sanitize``)."""

import os

import pytest
import torch

from examples.lmcache_transfer_context import TransferContext

RACY = os.environ.get("ENGINE_STYLE_PLANTED_RACE") == "1"
NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE = 8, 4, 2, 8


@pytest.fixture(autouse=True)
def _needs_lmcache() -> None:
    try:
        import lmcache.c_ops  # noqa: F401
    except ImportError:
        pytest.skip("needs LMCache's c_ops, or a tool standing it in (pytest --kvz-sanitize)")


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_retrieved_chunks_land_in_their_blocks(num_layers: int, dtype: torch.dtype) -> None:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    kv_caches = [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(num_layers)]
    host = [torch.zeros(shape, dtype=dtype, pin_memory=True) for _ in range(num_layers)]
    context = TransferContext(kv_caches, host, 1, sync_temporaries=not RACY)
    stored = list(range(4))
    for layer, kv in enumerate(kv_caches):
        for block in stored:
            kv[:, block] = torch.full(shape[2:], 10.0 * layer + block + 1, dtype=dtype)
    context.gather(1, stored, stored)
    context.wait({1})
    assert context.get_finished() == [(1, True)]

    for job, block in enumerate(stored, start=2):  # requests arrive one after another
        context.load(job, [block], [block + 4])
    context.close()
    for kv in kv_caches:
        for block in stored:
            torch.testing.assert_close(kv[:, block + 4], kv[:, block])


@torch.inference_mode()
def test_a_store_reports_once_its_objects_are_in_the_host_pool() -> None:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    kv = torch.randn(shape, device="cuda")
    host = torch.zeros(shape, pin_memory=True)
    context = TransferContext([kv], [host], 1, sync_temporaries=not RACY)
    context.gather(7, [3, 5], [0, 1])
    finished = []
    while not finished:
        finished = context.get_finished()
    assert finished == [(7, True)]
    torch.testing.assert_close(host[:, 0], kv[:, 3].cpu())
    torch.testing.assert_close(host[:, 1], kv[:, 5].cpu())
    context.close()
