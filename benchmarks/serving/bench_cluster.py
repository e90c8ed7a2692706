"""Multi-turn sessions through vLLM's router over 2 chatserve replicas, vs 1 replica alone.

Starts Redis (if needed), 2 replicas with --threads-per-replica torch threads each and one
`vllm-router` per policy, then runs `benchmarks/serving/bench_serving.py --workload multi-turn` against each:
16 conversations of --turns turns at concurrency 8, stateless (the whole history every turn) or
through the session API (X-Session-Id on every turn). Reports the prompt-token cache hit rate and
TTFT p50/p90 per configuration, in one run, so the ratios are comparable:

- 1 replica alone (the baseline: everything hits, but one replica does all the work);
- 2 replicas, `cache_aware` (stateless; the router places by our /v1/chat/completions/render ids);
- 2 replicas, `kv_aware` (stateless; the router places by the replicas' KV cache events);
- 2 replicas, `sticky_least_loaded` (session API; affinity by X-Session-Id);
- 2 replicas, `round_robin` (stateless and sessions: what affinity buys).

    .venv/bin/python benchmarks/serving/bench_cluster.py --threads-per-replica 1 --json /tmp/cluster.json
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from chatserve.cluster import ClusterSpec, consecutive_free_ports, free_port, router_command, run_cluster  # noqa: E402


def start_router(spec: ClusterSpec, policy: str, workers: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    rspec = ClusterSpec(**{**spec.__dict__, "router_port": port, "policy": policy})
    cmd = router_command(rspec, free_port())
    i = cmd.index("--worker-urls")
    cmd = cmd[: i + 1] + workers + cmd[i + 1 + spec.replicas:]
    out = open(log, "wb")  # noqa: SIM115 - the router's log lives as long as it does
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"router ({policy}) did not come up: {log.read_text()[-2000:]}")


def run_bench(url: str, label: str, sessions: bool, args: argparse.Namespace, seed: int, out: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "bench_serving.py"), "--base-url", url, "--workload", "multi-turn",
           "--num-requests", str(16 * args.turns), "--concurrency", "8", "--turns", str(args.turns),
           "--first-turn-tokens", str(args.first_turn_tokens), "--turn-tokens", "40",
           "--max-tokens", str(args.max_tokens), "--seed", str(seed), "--label", label, "--json", str(out),
           "--no-progress", "--warmup", "1"]
    if sessions:
        cmd.append("--sessions")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads-per-replica", type=int, default=1)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--first-turn-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--serve-args", default="--max-model-len 4096", help="flags for every replica")
    ap.add_argument("--router-args", default="", help="extra flags for every router, e.g. '--log-level debug'")
    ap.add_argument("--only", default=None,
                    help="comma-separated: run only the configurations whose label contains one of these")
    args = ap.parse_args()

    logs = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    ports = consecutive_free_ports(6)  # one pick: replicas on the first 2, their KV event sockets on the next 4
    spec = ClusterSpec(replicas=2, router_port=free_port(), first_replica_port=ports,
                       policy="sticky_least_loaded", redis_url=args.redis_url,
                       threads_per_replica=args.threads_per_replica, log_dir=logs,
                       kv_events=True, kv_events_first_port=ports + 2,  # for kv_aware
                       router_args=tuple(args.router_args.split()),
                       serve_args=tuple(args.serve_args.split()) + ("--log-level", "warning"),
                       env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    rows = []
    with run_cluster(spec) as cluster:
        urls = spec.replica_urls()
        configs = [
            ("1 replica, stateless", "round_robin", [urls[0]], False),
            ("1 replica, sessions", "round_robin", [urls[0]], True),
            ("2 replicas, cache_aware, stateless", "cache_aware", urls, False),
            ("2 replicas, sticky_least_loaded, sessions", "sticky_least_loaded", urls, True),
            ("2 replicas, round_robin, stateless", "round_robin", urls, False),
            ("2 replicas, round_robin, sessions", "round_robin", urls, True),
            ("2 replicas, kv_aware, stateless", "kv_aware", urls, False),  # last: the earlier seeds stay
        ]
        for n, (label, policy, workers, sessions) in enumerate(configs):
            if args.only and not any(part in label for part in args.only.split(",")):
                continue
            proc, url = start_router(spec, policy, workers, logs / f"router-{n}.log")
            try:
                result = run_bench(url, label, sessions, args, seed=1000 + n, out=logs / f"bench-{n}.json")
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)
            s = result
            ttft = s.get("ttft_ms") or {}
            row = {"config": label, "cached_token_ratio": s.get("cached_token_ratio"),
                   "ttft_ms_p50": ttft.get("p50"), "ttft_ms_p90": ttft.get("p90"),
                   "output_tok_s": s.get("output_tokens_per_s"), "completed": s.get("num_completed"),
                   "errors": s.get("num_errors")}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del cluster
    print("\n| configuration | cached prompt tokens | TTFT p50 (ms) | TTFT p90 (ms) | output tok/s | completed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['cached_token_ratio']} | {r['ttft_ms_p50']} | {r['ttft_ms_p90']} | "
              f"{r['output_tok_s']} | {r['completed']} |")
    if args.json:
        args.json.write_text(json.dumps({"threads_per_replica": args.threads_per_replica, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
