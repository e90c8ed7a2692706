"""Server options that are not engine options: auth, limits, SSE timing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from chatserve.config import served_names
from chatserve.reasoning import REASONING_PARSERS
from chatserve.tools.formats import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from chatserve.sessions.store import SessionLimits


@dataclass(frozen=True)
class ServerSettings:
    """Everything `create_app` needs besides the engine and the session store.

    The limits bound what one request may ask for, so a single client cannot make the server
    allocate without bound (see docs/serving.md, "Limits"). Each field's default and
    `metadata["help"]` are the only copies: `chatserve serve` generates a flag per field from them.
    """

    api_key: str | None = field(default=None, metadata={
        "help": "require the key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on every route but the web page, "
                "/health, /metrics and a router's /get_server_info, /kv_event_sources (default: none)", "secret": True})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model names clients send and see, space-separated: the first is the one replies report, "
                "a request may name any of them, /v1/models lists each (default: the engine's model name)",
        "nargs": "+"})
    # NOTE: given several names, served_model_name keeps the first and the rest join these (__post_init__).
    served_model_aliases: tuple[str, ...] | None = field(default=None, metadata={
        "help": "more names a request may give for the model, space-separated, also listed by /v1/models: "
                "`--served-model-name A B C` is `--served-model-name A --served-model-aliases B C` (default: none)"})
    sse_keepalive_s: float = field(default=15.0, metadata={
        "help": "seconds between SSE keepalive comments on every stream (queued, prefilling or decoding)"})
    max_body_bytes: int = field(default=2 * 1024 * 1024, metadata={"help": "largest request body in bytes (413 beyond)"})
    max_n: int = field(default=16, metadata={"help": "most choices per request (completions: prompts x n)"})
    max_stop_sequences: int = field(default=16, metadata={"help": "most stop sequences per request"})
    max_stop_length: int = field(default=256, metadata={"help": "longest stop sequence in characters"})
    max_messages: int = field(default=1024, metadata={"help": "most messages in one chat request"})
    max_tools: int = field(default=1024, metadata={
        "help": "most tools in one request (an agent with a few MCP servers sends hundreds); more is a 400"})
    max_stop_token_ids: int = field(default=256, metadata={"help": "most stop_token_ids in one request; more is a 400"})
    max_bad_words: int = field(default=256, metadata={
        "help": "most bad_words in one request (each is tokenised twice and checked every step); more is a 400"})
    grammar_compile_timeout_s: float = field(default=10.0, metadata={
        "help": "seconds a request's grammar (response_format, tools, structured_outputs, guided_*) may take to "
                "compile before the request is refused with a 400 naming the field (compiles run on a small pool "
                "of threads; one still queued when this passes is a 503)"})
    max_logprobs: int = field(default=20, metadata={"help": "largest top_logprobs / logprobs a request may ask for"})
    max_queue_len: int = field(default=256, metadata={
        "help": "requests waiting beyond the engine's running slots; more than this and new ones get 503"})
    retry_after_s: int = field(default=1, metadata={"help": "the Retry-After header of a 503 for a full queue"})
    request_id_max_len: int = field(default=128, metadata={"help": "longest X-Request-Id accepted"})
    finished_request_history: int = field(default=4096, metadata={
        "help": "finished requests whose final state the cancel endpoint still reports (idempotent cancels)"})
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template file used instead of the model's own (default: the model's; with tools, "
                "the model's if it renders tools, else chatserve's shipped xLAM tool template)"})
    tool_call_parser: Literal["hermes", "xlam", "llama3_json", "mistral", "qwen3_coder", "pythonic"] | None = field(
        default=None, metadata={
            "help": "the tool-call format replies are parsed in and constrained to (vLLM's names): hermes, xlam, "
                    "llama3_json, mistral, qwen3_coder or pythonic (default: the chat template's own format, found "
                    "by rendering a call through it; xlam for a template that ignores tools, SmolLM2's). A template "
                    "without that format's syntax gets chatserve's ChatML template for it, which describes the "
                    "tools in the system prompt (docs/tools-and-structured-outputs.md)"})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "how replies' reasoning is split from the answer (vLLM's names): deepseek_r1, qwen3, mistral, "
                "... (`<think>...</think>` or `[THINK]...[/THINK]`); `none` turns it off, so reasoning stays in "
                "the answer and reasoning_effort is refused (default: found from the chat template's markers; "
                "none for a template without them). Forcing one works on any template, the default model's "
                "included (docs/reasoning.md)"})
    reasoning_signing_key: str | None = field(default=None, metadata={
        "help": "the secret that signs the reasoning handed to clients (Messages thinking blocks' signature, "
                "Responses reasoning items' encrypted_content) so that what comes back is rendered only if this "
                "server produced it; replicas behind one router must share it (default: a random key per "
                "process: reasoning from another replica or an earlier run is refused)", "secret": True})
    serve_web: bool = field(default=True, metadata={"help": "serve the browser client at /", "aliases": ("--web",)})
    instance_id: str | None = field(default=None, metadata={
        "help": "this replica's name in every response's X-Chatserve-Instance header, so a client behind a router "
                "can tell which replica served it (default: host:port)"})
    session_turn_lock_ttl_s: float = field(default=120.0, metadata={
        "help": "seconds a session turn's lock lives without a refresh (refreshed while the reply runs): how long "
                "a session stays busy after its replica died mid-turn"})
    kv_lease_seconds: float = field(default=300.0, metadata={
        "help": "seconds an idle session's cached KV is protected from eviction after each turn (renewed every "
                "turn; a session's defaults.kv_lease_seconds overrides it; 0 turns leases off). Soft: leased "
                "blocks are evicted last, never at the cost of a request"})
    event_log_ttl_s: float = field(default=600.0, metadata={
        "help": "seconds a resumable stream's events stay after its last event (Redis with --redis-url, else "
                "memory): how long a dropped client may come back with Last-Event-ID / starting_after"})
    event_log_max_events: int = field(default=10_000, metadata={
        "help": "most events kept per resumable stream (the oldest are trimmed; a cursor before them is a 400)"})
    detach_lease_s: float = field(default=60.0, metadata={
        "help": "disconnect_policy 'detach': seconds a run goes on with no reader before it is aborted and "
                "frees its KV blocks (a request's lease_seconds overrides it)"})
    max_detach_lease_s: float = field(default=3600.0, metadata={
        "help": "largest lease_seconds a request's disconnect_policy may ask for"})
    responses_ttl_s: float = field(default=24 * 3600.0, metadata={
        "help": "seconds a stored response (Responses API: the object, its input items and its conversation's "
                "token ids) is kept after its last write, in Redis with --redis-url, else in memory"})
    responses_max_in_memory: int = field(default=10_000, metadata={
        "help": "most responses kept in memory without --redis-url (the least recently written go first)"})

    allowed_origins: tuple[str, ...] | None = field(default=None, metadata={
        "help": "web origins (scheme://host[:port], space-separated; `*` any) whose pages may call the API besides "
                "the server's own; a request with any other Origin header is a 403 (clients that send no Origin, "
                "curl and the SDKs, are not affected). The listed ones also get CORS headers (default: none)"})
    allowed_hosts: tuple[str, ...] | None = field(default=None, metadata={
        "help": "Host header names the server answers to besides loopback names and the bind address, "
                "space-separated (`.example.com`: it and every name under it; `*`: any). Bound to a loopback "
                "address the Host is always checked (DNS rebinding); bound to another address only when this "
                "is given (default: none)"})
    sse_send_timeout_s: float = field(default=60.0, metadata={
        "help": "seconds one write to a stream may wait for a client that stopped reading; then the stream is "
                "dropped (its request aborted, as on a disconnect)"})
    session_max_count: int = field(default=10_000, metadata={
        "help": "most live sessions (memory or Redis); creating or forking one more is a 429 "
                "(code session_limit_reached) until some expire or are deleted"})
    session_max_bytes: int = field(default=1024 * 1024 * 1024, metadata={
        "help": "most bytes all live sessions may hold together (records, messages, token histories); past it, "
                "creating, forking or starting a turn is a 507 (code session_storage_full)"})
    session_max_ttl_s: float = field(default=30 * 24 * 3600.0, metadata={
        "help": "longest ttl_seconds a session may ask for (a session lives this long after its last write at most)"})

    def session_limits(self) -> SessionLimits:
        """What the session store may hold (create_app hands it to the store)."""
        from chatserve.sessions.store import SessionLimits

        return SessionLimits(max_count=self.session_max_count, max_bytes=self.session_max_bytes,
                             max_ttl_seconds=self.session_max_ttl_s)

    def load_chat_template(self) -> str | None:
        """The --chat-template file's text (read once, at startup, so a bad path fails before serving)."""
        if self.chat_template is None:
            return None
        try:
            with open(self.chat_template, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise ValueError(f"chat_template: cannot read {self.chat_template!r}: {exc}") from None

    def __post_init__(self) -> None:
        # NOTE: several names (the flag's list) become the first plus aliases, so served_model_name stays
        # the one name replies report, and dataclasses.replace keeps both.
        if self.served_model_aliases and self.served_model_name is None:
            raise ValueError("served_model_aliases needs served_model_name (the name replies report)")
        names = served_names(self.served_model_name) + served_names(self.served_model_aliases)
        served_names(names or None)  # (none twice)
        object.__setattr__(self, "served_model_name", names[0] if names else None)
        object.__setattr__(self, "served_model_aliases", names[1:] or None)
        for name in ("allowed_origins", "allowed_hosts"):  # the flag's list as a tuple (hashable, frozen)
            value = getattr(self, name)
            object.__setattr__(self, name, tuple(value) if value else None)
        if self.sse_keepalive_s <= 0:
            raise ValueError(f"sse_keepalive_s must be > 0, got {self.sse_keepalive_s}")
        if not self.kv_lease_seconds >= 0:
            raise ValueError(f"kv_lease_seconds must be >= 0, got {self.kv_lease_seconds}")
        for name in ("event_log_ttl_s", "detach_lease_s", "max_detach_lease_s", "responses_ttl_s", "sse_send_timeout_s",
                     "session_max_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_body_bytes", "max_n", "max_stop_sequences", "max_messages", "max_queue_len",
                     "event_log_max_events", "responses_max_in_memory", "session_max_count", "session_max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_request_limits()
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser: unknown parser {self.tool_call_parser!r}; choose one of: "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser not in (None, "none") and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser: unknown parser {self.reasoning_parser!r}; choose one of: "
                             f"{', '.join(REASONING_PARSERS)}, or none (off)")

    def _check_request_limits(self) -> None:
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        for name in ("max_tools", "max_stop_token_ids", "max_bad_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
