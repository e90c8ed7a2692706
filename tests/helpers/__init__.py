"""Code shared by the test modules, so each helper exists once.

- `net`: free ports and polling with a deadline;
- `server`: a real `chatserve serve` process on 127.0.0.1 (`start_server`, `ServerProcess`);
- `errors`: the OpenAI error shape every 4xx/5xx body must have (`assert_error`);
- `redis_server`: a throwaway redis-server that tests can kill, freeze and restart;
- `streams`: SSE parsing and a streamed POST read in a background thread;
- `fake_engine`: a model-free stand-in for `AsyncLLMEngine`, for in-process route tests.

Import from the module (`from .helpers.server import start_server` in a test), not from here:
the modules have different dependencies (httpx, redis) and a test pays only for what it uses.
"""
