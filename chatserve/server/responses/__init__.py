"""The Responses API: `/v1/responses` (create, retrieve or resume its stream, cancel, delete,
input items).

Owns: the body and its items (`protocol`), input items -> chat messages (`input`), the event
stream and output items of one response (`events`), one response's run from the first event to
the stored object (`run`), and the routes (`routes`), which wire the ResponseStore
(chatserve/sessions/) on the context.

May import: chat/, streams/, the server's root (context, errors, http_input, ...), the stores of
chatserve/sessions/ and the engine; never openai/ or sessions/ (the server's).
"""
