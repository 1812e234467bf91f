"""Kernels that fail to compile at warm-up fall back to the next choice instead of crashing.

`auto` picks only kernels with a GPU measurement (jaxserve/pallas/measured.py), but a kernel asked
for by name, or one measured on another jax/driver, can still fail in LLVM or ptxas, which no CPU
gate reaches. The engine builds its runner (KV sizing profile + warm-up, which compile every step
program) once per choice in `fallback_plan` order, the least proven component dropped first: the
FP8 matmul to XLA, then the attention backend along `attention.backend.FALLBACK`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from jaxserve.attention.backend import FALLBACK

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Choice(NamedTuple):
    attention: str          # "mosaic", "pallas" or "reference"
    fp8: str | None         # "pallas", "xla", or None (no FP8 weights)

    def __str__(self) -> str:
        return f"attention {self.attention}" + ("" if self.fp8 is None else f", fp8 matmul {self.fp8}")


def fallback_plan(attention: str, fp8: str | None) -> list[Choice]:
    """The choices to try in order, starting with the selected one."""
    plan = [Choice(attention, fp8)]
    if fp8 == "pallas":
        fp8 = "xla"
        plan.append(Choice(attention, fp8))
    plan += [Choice(a, fp8) for a in FALLBACK[attention]]
    return plan


def build_with_fallback(plan: list[Choice], build: Callable[[Choice], T]) -> tuple[Choice, T]:
    """`build(choice)` for the first choice of `plan` that does not raise. A failure logs a
    warning naming the choice and the error and tries the next; the last choice's error is
    raised as it is (the XLA reference path failing is not a kernel problem)."""
    for i, choice in enumerate(plan):
        if i == len(plan) - 1:
            return choice, build(choice)
        try:
            return choice, build(choice)
        except Exception as e:      # compile errors come as many types (XlaRuntimeError, Mosaic, ...)
            logger.warning("%s failed to compile or run at warm-up (%s: %s); falling back to %s",
                           choice, type(e).__name__, str(e).splitlines()[0] if str(e) else "",
                           plan[i + 1])
    raise AssertionError("empty fallback plan")
