"""Structured outputs on the frontend's request-field hook (request_fields.py): the body's
fields (fields.py) and a chat call's tool_choice become the one ``StructuredOutput`` of the
sampling parameters; under ``--reasoning-parser`` it is moved after the reasoning
(reasoning.py), and strict tools' structural tag names the tokenizer's special markers as
tokens (tool_tags.py); a constraint the scheduler refuses is a 400 naming the client's field.
"""

from __future__ import annotations

import json
from typing import Any

from client.structured import StructuredOutput
from frontend_svc.errors import APIError, bad_request
from frontend_svc.structured.fields import StructuredFields, name_param
from frontend_svc.structured.reasoning import after_reasoning, tag_refs
from frontend_svc.structured.tool_tags import tag_grammar


def tool_constraint(plan: Any) -> StructuredOutput | None:
    """What a chat call's ToolPlan holds the output to: the JSON Schema of tool_choice
    "required" or a named tool, or strict tools' structural tag under "auto"."""
    if plan is None:
        return None
    if plan.schema is not None:
        return StructuredOutput("json_schema", json.dumps(plan.schema, ensure_ascii=False))
    if plan.call_tag is not None:
        return StructuredOutput("structural_tag", json.dumps(plan.call_tag, ensure_ascii=False))
    return None


class StructuredOutputs:
    """A ``RequestFields`` (request_fields.py)."""

    body_fields = StructuredFields

    def to_params(self, body: StructuredFields, params: Any, plan: Any) -> None:
        constraint, field = body.structured_output()
        tool = tool_constraint(plan)
        if tool is not None:
            if constraint is not None:
                raise bad_request(
                    f"tool_choice {plan.mode!r} constrains the output itself; it cannot be "
                    f"combined with {field}",
                    "tool_choice",
                )
            constraint = tool
        params.structured_output = constraint

    async def fit(self, params: Any, plan: Any, state: Any) -> None:
        if state.reasoning is not None:
            # The constraint holds the answer after the reasoning, not the reasoning itself.
            tags = await tag_refs(state)
            params.structured_output = after_reasoning(
                params.structured_output, state.reasoning, tags
            )
        if plan.mode == "auto" and plan.parser is not None and plan.call_tag is not None:
            # Strict tools' structural tag, with markers that are special tokens named as such.
            markers = [m for m in (plan.parser.trigger, plan.parser.end_marker) if m]
            if special := await state.special_markers(markers):
                params.structured_output = StructuredOutput(
                    "grammar", tag_grammar(plan.call_tag, special)
                )

    def named(
        self, err: APIError, body: StructuredFields, plan: Any, alias: str | None
    ) -> APIError:
        if tool_constraint(plan) is not None:
            return name_param(err, "tool_choice")
        field = body.structured_output()[1]
        return name_param(err, alias if alias and field else field)

    def responses_fields(self, body: Any) -> dict[str, Any]:
        return {"response_format": _response_format((body.text or {}).get("format"))}


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """The Responses API's text.format as chat's response_format."""
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object" and len(fmt) == 1:
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request("text.format must be text, json_object or json_schema", "text.format")
