"""What passes between `AsyncLLMEngine`'s callers and the loop that owns the `LLMEngine`.

Commands go to the loop (`EngineLoop.submit`), which applies them in order at the next step
boundary: the `LLMEngine` is not thread-safe, so nothing touches it while a step runs on the
worker thread. Events come back from the engine side and are applied to the request records
(`RequestLedger.apply`): each one either feeds a stream or ends a request, and every way a request
can end is one of them, so its end is recorded in one place.

One `OutputsReady` carries a whole step's outputs: the hot path costs one message per step, not
one per token or per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chatserve.outputs import RequestOutput

if TYPE_CHECKING:
    from chatserve.engine.request_record import RequestRecord


class EngineDeadError(RuntimeError):
    """The engine loop failed (a model step raised); the engine accepts no more work.

    The original exception is in `cause` (and `__cause__`). Restart the process to recover.
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the engine loop died: {type(cause).__name__}: {cause}; restart the server to recover")
        self.cause = cause
        self.__cause__ = cause


# ---- commands: caller -> loop (applied between steps) ------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Add an accepted request to the `LLMEngine`; skipped if it ended meanwhile (aborted before it got there)."""

    record: RequestRecord


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Take a request out of the `LLMEngine` wherever it stands (waiting for a grammar or a KV tier
    lookup, queued, prefilling, decoding); skipped if it finished in the step that was in flight."""

    record: RequestRecord


@dataclass(frozen=True, slots=True)
class CallInEngine:
    """Run `fn` against the `LLMEngine` between steps and settle `future` with its result or error."""

    fn: Callable[[], Any]
    future: asyncio.Future[Any]


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the loop once the commands queued with it are applied (`shutdown()` then ends what is live)."""


EngineCommand = AddRequest | AbortRequest | CallInEngine | Shutdown


# ---- events: engine side -> request records ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutputsReady:
    """One step's outputs, every request that advanced; a finished output ends its request."""

    outputs: list[RequestOutput]
    step: int  # LLMEngine.num_steps after the step


@dataclass(frozen=True, slots=True)
class RequestAborted:
    """A request left (or never reached) the `LLMEngine` with finish_reason "abort".

    `state` is where the abort found it ("waiting", "prefilling", "decoding"; None if the engine no
    longer knew it) and `blocks_freed` the KV block references it gave back.
    """

    record: RequestRecord
    final: RequestOutput
    state: str | None
    blocks_freed: int
    step: int


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """The `LLMEngine` refused one request when it was added; only that request ends, with `error`."""

    record: RequestRecord
    error: Exception


@dataclass(frozen=True, slots=True)
class EngineDied:
    """A step (or the loop itself) raised: the `LLMEngine`'s state is unknown; every live request
    ends with its own `EngineDeadError`."""

    cause: BaseException


EngineEvent = OutputsReady | RequestAborted | RequestFailed | EngineDied
