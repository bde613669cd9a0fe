"""What a tensor on the wire may be: an allowlist of plain element types and shape bounds.

Shared by the wire codec and by state snapshots (``gossiptrain.state``),
which view downloaded bytes only as one of these types. Part of the
protocol rather than tunables (changing them changes what a valid message
is), hence constants here and not fields of ``Limits``.
"""

from __future__ import annotations

import torch

#: The only tensor element types accepted on the wire, by their wire names.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

MAX_NAME_LEN = 256  # characters in a tensor name
MAX_NDIM = 32  # dimensions of one tensor
