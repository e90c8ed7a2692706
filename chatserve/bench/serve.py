"""`chatserve bench serve`: the online serving benchmark, with `vllm bench serve`'s flags and result.

Streams every request of a dataset (chatserve/bench/datasets.py) to a running server over SSE and
times each chunk (chatserve/bench/client.py): arrivals at `--request-rate` per second (a gamma
process with `--burstiness`, Poisson at 1, as vLLM's; `inf` sends all at once), at most
`--max-concurrency` in flight, then the table and `--save-result` file of chatserve/bench/results.py
under vLLM's keys. The flags are vLLM's where vLLM has one (`--endpoint /v1/completions` and
`--backend openai-chat` are understood too), so the same command line runs against both servers.
The `random`, `sharegpt-like` and `prefix` datasets use only OpenAI endpoints and work against any
OpenAI-compatible server; `sessions` needs chatserve's session API and says so when it is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import os
import random
import sys
import time
from typing import Any

import httpx

from chatserve.bench.client import RequestOutput, api_root, first_model, stream_request
from chatserve.bench.datasets import DATASETS, SampleRequest, conversations, get_samples
from chatserve.bench.progress import Progress
from chatserve.bench.results import PERCENTILE_METRICS, compute_metrics, format_summary, result_filename, save_result

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BACKENDS = ("openai", "openai-chat", "vllm", "chatserve")


class BenchError(Exception):
    """The benchmark cannot run as asked (no model, no session API, the first request failed)."""


def _int_at_least(lo: int):
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return value

    convert.__name__ = "int"
    return convert


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a number > 0 (or inf), got {text!r}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def _endpoint(text: str) -> str:
    """chat / completions, or vLLM's spelling as a path (/v1/chat/completions, /v1/completions)."""
    key = text.strip()
    for name, path in ENDPOINTS.items():
        if key in (name, path, path.removeprefix("/v1")):
            return name
    raise argparse.ArgumentTypeError(f"expected chat, completions, /v1/chat/completions or /v1/completions, got {text!r}")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is "
                                                    "accepted) [default: http://--host:--port]")
    g.add_argument("--host", default="127.0.0.1", help="with --port, the server when --base-url is not given")
    g.add_argument("--port", type=_int_at_least(1), default=8000)
    g.add_argument("--endpoint", type=_endpoint, default=None,
                   help="chat (/v1/chat/completions) or completions (/v1/completions, the prompt as plain text); "
                        "vLLM's path spelling is accepted [default: completions, chat with --backend openai-chat]")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="recorded in the result as vLLM's `backend`; openai-chat selects the chat endpoint "
                        "[default: openai, or openai-chat for --endpoint chat]")
    g.add_argument("--model", default=None, help="model name to send [default: the first of GET /v1/models]")
    g.add_argument("--tokenizer", default=None, help="recorded as tokenizer_id only: prompts need no tokenizer here")
    g.add_argument("--api-key", default=None, help="bearer token [default: $OPENAI_API_KEY if set]")
    g.add_argument("--header", nargs="*", default=None, metavar="KEY=VALUE", help="extra HTTP headers")
    g.add_argument("--timeout", type=_positive_float, default=600.0, help="read timeout per request, seconds")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random", help="what the requests are [default: random]")
    g.add_argument("--num-prompts", type=_int_at_least(1), default=100,
                   help="requests (sessions: turns in all) [default: 100]")
    g.add_argument("--random-input-len", type=_int_at_least(1), default=1024,
                   help="random: prompt tokens; sessions: first message tokens [default: 1024]")
    g.add_argument("--random-output-len", type=_int_at_least(1), default=128,
                   help="random, prefix, sessions: tokens asked for [default: 128]")
    g.add_argument("--random-range-ratio", type=_ratio, default=0.0,
                   help="random: lengths uniform in [L(1-r), L(1+r)] [default: 0]")
    g.add_argument("--sharegpt-input-len", type=_int_at_least(1), default=256,
                   help="sharegpt-like: median user message tokens [default: 256]")
    g.add_argument("--sharegpt-output-len", type=_int_at_least(1), default=None,
                   help="sharegpt-like: fixed output tokens [default: drawn per request, median 128]")
    g.add_argument("--prefix-len", type=_int_at_least(1), default=1000, help="prefix: shared prefix tokens [default: 1000]")
    g.add_argument("--prefix-question-len", type=_int_at_least(1), default=30,
                   help="prefix: distinct question tokens after it [default: 30]")
    g.add_argument("--prefix-num-prefixes", type=_int_at_least(1), default=1,
                   help="prefix: distinct prefixes, cycled over the requests [default: 1]")
    g.add_argument("--session-turns", type=_int_at_least(1), default=4, help="sessions: turns per conversation [default: 4]")
    g.add_argument("--session-turn-len", type=_int_at_least(1), default=40,
                   help="sessions: follow-up message tokens [default: 40]")
    g.add_argument("--seed", type=int, default=0, help="prompts and arrival times [default: 0]")

    g = p.add_argument_group("load and sampling")
    g.add_argument("--request-rate", type=_positive_float, default=float("inf"),
                   help="arrivals per second (sessions: conversation starts); inf sends all at once [default: inf]")
    g.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of the gaps between arrivals: 1 is Poisson, lower is burstier [default: 1]")
    g.add_argument("--max-concurrency", type=_int_at_least(1), default=None,
                   help="requests (sessions: conversations) in flight at most [default: no limit]")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos so each output has exactly the asked length (always on for random, as vLLM)")
    g.add_argument("--disable-ignore-eos", action="store_true", help="never send ignore_eos, not even for random")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent [default: 0, greedy]")
    g.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help="fields merged into every request body")
    g.add_argument("--num-warmups", type=_int_at_least(0), default=0, help="unmeasured requests first [default: 0]")

    g = p.add_argument_group("results")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help=f"comma-separated, of {','.join(PERCENTILE_METRICS)} [default: ttft,tpot,itl,e2el]")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99 [default: 99]")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    g.add_argument("--save-result", action="store_true", help="write the result JSON (vLLM's keys)")
    g.add_argument("--save-detailed", action="store_true",
                   help="with the per-request lists (input_lens, output_lens, ttfts, itls, generated_texts, errors)")
    g.add_argument("--result-dir", default=None, help="folder of the result file [default: .]")
    g.add_argument("--result-filename", default=None,
                   help="file name [default: vLLM's {label}-{rate}qps[-concurrency{C}]-{model}-{date}.json]")
    g.add_argument("--label", default=None, help="name of this run (in the file name and the result)")
    g.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="extra keys stored in the result")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="write TTFT and ITL distributions (needs matplotlib)")


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """What argparse cannot check field by field; each error names its flag."""
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in metrics if m not in PERCENTILE_METRICS]
    if bad or not metrics:
        parser.error(f"argument --percentile-metrics: unknown metric(s) {', '.join(bad) or '(none given)'}; "
                     f"choose from {', '.join(PERCENTILE_METRICS)}")
    args.percentile_metrics_list = metrics
    try:
        pcts = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    except ValueError:
        pcts = []
    if not pcts or not all(0 < q <= 100 for q in pcts):
        parser.error(f"argument --metric-percentiles: expected numbers in (0, 100], got {args.metric_percentiles!r}")
    args.metric_percentiles_list = pcts
    for flag, items in (("--header", args.header), ("--metadata", args.metadata)):
        if items and any("=" not in it for it in items):
            parser.error(f"argument {flag}: expected KEY=VALUE, got {[it for it in items if '=' not in it][0]!r}")
    if args.ignore_eos and args.disable_ignore_eos:
        parser.error("argument --disable-ignore-eos: not allowed with --ignore-eos")
    if args.plot is not None:
        from chatserve.bench.plot import check_available

        problem = check_available()
        if problem:
            parser.error(f"argument --plot: {problem}")
    if args.endpoint is None:
        args.endpoint = "chat" if args.backend == "openai-chat" else "completions"
    if args.backend is None:
        args.backend = "chatserve-sessions" if args.dataset_name == "sessions" else \
            ("openai-chat" if args.endpoint == "chat" else "openai")


