"""Gradient compression for the allreduce, under the names Horovod users pass
(`gradient_compression=Compression.fp16`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Compressor:
    name: str

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class Compression:
    """`none`: full-precision gradients. `fp16`: gradients are cast to float16 for the allreduce
    (DDP's fp16 compression hook) and back: half the traffic, a little precision."""

    none = Compressor("none")
    fp16 = Compressor("fp16")


def compression_name(value: object) -> str:
    """'none' or 'fp16' from a Compressor, one of those strings, or None."""
    if value is None:
        return "none"
    name = value.name if isinstance(value, Compressor) else value
    if name not in ("none", "fp16"):
        raise ValueError(f"The 'gradient_compression' parameter of TorchEstimator must be Compression.none, "
                         f"Compression.fp16 or None. Got {value!r} instead.")
    return str(name)
