"""Streams on the wire and streams that outlive their connection.

Owns: server-sent events (`sse`: JSON data lines, event ids, keepalive comments, the race
between work and the client's disconnect), the event logs a logged stream is written to
(`event_log`: in memory, or Redis shared by replicas), runs and their disconnect policy (`runs`:
abort, or detach with a lease) and reading a logged stream back (`resume`).

May import: only the server's foundation (errors, settings) and chatserve.sessions' Redis
helpers: nothing here knows chats, responses or the context, so every layer above can use it.
"""
