"""OpenAI's own endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, the resume
route of their logged streams, and the token routes (`/tokenize`, `/detokenize`,
`/v1/chat/completions/render`).

Owns: the chat and text completion bodies (`protocol`), their routes (`routes`), the token
routes (`tokens`).

May import: chat/, streams/, the server's root (context, errors, http_input, ...) and the engine;
never responses/ or sessions/.
"""
