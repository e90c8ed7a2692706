"""Engine options given as one JSON object (vLLM's ``--speculative-config``, ``--structured-outputs-config``).

One reader for all of them, so each says the same things the same way: a flag's text or
``LLM(...)``'s dict is accepted, anything but an object is refused, and a key the option's dataclass
does not have is an error naming ``<option>.<key>`` (never silently ignored). A leaf: imports nothing
of chatserve.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any


def read_json_object(name: str, value: str | Mapping[str, Any]) -> dict[str, Any] | None:
    """A flag's JSON text or a caller's mapping as a dict; None for blank text; anything else a ValueError naming ``name``."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} must be a JSON object: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object; got {type(value).__name__}")
    return dict(value)


def read_json_options(name: str, value: str | dict[str, Any], cls: type) -> dict[str, Any] | None:
    """``value`` as a dict whose keys are all fields of the dataclass ``cls``; None for blank text."""
    options = read_json_object(name, value)
    if options is None:
        return None
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{name}.{unknown[0]} is not a known option (known: {', '.join(sorted(known))})")
    return options
