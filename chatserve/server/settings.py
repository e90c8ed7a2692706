"""Server options that are not engine options: auth, limits, SSE timing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    """Everything `create_app` needs besides the engine and the session store.

    The limits bound what one request may ask for, so a single client cannot make the server
    allocate without bound (see docs in README "Limits").
    """

    api_key: str | None = None
    served_model_name: str | None = None  # None: the engine's model name
    sse_keepalive_s: float = 15.0
    max_body_bytes: int = 2 * 1024 * 1024
    max_n: int = 16
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    max_messages: int = 1024
    max_logprobs: int = 20
    # Requests waiting beyond the engine's running slots; more than this and new ones get 503.
    max_queue_len: int = 256
    retry_after_s: int = 1
    request_id_max_len: int = 128
    # Finished requests whose final state the cancel endpoint still reports (idempotent cancels).
    finished_request_history: int = 4096
    serve_web: bool = True

    def __post_init__(self) -> None:
        if self.sse_keepalive_s <= 0:
            raise ValueError(f"sse_keepalive_s must be > 0, got {self.sse_keepalive_s}")
        for name in ("max_body_bytes", "max_n", "max_stop_sequences", "max_messages", "max_queue_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
