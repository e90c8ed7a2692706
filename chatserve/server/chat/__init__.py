"""One chat turn over the engine, as every API family (openai/, sessions/, responses/) runs it.

Owns: the request vocabulary the families share (`protocol`: sampling fields, messages, tools,
structured outputs, refusals), body -> `SamplingParams` (`params`), prompt token ids (`prompts`:
the chat template, or a kept history continued), tool plans and tool-call replies, grammar
constraints (`structured`), the engine requests of one reply (`generation`), what a reply is made
of (`choices`, `chunks`, `cache_usage`) and how it reaches the client (`replies`: SSE chunks, one
body, or a logged run).

May import: the server's root foundation (errors, settings, metrics, tracker, http_input),
context.py, streams/, and the engine's layers (engine/, sessions/, tools/, structured/, ...);
never an API family, admin, or app.
"""
