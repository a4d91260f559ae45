"""numpy's numbers as Python's: what params, optimizer hyperparameters and checkpoints hold.

A numpy scalar set on a param (`lr=np.float64(0.01)`, a ParamGridBuilder over `np.logspace(...)`) or given to an
optimizer (`Adam(..., lr=np.float64(...))`) would reach the checkpoint as a pickled numpy object, which
`torch.load(weights_only=True)` refuses: the driver could not read its own run back. Numbers are made plain where
they enter (params when set, the optimizer when the driver copies it) and where they leave (the checkpoint)."""
from __future__ import annotations

from typing import Any

import numpy as np


def plain(value: Any) -> Any:
    """`value` with numpy scalars and arrays, also inside lists, tuples and dicts, turned into Python numbers
    and lists; anything else (tensors, modules, strings) as it is."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return type(value)((k, plain(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):  # a namedtuple stays as it is
        return type(value)(plain(v) for v in value)
    return value
