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

from chatserve.engine.async_engine import AsyncLLMEngine
from chatserve.sampling_params import StructuredOutputsParams
from chatserve.server.chat.protocol import SamplingFields
from chatserve.server.chat.tool_request import ToolPlan
from chatserve.server.errors import APIError, bad_request
from chatserve.server.json_checks import JSONLimitError, check_value
from chatserve.structured.compiler import GrammarCompilerBusy, GrammarCompileTimeout
from chatserve.tools import tool_grammar


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    param: str  # the request field a compile error names


def check_json_schema(schema: Any, param: str) -> None:
    """A schema that is not a valid JSON Schema is a 400 naming `param` (before the engine sees it).

    Its nesting is bounded first (the request models did it already; a schema built here, e.g. from a
    JSON string, is checked again), so jsonschema's recursive check cannot overflow the stack."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: a JSON schema must be an object", param=param)
    # (imported here: jsonschema and its format checkers are a tenth of a second of a server start that no
    # request with a schema may ever need)
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    try:
        check_value(schema, what="the JSON schema")
        validator_for(schema).check_schema(schema)
    except JSONLimitError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise bad_request(f"{param}: invalid JSON schema{f' at {where}' if where else ''}: {exc.message}",
                          param=param) from None
    except RecursionError:
        raise bad_request(f"{param}: the JSON schema is nested too deeply to check", param=param) from None


def _params(field: str, **kind: Any) -> StructuredOutputsParams:
    """The engine's params of one kind; a value they refuse (an empty regex, ...) is a 400 naming `field`."""
    try:
        return StructuredOutputsParams(**kind)
    except ValueError as exc:
        message = re.sub(r"^structured_outputs(?:\.\w+)?:?\s*", "", str(exc))
        raise bad_request(f"{field}: {message}", param=field) from None


def _from_response_format(body: SamplingFields) -> Constraint | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint(_params("response_format", json_object=True), "response_format")
    if rf.type == "json_schema":
        assert rf.json_schema is not None
        schema = rf.json_schema.json_schema
        check_json_schema(schema, "response_format.json_schema.schema")
        return Constraint(_params("response_format.json_schema.schema", json=schema), "response_format.json_schema.schema")
    if rf.format is not None:
        tag: dict[str, Any] = {"type": "structural_tag", "format": rf.format}
    else:
        tag = {"structures": rf.structures, "triggers": rf.triggers or []}
    return Constraint(_params("response_format", structural_tag=tag), "response_format")


def _from_structured_fields(body: SamplingFields) -> Constraint | None:
    so = body.structured_outputs
    if so is not None and not so.is_empty():
        if so.json_schema is not None:
            if isinstance(so.json_schema, dict):
                check_json_schema(so.json_schema, "structured_outputs.json")
            return Constraint(_params("structured_outputs.json", json=so.json_schema), "structured_outputs.json")
        for kind in ("regex", "choice", "grammar", "structural_tag"):
            if getattr(so, kind) is not None:
                field = f"structured_outputs.{kind}"
                return Constraint(_params(field, **{kind: getattr(so, kind)}), field)
        return Constraint(_params("structured_outputs.json_object", json_object=True), "structured_outputs.json_object")
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
        return Constraint(_params(field, **{guided[field]: value}), field)
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
            return Constraint(_params("tools", structural_tag=tag), "tools")
        return explicit or rf
    return explicit or _from_response_format(body)


_ENGINE_PREFIX = re.compile(r"^structured_outputs(?:\.\w+)?:\s*")


async def check_constraint(engine: AsyncLLMEngine, constraint: Constraint | None, params: Any,
                           timeout_s: float | None = None) -> None:
    """Compile (cached) before queueing: a grammar the engine cannot build, or cannot build within
    `timeout_s`, is a 400 naming the field; a compiler busy with other requests' grammars for that
    long is a 503 (retry). Cancelling the caller (the client left) gives up the compile if it has not
    started."""
    if constraint is None:
        return
    try:
        await engine.check_structured_outputs(params, timeout_s=timeout_s)
    except GrammarCompilerBusy as exc:
        raise APIError(503, f"{constraint.param}: {_ENGINE_PREFIX.sub('', str(exc))}", param=constraint.param,
                       code="grammar_compiler_busy", headers={"Retry-After": "1"}) from None
    except GrammarCompileTimeout as exc:
        message = _ENGINE_PREFIX.sub("", str(exc))
        raise bad_request(f"{constraint.param}: {message}", param=constraint.param, code="grammar_timeout") from None
    except ValueError as exc:
        message = _ENGINE_PREFIX.sub("", str(exc))
        raise bad_request(f"{constraint.param}: {message}", param=constraint.param, code="invalid_grammar") from None
