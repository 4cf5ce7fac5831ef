"""Forced tool calls on the canvas: ``tool_choice`` naming a function, or ``"required"``.

An autoregressive server can only hope the model calls a tool; a diffusion model's canvas can
be given positions (:mod:`mlx_dgemma.canvas`). The answer's opening is fixed to the call's
opening, ``<|tool_call>call:NAME{`` (named) or ``<|tool_call>call:`` (required: the model
writes the name), and the denoiser fills the rest around it. The call it writes is checked:
a declared name, arguments that parse and validate against the tool's JSON schema. If not,
one repair pass re-denoises the arguments with the call's whole frame fixed (the tool's name,
its keys, the quotes around string values, the closing ``}<tool_call|>`` and the
``<|tool_response>`` that ends a call turn) and only the values left to the model, in holes of
a fixed size. What that gives is returned even if it still does not validate, with a note in
the server's log.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from mlx_dgemma.chat_template import STRING_QUOTE, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_RESPONSE_OPEN, ToolCall

log = logging.getLogger("mlx_dgemma.server")

# the positions a repair pass gives each value: the model fills them all (its words, then
# whatever it puts after them, which the value's type then has to parse)
HOLE = {"string": 12, "integer": 3, "number": 4, "boolean": 1, "null": 1}
FIRST_PASS_TOKENS = 512  # the first pass's answer at most: a call not closed by then goes to the repair pass
MAX_REPAIR_KEYS = 16  # a schema with more properties (and none required) is repaired with the first 16
# the repair pass runs without the answer guards (mlx_dgemma.guards): the frame is fixed, only its holes are the model's
GUARDS_OFF = {"commit_entropy": 0, "repetition_trim": 0, "duplicate_drop": 0, "empty_rerolls": 0}
NAME_TOP_LOGPROBS = 20  # "required": the name's positions' most likely tokens, to choose a declared name by


@dataclass(frozen=True)
class Forced:
    """A call the answer must be: ``tools`` the candidates (one when ``named``)."""

    tools: tuple[dict[str, Any], ...]
    named: bool

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None, tool_choice: Any) -> "Forced | None":
        if not tools or not (tool_choice == "required" or isinstance(tool_choice, dict)):
            return None
        return cls(tuple(tools), isinstance(tool_choice, dict))

    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def tool(self, name: str) -> dict[str, Any] | None:
        return next((t for t in self.tools if t["function"]["name"] == name), None)

    def opening(self) -> list[str | int]:
        """The first pass's template pieces (:meth:`mlx_dgemma.canvas.CanvasTemplate.from_pieces`)."""
        if self.named:
            return [TOOL_CALL_OPEN + "call:", self.names()[0], "{"]
        return [TOOL_CALL_OPEN + "call:"]


def check(call: ToolCall | None, forced: Forced) -> str | None:
    """Why ``call`` is not an answer to ``forced`` (None: it is)."""
    if call is None:
        return "no complete, well-formed call"
    tool = forced.tool(call.name)
    if tool is None:
        return f"{call.name!r} is not among the declared tools {forced.names()}"
    try:
        args = json.loads(call.arguments)
    except ValueError as e:
        return f"arguments are not JSON ({e})"
    return validate(args, tool["function"].get("parameters") or {"type": "object"})


# --------------------------------------------------------------------------- JSON schema (the subset tools use)

_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    t = _TYPES.get(kind)
    return t is None or isinstance(value, t)  # an unknown type name constrains nothing


def validate(value: Any, schema: Any, where: str = "arguments") -> str | None:
    """The first way ``value`` breaks ``schema`` (None: it does not), for the keywords function
    declarations use: type, enum, const, properties, required, additionalProperties, items,
    minimum/maximum, minLength/maxLength, minItems/maxItems, anyOf/oneOf/allOf. Others (formats,
    patterns, references) are not checked."""
    if not isinstance(schema, dict):
        return None
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(_is(value, k) for k in kinds):
            return f"{where}: expected {' or '.join(map(str, kinds))}, got {json.dumps(value)[:60]}"
    if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
        return f"{where}: {json.dumps(value)[:60]} is not one of {schema['enum']}"
    if "const" in schema and value != schema["const"]:
        return f"{where}: expected {schema['const']!r}"
    for key, ok in (("minimum", lambda v, m: v >= m), ("maximum", lambda v, m: v <= m)):
        if key in schema and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and isinstance(schema[key], (int, float)) and not ok(value, schema[key]):
            return f"{where}: {value} is beyond its {key} {schema[key]}"
    sized = value if isinstance(value, (str, list)) else None
    if sized is not None:
        low, high = ("minLength", "maxLength") if isinstance(value, str) else ("minItems", "maxItems")
        if isinstance(schema.get(low), int) and len(sized) < schema[low]:
            return f"{where}: shorter than {schema[low]}"
        if isinstance(schema.get(high), int) and len(sized) > schema[high]:
            return f"{where}: longer than {schema[high]}"
    if isinstance(value, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        for key in schema.get("required") or []:
            if key not in value:
                return f"{where}: {key!r} is required"
        for key, v in value.items():
            if key in props:
                problem = validate(v, props[key], f"{where}.{key}")
                if problem:
                    return problem
            elif schema.get("additionalProperties") is False:
                return f"{where}: {key!r} is not a declared property"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            problem = validate(v, schema["items"], f"{where}[{i}]")
            if problem:
                return problem
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key] and \
                all(validate(value, s, where) for s in schema[key]):
            return f"{where}: matches none of its {key} schemas"
    for s in schema.get("allOf") or []:
        problem = validate(value, s, where)
        if problem:
            return problem
    return None


