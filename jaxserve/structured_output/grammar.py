"""`StructuredOutputsParams` -> an llguidance grammar, validated against the model's tokenizer.

Host side, no jax. Each kind becomes llguidance's grammar text the way vLLM's guidance backend
builds it (`vllm/v1/structured_output/backend_guidance.py`):
- `json`: the schema (dict or JSON text); `disable_additional_properties` gives every object
  schema without `additionalProperties` an `additionalProperties: false` (OpenAI's `strict`
  maps to it); whitespace between tokens follows the request's `whitespace_pattern`, else the
  engine's (`default_whitespace`: COMPACT_JSON_WHITESPACE unless configured), and is none at
  all with `disable_any_whitespace`;
- `json_object`: the schema `{"type": "object"}`;
- in `json`, `json_object` and `structural_tag` schemas, integers and numbers without bounds are
  bounded (int64; |x| <= 1e18 with at most 10 decimals) and so are the numbers of free values,
  so a sampled number cannot run to max_tokens (`json_numbers.py`), unless the request sets
  `unbounded_json_numbers`;
- `regex`, `choice` (the literal strings), `grammar` (Lark, or GBNF/EBNF converted to Lark);
- `structural_tag`: vLLM's `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`
  JSON, compiled to llguidance's lazy tags (free text until a trigger, then the tag's schema).
Every refusal is a ValueError that names the field and says what is wrong with it (llguidance's
own message: "Unimplemented keys: ["if"]", a regex parse error with its position, ...).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output.json_numbers import bound_json_numbers, json_object_schema


def _no_additional_properties(schema: Any) -> Any:
    """A copy of `schema` where every object schema without `additionalProperties` forbids
    them (vLLM's `process_for_additional_properties`)."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# Whitespace allowed between two JSON tokens by default: one space, or a line break and up to 32
# spaces of indentation (pretty-printed JSON 16 levels deep). llguidance's free default,
# FLEXIBLE_JSON_WHITESPACE, lets a sampled small model emit line breaks until max_tokens (20 of
# 200 seeded samples of a nested schema did on the default model); a bounded gap cannot.
COMPACT_JSON_WHITESPACE = r"(?:[ ]|\n[ ]{0,32})"
FLEXIBLE_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]+"


def _json_options(p: StructuredOutputsParams, default_whitespace: str | None) -> dict:
    """default_whitespace: the engine's pattern; None: no whitespace."""
    pattern = p.whitespace_pattern if p.whitespace_pattern is not None else default_whitespace
    if p.disable_any_whitespace or pattern is None:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": True, "whitespace_pattern": pattern}


def _schema(p: StructuredOutputsParams, free_values: bool = True) -> dict:
    schema = p.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema (an object), got "
                         f"{type(schema).__name__}")
    if schema is True or schema == {}:
        schema = {}
    if p.disable_additional_properties:
        schema = _no_additional_properties(schema)
    return schema if p.unbounded_json_numbers else bound_json_numbers(schema, free_values)


def _structural_tag(text: str, json_options: dict, bounded: bool, free_values: bool) -> str:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
    if not isinstance(spec, dict) or "structures" not in spec or "triggers" not in spec:
        raise ValueError("structured_outputs.structural_tag: only vLLM's form "
                         '{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], '
                         '"triggers": [...]} is supported')
    triggers = spec["triggers"]
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structured_outputs.structural_tag.triggers must be a list of non-empty "
                         "strings")
    tags = []
    for i, s in enumerate(spec["structures"] or []):
        if not isinstance(s, dict) or not {"begin", "end"} <= set(s):
            raise ValueError(f"structured_outputs.structural_tag.structures[{i}] needs 'begin', "
                             "'schema' and 'end'")
        begin, end, schema = s["begin"], s["end"], s.get("schema") or {}
        if not isinstance(begin, str) or not isinstance(end, str) \
                or not isinstance(schema, (str, dict)):
            raise ValueError(f"structured_outputs.structural_tag.structures[{i}]: 'begin' and "
                             "'end' must be strings, 'schema' a JSON schema object")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structured_outputs.structural_tag.structures[{i}].begin {begin!r} "
                             f"starts with none of the triggers {triggers}")
        if isinstance(schema, dict) and bounded:
            schema = bound_json_numbers(schema, free_values)
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": json_options}    # the JSON whitespace rule
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    if not tags:
        raise ValueError("structured_outputs.structural_tag has no structures")
    return llguidance.StructTag.to_grammar(tags)


def grammar_text(p: StructuredOutputsParams,
                 default_whitespace: str | None = COMPACT_JSON_WHITESPACE,
                 free_values: bool = True) -> str:
    """llguidance's grammar for one request's structured_outputs (not yet validated);
    default_whitespace: JSON whitespace unless the request sets its own (None: none);
    free_values=False: the free values of a schema keep llguidance's unbounded numbers."""
    kind = p.kind
    if kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                _schema(p, free_values), defaults=_json_options(p, default_whitespace))
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: invalid JSON schema: {e}") from None
    if kind == "json_object":
        schema = {"type": "object"} if p.unbounded_json_numbers else json_object_schema()
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=_json_options(p, default_whitespace))
    if kind == "regex":
        return llguidance.grammar_from("regex", p.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", p.choice)
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", p.grammar)
        except ValueError as e:
            raise ValueError(f"structured_outputs.grammar: {e}") from None
    return _structural_tag(p.structural_tag, _json_options(p, default_whitespace),
                           bounded=not p.unbounded_json_numbers, free_values=free_values)


def cache_key(p: StructuredOutputsParams) -> str:
    """The same key for specs that compile to the same grammar (dict key order aside)."""
    value = getattr(p, p.kind)
    if p.kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    return json.dumps([p.kind, value, p.disable_any_whitespace, p.disable_additional_properties,
                       p.whitespace_pattern, p.unbounded_json_numbers], sort_keys=True)


def compile_matcher(p: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer,
                    default_whitespace: str | None = COMPACT_JSON_WHITESPACE
                    ) -> llguidance.LLMatcher:
    """A matcher in its initial state; ValueError naming the field when the spec is invalid."""
    grammar = _grammar(p, default_whitespace, free_values=True)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error and not error.startswith("WARNING") and p.kind in ("json", "structural_tag") \
            and not p.unbounded_json_numbers:
        # e.g. two bounded free values intersected (json_numbers._bound): bound only the
        # schema's own integers and numbers
        grammar = _grammar(p, default_whitespace, free_values=False)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"structured_outputs.{p.kind}: {_first_lines(error)}")
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"structured_outputs.{p.kind}: {_first_lines(matcher.get_error())}")
    return matcher


def _grammar(p: StructuredOutputsParams, default_whitespace: str | None,
             free_values: bool) -> str:
    try:
        return grammar_text(p, default_whitespace, free_values)
    except (TypeError, AssertionError, AttributeError, KeyError) as e:
        # llguidance's Python helpers assert on some malformed inputs: still the request's fault
        raise ValueError(f"structured_outputs.{p.kind}: invalid specification: {e!r}") from None


def _first_lines(message: str, n: int = 6) -> str:
    lines = message.strip().splitlines()
    return "\n".join(lines[:n]) + (" ..." if len(lines) > n else "")