def _kv(items: list[str] | None) -> dict[str, str]:
    return dict(tuple(s.strip() for s in it.split("=", 1)) for it in items or [])  # type: ignore[misc]


class _Bench:
    def __init__(self, args: argparse.Namespace, client: httpx.AsyncClient, root: str, model: str) -> None:
        self.args = args
        self.client = client
        self.root = root
        self.model = model
        self.ignore_eos = not args.disable_ignore_eos and (args.ignore_eos or args.dataset_name == "random")

    def body(self, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": self.args.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.args.extra_body or {})
        return body

    async def one(self, s: SampleRequest, max_tokens: int | None = None, session_id: str | None = None) -> RequestOutput:
        n = s.expected_output_len if max_tokens is None else max_tokens
        if session_id is not None:
            body = {k: v for k, v in self.body(n).items() if k != "model"}
            body["content"] = s.messages[-1]["content"]
            return await stream_request(self.client, f"{self.root}/v1/sessions/{session_id}/messages", body,
                                        headers={"X-Session-Id": session_id}, prompt_len=s.prompt_len)
        body = self.body(n)
        if self.args.endpoint == "chat":
            body["messages"] = s.chat_messages()
        else:
            body["prompt"] = s.prompt
        return await stream_request(self.client, self.root + ENDPOINTS[self.args.endpoint], body, prompt_len=s.prompt_len)

    async def new_session(self) -> str:
        try:
            r = await self.client.post(f"{self.root}/v1/sessions", json={}, timeout=30)
        except httpx.HTTPError as exc:
            raise BenchError(f"--dataset-name sessions: POST {self.root}/v1/sessions failed ({exc})") from None
        if r.status_code not in (200, 201):
            raise BenchError(f"--dataset-name sessions needs chatserve's session API, and POST {self.root}/v1/sessions "
                             f"answered HTTP {r.status_code}; against other servers use --dataset-name sharegpt-like")
        return str(r.json()["id"])

    async def probe(self) -> None:
        """One short request first, as vLLM's initial test run: a wrong URL, model or endpoint fails here,
        clearly. Not a dataset request: it would put that prompt in the prefix cache before the run."""
        s = SampleRequest([{"role": "user", "content": "Benchmark probe: say hello."}], 8, 2)
        session_id = await self.new_session() if self.args.dataset_name == "sessions" else None
        try:
            first = await self.one(s, 2, session_id)
        finally:
            if session_id is not None:
                await self.end_session(session_id)
        if not first.success:
            raise BenchError(f"the first test request failed: {first.error}")

    async def end_session(self, session_id: str) -> None:
        try:
            await self.client.delete(f"{self.root}/v1/sessions/{session_id}", timeout=10)
        except httpx.HTTPError:
            pass

    async def unit(self, unit: list[SampleRequest], outputs: dict[int, RequestOutput], index: dict[int, int],
                   progress: Progress) -> None:
        session_id = await self.new_session() if self.args.dataset_name == "sessions" else None
        try:
            for k, s in enumerate(unit):
                out = await self.one(s, session_id=session_id)
                outputs[index[id(s)]] = out
                progress.update(out.success)
                if not out.success and session_id is not None:
                    for rest in unit[k + 1:]:  # the conversation cannot go on consistently
                        outputs[index[id(rest)]] = RequestOutput(error="skipped: an earlier turn failed",
                                                                 prompt_len=rest.prompt_len)
                        progress.update(False)
                    break
        finally:
            if session_id is not None:
                await self.end_session(session_id)


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    root = api_root(args.base_url or f"http://{args.host}:{args.port}")
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **_kv(args.header)}
    pool = (args.max_concurrency or args.num_prompts) + 8
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0), limits=limits, headers=headers) as client:
        model = args.model or await first_model(client, root)
        if not model:
            raise BenchError(f"no model: GET {root}/v1/models listed none (is the server up?); pass --model")
        bench = _Bench(args, client, root, model)
        samples = get_samples(args)
        units = conversations(samples)
        index = {id(s): i for i, s in enumerate(samples)}
        await bench.probe()
        for k in range(args.num_warmups):
            await bench.one(samples[k % len(samples)])
        print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness}"
              f"{' (Poisson process)' if args.burstiness == 1.0 else ''}\nMaximum request concurrency: "
              f"{args.max_concurrency}", flush=True)
        outputs: dict[int, RequestOutput] = {}
        progress = Progress(len(samples), disable=args.disable_tqdm)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed)

        async def guarded(unit: list[SampleRequest]) -> None:
            if sem is None:
                await bench.unit(unit, outputs, index, progress)
            else:
                async with sem:
                    await bench.unit(unit, outputs, index, progress)

        t0 = time.perf_counter()
        tasks = []
        for k, unit in enumerate(units):
            if k and math.isfinite(args.request_rate):
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(rng.gammavariate(args.burstiness, theta))
            tasks.append(asyncio.create_task(guarded(unit)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        progress.close()
    ordered = [outputs[i] for i in range(len(samples))]
    result: dict[str, Any] = {
        "date": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        # chatserve's own keys (vLLM has none of these names)
        "dataset_name": args.dataset_name,
        "endpoint_type": "sessions" if args.dataset_name == "sessions" else ENDPOINTS[args.endpoint],
        "base_url": root,
        "ignore_eos": bench.ignore_eos,
        "seed": args.seed,
        **_kv(args.metadata),
    }
    result.update(compute_metrics(ordered, duration, t0, args.percentile_metrics_list, args.metric_percentiles_list))
    return result


def main(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(run_benchmark(args))
    except BenchError as exc:
        print(f"chatserve bench serve: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(result, args.percentile_metrics_list, args.metric_percentiles_list))
    if args.save_result or args.result_filename:
        name = args.result_filename or result_filename(args.label, args.backend, args.request_rate, args.max_concurrency,
                                                       result["model_id"], result["date"])
        path = save_result(result, os.path.join(args.result_dir, name) if args.result_dir else name, args.save_detailed)
        print(f"Saved result to {path}")
    if args.plot:
        from chatserve.bench.plot import write_plot

        write_plot(args.plot, [result], [args.label or f"{args.dataset_name} @ {result['base_url']}"])
        print(f"Saved plot to {args.plot}")
    errors = sorted({e for e in result["errors"] if e})
    if errors:
        print("errors (first distinct ones):\n  " + "\n  ".join(errors[:5]), file=sys.stderr)
    return 0 if result["failed"] == 0 else 1
