"""A request's output constraint: `response_format`, `structured_outputs`, vLLM's `guided_*`, and its tools.

One `Constraint` per request, with the request field it came from, so a schema the engine cannot
compile is a 400 naming that field (`response_format.json_schema.schema`, `tools`, `guided_regex`,
...), answered before anything is queued. Precedence: tool_choice "required" / named (the reply
must be a call) over `structured_outputs` over `guided_*` over `response_format`; with
tool_choice "auto" a response_format JSON schema joins the tool grammar (a call, or that JSON).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from chatserve.engine.async_engine import AsyncLLMEngine
from chatserve.sampling_params import StructuredOutputsParams
from chatserve.server.chat.protocol import SamplingFields
from chatserve.server.chat.tool_request import ToolPlan
from chatserve.server.errors import bad_request
from chatserve.tools import tool_grammar


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    param: str  # the request field a compile error names


def check_json_schema(schema: Any, param: str) -> None:
    """A schema that is not a valid JSON Schema is a 400 naming `param` (before the engine sees it)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: a JSON schema must be an object", param=param)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise bad_request(f"{param}: invalid JSON schema{f' at {where}' if where else ''}: {exc.message}",
                          param=param) from None


def _from_response_format(body: SamplingFields) -> Constraint | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint(StructuredOutputsParams(json_object=True), "response_format")
    if rf.type == "json_schema":
        assert rf.json_schema is not None
        schema = rf.json_schema.json_schema
        check_json_schema(schema, "response_format.json_schema.schema")
        return Constraint(StructuredOutputsParams(json=schema), "response_format.json_schema.schema")
    if rf.format is not None:
        tag: dict[str, Any] = {"type": "structural_tag", "format": rf.format}
    else:
        tag = {"structures": rf.structures, "triggers": rf.triggers or []}
    return Constraint(StructuredOutputsParams(structural_tag=tag), "response_format")


def _from_structured_fields(body: SamplingFields) -> Constraint | None:
    so = body.structured_outputs
    if so is not None and not so.is_empty():
        if so.json_schema is not None:
            if isinstance(so.json_schema, dict):
                check_json_schema(so.json_schema, "structured_outputs.json")
            return Constraint(StructuredOutputsParams(json=so.json_schema), "structured_outputs.json")
        for kind in ("regex", "choice", "grammar", "structural_tag"):
            if getattr(so, kind) is not None:
                return Constraint(StructuredOutputsParams(**{kind: getattr(so, kind)}), f"structured_outputs.{kind}")
        return Constraint(StructuredOutputsParams(json_object=True), "structured_outputs.json_object")
    guided = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
              "structural_tag": "structural_tag"}
    set_fields = [f for f in guided if getattr(body, f) is not None]
    if len(set_fields) > 1:
        raise bad_request(f"set at most one of {', '.join(guided)}; got {', '.join(set_fields)}", param=set_fields[1])
    if set_fields:
        field = set_fields[0]
        value = getattr(body, field)
        if field == "guided_json" and isinstance(value, dict):
            check_json_schema(value, field)
        return Constraint(StructuredOutputsParams(**{guided[field]: value}), field)
    return None


def request_constraint(body: SamplingFields, plan: ToolPlan | None) -> Constraint | None:
    """The one constraint of this request (see the module docstring for precedence), or None, with
    the request's `structured_outputs` whitespace options (disable_any_whitespace, max_whitespace) on
    it whichever field it came from (a JSON grammar honours them; the server's config fills the rest)."""
    constraint = _request_constraint(body, plan)
    so = body.structured_outputs
    options = so.whitespace_options() if so is not None else {}
    if constraint is None or not options:
        return constraint
    return Constraint(dataclasses.replace(constraint.params, **options), constraint.param)


def _request_constraint(body: SamplingFields, plan: ToolPlan | None) -> Constraint | None:
    if plan is not None and plan.parses_calls:
        for i, tool in enumerate(plan.tools):
            if tool.parameters is not None:
                check_json_schema(tool.parameters, f"tools.{i}.function.parameters")
    explicit = _from_structured_fields(body)
    forced = plan is not None and plan.choice.mode in ("required", "named")
    if plan is not None and (forced or explicit is None):
        rf = _from_response_format(body)
        reply_schema = None
        if rf is not None and not forced:
            # (a structural_tag response_format with tools: the tools' grammar alone)
            reply_schema = rf.params.json if isinstance(rf.params.json, dict) else (
                {"type": "object"} if rf.params.json_object else None)
        tag = tool_grammar(plan.format, plan.tools, plan.choice, plan.parallel, reply_schema)
        if tag is not None:
            return Constraint(StructuredOutputsParams(structural_tag=tag), "tools")
        return explicit or rf
    return explicit or _from_response_format(body)


_ENGINE_PREFIX = re.compile(r"^structured_outputs\.\w+:\s*")


async def check_constraint(engine: AsyncLLMEngine, constraint: Constraint | None, params: Any) -> None:
    """Compile (cached) before queueing: a grammar the engine cannot build is a 400 naming the field."""
    if constraint is None:
        return
    try:
        await engine.check_structured_outputs(params)
    except ValueError as exc:
        message = _ENGINE_PREFIX.sub("", str(exc))
        raise bad_request(f"{constraint.param}: {message}", param=constraint.param, code="invalid_grammar") from None
