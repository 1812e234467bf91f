"""Structured output (JSON schema, regex, choice, grammar) with llguidance: grammar compilation,
per-request matchers and the per-step token bitmask."""

from jaxserve.structured_output.manager import StructuredOutputManager, StructuredRequest

__all__ = ["StructuredOutputManager", "StructuredRequest"]
