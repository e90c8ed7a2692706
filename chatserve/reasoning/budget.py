"""THE budget table: every API's reasoning control maps to a number of reasoning tokens here.

``budget_tokens`` is how many tokens the model may spend inside its reasoning before the engine
forces the end marker (llama-server's ``--reasoning-budget``); None is no bound but ``max_tokens``.

============  ==========================================  ==========================
value         OpenAI ``reasoning_effort`` / Responses      Messages ``output_config``
              ``reasoning.effort``                         ``.effort``
============  ==========================================  ==========================
``none``      0 (no reasoning: the end marker at once)     -
``minimal``   256                                          -
``low``       1024                                         1024
``medium``    4096                                         4096
``high``      16384                                        16384
``xhigh``     32768                                        32768
``max``       -                                            None (unbounded)
============  ==========================================  ==========================

An explicit token count (Messages ``thinking.budget_tokens``) wins over an effort.
"""

from __future__ import annotations

# Which field each API's effort arrives in, for the error message.
EFFORT_FIELDS: dict[str, str] = {
    "openai": "reasoning_effort",
    "responses": "reasoning.effort",
    "messages": "output_config.effort",
}

OPENAI_EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": 32768,
}

MESSAGES_EFFORT_BUDGETS: dict[str, int | None] = {
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": 32768,
    "max": None,
}


def effort_table(api: str) -> dict[str, int | None]:
    """The effort -> budget table an API reads (``openai`` and ``responses`` share one)."""
    if api not in EFFORT_FIELDS:
        raise ValueError(f"unknown API {api!r} for a reasoning effort; choose one of {', '.join(EFFORT_FIELDS)}")
    return MESSAGES_EFFORT_BUDGETS if api == "messages" else OPENAI_EFFORT_BUDGETS


def budget_for_effort(effort: str, *, api: str) -> int | None:
    """The reasoning budget of ``effort`` in ``api``'s field; ``ValueError`` naming the field otherwise."""
    table = effort_table(api)
    if not isinstance(effort, str) or effort not in table:
        raise ValueError(f"{EFFORT_FIELDS[api]} must be one of {', '.join(table)}; got {effort!r}")
    return table[effort]
