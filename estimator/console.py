"""The driver's console: a line for the user, printed to stderr, where a notebook or a terminal shows it whatever
logging is set up. Used by the fit's reports and the launcher (Ctrl-C); never by the ranks."""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("estimator")


def say_to_user(line: str) -> None:
    """Printed to stderr (and logged at DEBUG). Callers say nothing at verbose=0."""
    print(line, file=sys.stderr, flush=True)
    log.debug(line)
