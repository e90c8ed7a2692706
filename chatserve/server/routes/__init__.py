"""The HTTP routes, one module per API; each exports `routes()` and imports no other route module.

- `openai`: `/v1/chat/completions`, `/v1/completions`, `/v1/models`
- `sessions`: `/v1/sessions...` (multi-turn chats over a SessionStore)
- `admin`: `/health`, `/metrics`, `/debug/cache`, `/v1/requests/{id}` (cancel)
- `kv_events`: `/get_server_info`, `/kv_event_sources` (what vLLM's router asks before routing by KV events)
- `web`: `/` and `/static` (the browser client)

What they share lives beside this package: `http_input` (body, request id), `params` (body ->
SamplingParams), `generation` (the engine work), `chunks` (OpenAI objects), `streaming` (SSE or
one body).
"""
