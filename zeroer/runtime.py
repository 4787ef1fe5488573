"""The stream runtime a runtime-API zeroer is written against (docs/zeroer-api.md, docs/runtime.md).

It is the device layer's (:mod:`kvdevice.runtime`); this name, which the docs gave it first, stays
for zeroers that import it from here.
"""

from kvdevice.runtime import *  # noqa: F401,F403 - the public names, unchanged
from kvdevice.runtime import __all__  # noqa: F401
