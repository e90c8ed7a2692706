"""The session API's HTTP side: `/v1/sessions...` (create, read, update, fork, delete, a turn,
regenerate) over a SessionStore. The store itself is the top-level `chatserve.sessions`.

Owns: the session bodies (`protocol`), a turn's prompt over the stored token history
(`prompts`), one turn from the lock to the stored reply (`turn`), the session's KV lease
(`cache`), the `X-Session-Id` header middleware (`header`), and the routes (`routes`).

May import: chat/, streams/, the server's root (context, errors, http_input, ...),
chatserve.sessions and the engine; never openai/ or responses/.
"""