# --------------------------------------------------------------------------- the repair pass


@dataclass
class Frame:
    """A repair pass's template: ``pieces`` (fixed text, and hole sizes), and for each hole the
    value's JSON type, in order; :meth:`arguments` reads the values back from the answer."""

    name: str
    schema: dict[str, Any]
    pieces: list[str | int] = field(default_factory=list)
    holes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, tool: dict[str, Any]) -> "Frame":
        f = tool["function"]
        frame = cls(f["name"], f.get("parameters") or {"type": "object"})
        frame.pieces = [TOOL_CALL_OPEN + "call:", frame.name]
        frame._object(frame.schema)
        frame.pieces.append(TOOL_CALL_CLOSE + TOOL_RESPONSE_OPEN)  # a call turn ends waiting for its result
        return frame

    @staticmethod
    def _kind(schema: Any) -> str:
        kinds = schema.get("type") if isinstance(schema, dict) else None
        kinds = [k for k in (kinds if isinstance(kinds, list) else [kinds]) if k != "null"] or ["string"]
        return kinds[0] if kinds[0] in ("string", "integer", "number", "boolean", "object", "array") else "string"

    @staticmethod
    def keys(schema: dict[str, Any]) -> list[str]:
        """The keys a repair writes: the required ones, or (none required) every declared one;
        sorted, as Gemma 4's template writes them."""
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [k for k in schema.get("required") or [] if isinstance(k, str)]
        return sorted(required or list(props)[:MAX_REPAIR_KEYS])

    def _object(self, schema: dict[str, Any]) -> None:
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        self.pieces.append("{")
        for i, key in enumerate(self.keys(schema)):
            self.pieces.append(("," if i else "") + key + ":")
            self._value(props.get(key, {}))
        self.pieces.append("}")

    def _value(self, schema: Any) -> None:
        kind = self._kind(schema)
        if kind == "object":
            self._object(schema if isinstance(schema, dict) else {})
        elif kind == "array":  # one item: the model writes it, the brackets are given
            self.pieces.append("[")
            self._value(schema.get("items", {}) if isinstance(schema, dict) else {})
            self.pieces.append("]")
        elif kind == "string":
            self.pieces += [STRING_QUOTE, HOLE["string"], STRING_QUOTE]
            self.holes.append("string")
        else:
            self.pieces.append(HOLE[kind])
            self.holes.append(kind)

    def hole_spans(self, encode: Any) -> list[tuple[int, int]]:
        """(start, end) of each hole among the answer's positions."""
        spans, pos = [], 0
        for p in self.pieces:
            if isinstance(p, str):
                pos += len(encode(p))
            else:
                spans.append((pos, pos + p))
                pos += p
        return spans

    def arguments(self, tokens: list[int], tokenizer: Any) -> dict[str, Any]:
        """The values the model wrote into the holes, as the schema's types."""
        values: Iterator[Any] = iter(self._read(tokenizer.decode(tokens[a:b], skip_special=True).strip(), kind)
                                     for (a, b), kind in zip(self.hole_spans(tokenizer.encode), self.holes))
        return self._build(self.schema, values)

    @staticmethod
    def _read(text: str, kind: str) -> Any:
        """A hole's text as ``kind``: a string as it is; a number, its leading number (the rest of
        the hole is what the model put after it); a boolean, true/false; else the text (invalid)."""
        if kind in ("integer", "number"):
            m = re.match(r"-?\d+(\.\d+)?", text)
            if m:
                v = float(m.group())
                return int(v) if kind == "integer" and v.is_integer() else v if math.isfinite(v) else text
            return text
        if kind == "boolean":
            return {"true": True, "false": False}.get(text.split(" ")[0].lower(), text)
        return text

    def _build(self, schema: Any, values: Iterator[Any]) -> Any:
        kind = self._kind(schema)
        if kind == "object":
            schema = schema if isinstance(schema, dict) else {}
            props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            return {k: self._build(props.get(k, {}), values) for k in self.keys(schema)}
        if kind == "array":
            return [self._build(schema.get("items", {}) if isinstance(schema, dict) else {}, values)]
        return next(values)


def choose_name(forced: Forced, tops: list[list[tuple[int, float]]], at: int, encode: Any) -> str:
    """``"required"`` where the model wrote no declared name: the declared name that the model's
    own log-probabilities favour at the name's positions. ``tops[i]``: position i's most likely
    (token id, log-probability) pairs; a name's score sums its tokens' log-probabilities from
    ``at`` on (a token not among the top ones: below the lowest of them). Without them, the
    first declared tool."""
    names = forced.names()
    if len(tops) <= at:
        return names[0]

    def score(name: str) -> float:
        total = 0.0
        for i, t in enumerate(encode(name)):
            if at + i >= len(tops) or not tops[at + i]:
                break
            found = [lp for tok, lp in tops[at + i] if tok == t]
            total += found[0] if found else min(lp for _, lp in tops[at + i]) - 1.0
        return total

    return max(names, key=score)
