"""`chatserve bench`: benchmarks in the shape of `vllm bench`, so results of both tools compare.

- `serve` (serve.py): the online benchmark against a running server over HTTP/SSE, any
  OpenAI-compatible one; `--save-result` writes vLLM's keys (results.py).
- `latency` (latency.py), `throughput` (throughput.py): offline, the engine in-process (offline.py).

The online side (client.py, datasets.py, text.py, results.py, progress.py, plot.py) imports only
httpx and the standard library: it runs on a client machine without torch, and
benchmarks/serving/bench_serving.py builds its workloads (abort storms, TTFT runs) on the same pieces. This
package may import chatserve's public API (`chatserve.LLM`, `SamplingParams`, `EngineArgs`) and
nothing of the server or the engine's internals.
"""
