"""JSON Schemas that hold a model to tool calls, for `tool_choice: "required"` and a named
function (the scheduler enforces them as it does any constraint on a request's output).

Named: the output is the function's arguments, so the schema is its `parameters`.
Required: the output is a JSON list of `{"name": <one of the tools>, "parameters": {...}}`,
each item one tool's name (a `const`) with that tool's parameters, at least one item (exactly
one when `parallel_tool_calls` is false). Tools' `$defs` are hoisted to the list schema's root,
where their `#/$defs/...` references point once the parameters sit inside `items`.
"""

from __future__ import annotations

from typing import Any

from frontend_svc.errors import bad_request
from frontend_svc.tool_calling.models import FunctionDefinition

# What a function without `parameters` takes: no arguments.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(function: FunctionDefinition) -> dict[str, Any]:
    return dict(function.parameters) if function.parameters else dict(NO_PARAMETERS)


def call_list_schema(functions: list[FunctionDefinition], *, parallel: bool) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    items = []
    for f in functions:
        params = parameters_schema(f)
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise bad_request(
                    f"tools define $defs.{key} twice, differently; rename one of them", "tools"
                )
            defs[key] = value
        items.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "const": f.name}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def compact_json(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` asking llguidance for compact JSON (", " and ": ", no free whitespace), as the
    scheduler asks of a json_schema constraint, where a schema sits inside a larger constraint
    (a structural tag, the one that lets reasoning through first) and would otherwise let a model pad with whitespace
    without end. A schema's own x-guidance options win."""
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {"x-guidance": options, **schema}
