"""Tools in a chat request (OpenAI's shape) and what `tool_choice` makes of them: a `ToolPlan`
saying how the output is constrained (a JSON Schema for `required` and a named function, a
structural tag for strict tools under `auto`; the constraint's feature turns them into the
request's constraint) and read back (a parser for `auto`, the forced shapes otherwise).

As vLLM: with tools and no `tool_choice`, the choice is `auto`; `auto` needs the frontend to
have been started with `--enable-auto-tool-choice` and a `--tool-call-parser`; `none` keeps the
tools in the prompt (the template may describe them) and reads no calls back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend_svc.errors import bad_request
from frontend_svc.tool_calling.models import FunctionDefinition, NamedToolChoice, Tool, ToolChoice
from frontend_svc.tool_calling.parsers import ToolParser, parser_class
from frontend_svc.tool_calling.parsers.forced import CallListParser, NamedCallParser
from frontend_svc.tool_calling.schema import call_list_schema, compact_json, parameters_schema


@dataclass(slots=True)
class ToolPlan:
    """How one chat call treats tools: `mode` is the effective tool_choice ("none", "auto",
    "required" or "named"); `schema` or `call_tag` what the output is held to; `parser` reads
    calls."""

    mode: str
    tools: list[dict[str, Any]] | None = None  # handed to the chat template
    # "required" and "named": the JSON Schema of the whole output.
    schema: dict[str, Any] | None = None
    parser: ToolParser | None = None
    # parallel_tool_calls: false under "auto": calls past the first are not reported (under
    # "required" the schema allows one).
    max_calls: int | None = None
    # "auto" with strict tools: the structural tag of their calls (strict_call_tag).
    call_tag: dict[str, Any] | None = None


@dataclass(slots=True)
class ToolConfig:
    """The frontend's flags: `--enable-auto-tool-choice` and `--tool-call-parser`."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


def plan_tools(
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    config: ToolConfig,
) -> ToolPlan:
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return ToolPlan("none")
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", dumped)
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                "tool_choice",
            )
        parser = parser_class(config.tool_call_parser)()
        max_calls = 1 if parallel_tool_calls is False else None
        tag = strict_call_tag([t.function for t in tools], parser)
        return ToolPlan("auto", dumped, None, parser, max_calls, tag)
    functions = [t.function for t in tools]
    if choice == "required":
        schema = call_list_schema(functions, parallel=parallel_tool_calls is not False)
        return ToolPlan("required", dumped, schema, CallListParser())
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    function = next((f for f in functions if f.name == name), None)
    if function is None:
        raise bad_request(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    return ToolPlan("named", dumped, parameters_schema(function), NamedCallParser(name))


def strict_call_tag(
    functions: list[FunctionDefinition], parser: ToolParser
) -> dict[str, Any] | None:
    """Under "auto", strict tools' arguments held to their schemas: a structural tag whose
    trigger is the parser's start of a call, so text outside calls stays free. Once one tool is
    strict every tool gets a structure (the others any JSON object), since a call of a tool
    left out could not be written at all after the trigger."""
    if not any(f.strict for f in functions):
        return None
    structures = []
    for f in functions:
        schema = parameters_schema(f) if f.strict else {"type": "object"}
        schema = compact_json(schema)
        structure = parser.call_structures(f.name, schema)
        if structure is None:
            raise bad_request(
                f'strict tools under tool_choice "auto" are not supported with the '
                f'{parser.name!r} tool call parser; use tool_choice "required" or a named tool',
                "tools",
            )
        structures.append(structure)
    return {"type": "structural_tag", "structures": structures, "triggers": [parser.trigger]}
