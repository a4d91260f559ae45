"""Hugging Face's progress bars ("Loading weights", "Writing model shards") off while this package loads, builds
or saves a model: a fit would otherwise draw one on the driver and one per rank, and every save and load another.
The user's own setting is restored after. Only where transformers is already imported (the user's model or
factory imported it): this never imports it."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator


@contextlib.contextmanager
def hf_bars_off() -> Iterator[None]:
    if "transformers" not in sys.modules:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
