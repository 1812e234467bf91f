"""The `jaxserve` logger's default output, as vLLM does it (`VLLM_CONFIGURE_LOGGING`): when the
program has not configured logging itself, the offline API prints jaxserve's INFO lines (load,
KV cache, warm-up phases with their times) to stderr, so `LLM()` is not silent for the tens of
seconds a first start takes. `JAXSERVE_CONFIGURE_LOGGING=0` turns this off; a program that set
up logging (a handler on the root logger, as `jaxserve serve` and pytest do) keeps its own.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def configure_default_logging() -> None:
    if os.environ.get("JAXSERVE_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("jaxserve")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False
