"""LMCache's transfer context (examples/lmcache_transfer_context.py) in KV format 9,
``TWO_X_NL_X_NB_BS_NH_HS``: SGLang's MHA layout as LMCache's multiprocess daemon sees it, one list
of K planes and one of V planes, ``[NB, BS, NH, HS]`` each, reached through one table of their
addresses (K layers, then V layers). The example's planes are exactly that, so only the format it
passes changes; racy and fixed as the example's (LMCache #4830).

Run::

    python -m pytest fuzz --offloader tests/lmcache_kv_format9.py:temporaries_freed_on_return --backend sim
    python -m sanitizer --backend sim -- python tests/lmcache_kv_format9.py           # exit 1
    python -m sanitizer --backend sim -- python tests/lmcache_kv_format9.py --fixed   # exit 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the checkout's packages

import examples.lmcache_transfer_context as example  # noqa: E402
from zeroer.offload import OffloaderCapabilities  # noqa: E402


class Format9Context(example.TransferContext):
    """The example's transfer context, passing format 9 (LMCache's enum member, by its name)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.format = self.ops.EngineKVFormat.TWO_X_NL_X_NB_BS_NH_HS


class Format9Offloader(example.TransferContextOffloader):
    def __init__(self, cache, host_pool, *, sync_temporaries: bool) -> None:
        super().__init__(cache, host_pool, sync_temporaries=sync_temporaries)
        built = self.context
        built.close()
        self.context = Format9Context(built.device_layers, built.host_layers, built.ratio,
                                      sync_temporaries=sync_temporaries)


def temporaries_freed_on_return(cache, host_pool, runtime=None) -> Format9Offloader:
    return Format9Offloader(cache, host_pool, sync_temporaries=False)


def temporaries_synced_before_return(cache, host_pool, runtime=None) -> Format9Offloader:
    return Format9Offloader(cache, host_pool, sync_temporaries=True)


for _factory in (temporaries_freed_on_return, temporaries_synced_before_return):
    _factory.capabilities = OffloaderCapabilities(geometries=example.GEOMETRIES)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="synchronize before the temporaries go (#4830)")
    fixed = parser.parse_args().fixed
    example.TransferContext = Format9Context  # the example's loop, building its context in format 9
    got = example.main(fixed)
    want = [float(step + 1) for step in range(4) for _ in range(example.LAYERS) for _ in range(2)]
    print("VALUES OK" if got == want else f"VALUES WRONG: {got}")
    sys.exit(0 if got == want else 1)
