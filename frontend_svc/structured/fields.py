"""The structured-output fields of /v1/chat/completions and /v1/completions, and the one
`StructuredOutput` they ask for.

Three spellings, as vLLM accepts them: OpenAI's `response_format` (`text`, `json_object`,
`json_schema`, and vLLM's `structural_tag`), vLLM's `structured_outputs` object (`json`,
`regex`, `choice`, `grammar`, `json_object`, `structural_tag`) and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. A request asks for at most one constraint;
two at once is a 400 naming the second. The frontend checks shapes (a schema is a JSON object,
a choice list is not empty); whether a schema, regex or grammar compiles is the scheduler's
call, and its INVALID_ARGUMENT comes back as a 400 naming the field the client used.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from client.structured import StructuredOutput
from frontend_svc.errors import APIError, bad_request


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: Any = Field(default=None, alias="schema")
    # The schema is always enforced in full; `strict: false` asks for no less.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    # structural_tag's own fields (structures, triggers, format) travel as extras; any other
    # type has none.
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _no_extras(self) -> ResponseFormat:
        extra = sorted(self.model_extra or {})
        if extra and self.type != "structural_tag":
            raise ValueError(f"unknown field(s) for type {self.type!r}: {', '.join(extra)}")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` body field; options this server does not honour are a 400."""

    model_config = ConfigDict(extra="forbid")
    json_: Any = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None


class StructuredFields(BaseModel):
    """Mixed into the request bodies of both routes."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Asked of by vLLM's older clients; not honoured here, so a 400 rather than ignored.
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_output(self) -> tuple[StructuredOutput | None, str | None]:
        """The constraint this request asks for and the field that asked (for error params)."""
        for name in ("guided_decoding_backend", "guided_whitespace_pattern"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} is not supported", name)
        found = [c for c in self._candidates() if c is not None]
        if len(found) > 1:
            names = " and ".join(param for _, param in found)
            raise bad_request(
                f"only one structured output constraint may be given, got {names}", found[1][1]
            )
        return found[0] if found else (None, None)

    def _candidates(self) -> list[tuple[StructuredOutput, str] | None]:
        return [
            _from_response_format(self.response_format),
            _from_structured_outputs(self.structured_outputs),
            _json("guided_json", self.guided_json),
            _text("guided_regex", "regex", self.guided_regex),
            _choice("guided_choice", self.guided_choice),
            _text("guided_grammar", "grammar", self.guided_grammar),
        ]


def _from_response_format(rf: ResponseFormat | None) -> tuple[StructuredOutput, str] | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput("json_object", True), "response_format"
    if rf.type == "structural_tag":
        # vLLM hands the whole response_format object to the grammar engine.
        tag = rf.model_dump(exclude_none=True, exclude={"json_schema"})
        return StructuredOutput("structural_tag", json.dumps(tag)), "response_format"
    param = "response_format.json_schema"
    if rf.json_schema is None:
        raise bad_request("response_format of type json_schema needs a json_schema", param)
    if rf.json_schema.schema_ is None:
        raise bad_request("response_format.json_schema needs a schema", f"{param}.schema")
    return _json(f"{param}.schema", rf.json_schema.schema_)


def _from_structured_outputs(
    so: StructuredOutputsField | None,
) -> tuple[StructuredOutput, str] | None:
    if so is None:
        return None
    given = [k for k, v in so.model_dump(by_alias=True).items() if v not in (None, False)]
    if len(given) != 1:
        raise bad_request(
            "structured_outputs takes exactly one of json, regex, choice, grammar, json_object, "
            f"structural_tag; got {', '.join(given) or 'none'}",
            "structured_outputs",
        )
    kind, param = given[0], f"structured_outputs.{given[0]}"
    if kind == "json":
        return _json(param, so.json_)
    if kind == "choice":
        return _choice(param, so.choice)
    if kind == "json_object":
        return StructuredOutput("json_object", True), param
    if kind == "structural_tag":
        tag = so.structural_tag
        text = tag if isinstance(tag, str) else json.dumps(tag)
        _parse_json(text, param)
        return StructuredOutput("structural_tag", text), param
    return _text(param, kind, getattr(so, kind))


def _parse_json(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise bad_request(f"{param} is not valid JSON: {e}", param) from None


def _json(param: str, schema: Any) -> tuple[StructuredOutput, str] | None:
    if schema is None:
        return None
    if isinstance(schema, str):
        schema = _parse_json(schema, param)
    if not isinstance(schema, dict | bool):
        raise bad_request(
            f"{param} must be a JSON Schema (an object), got {type(schema).__name__}", param
        )
    return StructuredOutput("json_schema", json.dumps(schema, ensure_ascii=False)), param


def _text(param: str, kind: str, value: str | None) -> tuple[StructuredOutput, str] | None:
    if value is None:
        return None
    if not value:
        raise bad_request(f"{param} must not be empty", param)
    return StructuredOutput(kind, value), param


def _choice(param: str, choices: list[str] | None) -> tuple[StructuredOutput, str] | None:
    if choices is None:
        return None
    if not choices:
        raise bad_request(f"{param} must list at least one choice", param)
    return StructuredOutput("choice", list(choices)), param


def name_param(err: APIError, param: str | None) -> APIError:
    """The scheduler's rejection of a constraint (a schema or grammar that does not compile),
    with the field the client used as its `param`."""
    if param is not None and err.status == 400 and "structured_output" in err.message:
        err.param = param
    return err
