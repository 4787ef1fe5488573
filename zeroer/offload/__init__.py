"""KV offload under test: offloaders that store device KV blocks into host slots and load them back.

The second kind of component the fuzzer drives (the first is the zeroer). What an offloader is and
what its factory may declare: :mod:`zeroer.offload.protocol`; the host pool the harness gives it:
:mod:`zeroer.offload.host_pool`; docs/offload-contract.md has the contract in full.
"""

from zeroer.offload.host_pool import HOST_MEMORY, HostPool, build_host_pool
from zeroer.offload.protocol import (BoundOffloader, OffloaderAnswerError, OffloaderCapabilities, OffloaderSpecError,
                                     check_offloader_factory, finished_job_ids)

__all__ = ["HOST_MEMORY", "BoundOffloader", "HostPool", "OffloaderAnswerError", "OffloaderCapabilities",
           "OffloaderSpecError", "build_host_pool", "check_offloader_factory", "finished_job_ids"]
