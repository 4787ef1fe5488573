"""The integer dtypes whose values the tools read as numpy: index tensors, and tables of raw
addresses (``uint64``, as SGLang's layer tables are), with the numpy type of each."""

from __future__ import annotations

import numpy as np
import torch

NUMPY_INTEGERS: dict[torch.dtype, type] = {
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8}
# torch's wider unsigned dtypes, where this torch has them
NUMPY_INTEGERS.update({getattr(torch, name): kind for name, kind in
                       (("uint64", np.uint64), ("uint32", np.uint32), ("uint16", np.uint16)) if hasattr(torch, name)})

__all__ = ["NUMPY_INTEGERS"]
