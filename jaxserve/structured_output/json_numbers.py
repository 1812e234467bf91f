"""Bounded JSON number literals: a JSON schema rewritten so that no sampled number can grow
until max_tokens.

Host side, no jax. llguidance writes an unbounded `integer` or `number`, and every number of a
free JSON value, as `-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?`, and a small model keeps
sampling digits: 3 of 34 seeded `City` samples (`"founded": {"type": "integer"}`) on the default
model ran to max_tokens (`"founded": 12320131282726214885...`). llguidance 1.9 has no option for
the length of a number, but it compiles `minimum`, `maximum` and `multipleOf` to exact regexes,
so `bound_json_numbers` adds them where the schema sets none (a schema's own bounds are kept):
- integer: [INT_MIN, INT_MAX], int64 (what JSON parsers with 64-bit integers read) except its
  1024 lowest values: llguidance holds bounds as float64 (1024 apart near 2**63) and cannot build
  a range ending at -2**63 (negating it overflows i64); 2**63 - 1 is exact (clamped to i64's max).
- number: |x| <= NUMBER_MAX (1e18) with at most 10 digits after the point (multipleOf 1e-10), no
  exponent: at most 31 characters, always a finite float64 (JSON parsers round to 17 significant
  digits anyway). llguidance's ranges are written without exponent and read the integer part as an
  i64, and a multipleOf finer than 1e-10 fails its float64-to-decimal conversion ("too many
  digits"), so the usual "17 significant digits, 3 exponent digits" cannot be written.
- a free JSON value (`json_object`; `{}` or a schema of annotations alone; an object without
  `additionalProperties`; an array without `items`) becomes `$defs/ANY_VALUE`: llguidance's
  any-value with the number rule.
`StructuredOutputsParams(unbounded_json_numbers=True)` skips the rewrite (vLLM's behaviour).
"""

from __future__ import annotations

from typing import Any

INT_MIN = -(2**63) + 1024
INT_MAX = 2**63 - 1
NUMBER_MAX = 1e18
NUMBER_STEP = 1e-10

ANY_VALUE = "jaxserve_json_value"
ANY_REF = {"$ref": f"#/$defs/{ANY_VALUE}"}
ANY_SCHEMA = {"anyOf": [
    {"type": "null"}, {"type": "boolean"}, {"type": "string"},
    {"type": "number", "minimum": -NUMBER_MAX, "maximum": NUMBER_MAX, "multipleOf": NUMBER_STEP},
    {"type": "array", "items": ANY_REF},
    {"type": "object", "additionalProperties": ANY_REF},
]}

_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref")
# A schema of these keywords alone (pydantic's `Any` field: {"title": "X"}) is a free value
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated",
                "readOnly", "writeOnly"}


def json_object_schema() -> dict:
    """`json_object`: any JSON object, its numbers bounded."""
    return {"type": "object", "additionalProperties": dict(ANY_REF),
            "$defs": {ANY_VALUE: ANY_SCHEMA}}


def bound_json_numbers(schema: Any, free_values: bool = True) -> Any:
    """A copy of `schema` (a dict or bool) with the bounds of the module docstring;
    free_values=False: only the schema's own integers and numbers (see `_bound`)."""
    if not free_values:
        return _bound(schema, False) if isinstance(schema, dict) else schema
    if _is_free(schema):
        return {**ANY_REF, "$defs": {ANY_VALUE: ANY_SCHEMA}}
    if not isinstance(schema, dict):
        return schema
    out = _bound(schema, True)
    out["$defs"] = {**out.get("$defs", {}), ANY_VALUE: ANY_SCHEMA}
    return out


def _bound(schema: dict, free: bool) -> dict:
    """free: free values in `schema` may become ANY_REF. llguidance intersects a schema's own
    keywords with each of its anyOf/oneOf/allOf/$ref targets, and allOf members with each other,
    and intersecting ANY_VALUE with itself never ends ("Schema intersection stack level
    exceeded"): so a schema with one of those keeps its own free values, as do allOf members.
    (The grammar builder retries with free_values=False should two ANY_REFs still meet, e.g.
    through two $refs to one definition.)"""
    out = dict(schema)
    own = free and not any(k in out for k in _COMBINATORS)
    for key in ("items", "additionalProperties", "additionalItems"):
        if isinstance(out.get(key), (dict, bool)):
            out[key] = _sub(out[key], own)
    for key, free_here in (("items", own), ("prefixItems", own), ("anyOf", free),
                           ("oneOf", free), ("allOf", False)):
        if isinstance(out.get(key), list):
            out[key] = [_sub(s, free_here) for s in out[key]]
    for key, free_here in (("properties", own), ("patternProperties", own),
                           ("dependentSchemas", False), ("$defs", free), ("definitions", free)):
        if isinstance(out.get(key), dict):
            out[key] = {name: _sub(s, free_here) for name, s in out[key].items()}
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if own and ("object" in types or "properties" in out) \
            and out.get("additionalProperties", True) is True:
        out["additionalProperties"] = dict(ANY_REF)
    if own and "array" in types and "items" not in out:
        out["items"] = dict(ANY_REF)
    if "enum" in out or "const" in out:
        pass                                # literals: as long as the schema writes them
    elif "number" in types:
        _add_bounds(out, -NUMBER_MAX, NUMBER_MAX)
        out.setdefault("multipleOf", NUMBER_STEP)
    elif "integer" in types:
        _add_bounds(out, INT_MIN, INT_MAX)
    return out


def _sub(schema: Any, free: bool) -> Any:
    if free and _is_free(schema):
        return dict(ANY_REF)
    return _bound(schema, free) if isinstance(schema, dict) else schema


def _is_free(schema: Any) -> bool:
    return schema is True or isinstance(schema, dict) and set(schema) <= _ANNOTATIONS


def _add_bounds(schema: dict, low: float, high: float) -> None:
    """Adds the missing side(s); none when the schema's own other side lies beyond it."""
    lows = [schema[k] for k in ("minimum", "exclusiveMinimum")
            if isinstance(schema.get(k), (int, float)) and not isinstance(schema[k], bool)]
    highs = [schema[k] for k in ("maximum", "exclusiveMaximum")
             if isinstance(schema.get(k), (int, float)) and not isinstance(schema[k], bool)]
    if not lows and not any(h < low for h in highs):
        schema["minimum"] = low
    if not highs and not any(lo > high for lo in lows):
        schema["maximum"] = high
