"""Two replicas behind the real vLLM router (`vllm-router`), sharing the real Redis, on loopback.

What scale-out must keep: a session's later turns land where its KV blocks are (under
`sticky_least_loaded` keyed on X-Session-Id, and under the default `cache_aware` with no header
at all, which places requests by the token ids our /v1/chat/completions/render returns, and under
`kv_aware`, which places them by the KV blocks each replica's event stream says it holds), a
cancel sent through the router stops the right request whichever replica it reaches, and a
replica killed mid-run loses no finished turn while every session continues on the other one.

Which replica served a response is read from its X-Chatserve-Instance header. Replicas run one
torch thread each (this machine has two cores) and replies are a few tokens: the mechanism is
under test, not speed (benchmarks/serving/bench_serving.py measures that).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

import chatserve.cluster
from chatserve.cluster import (
    Cluster,
    ClusterSpec,
    Process,
    consecutive_free_ports,
    replica_command,
    router_command,
    run_cluster,
)
from tests.helpers import prefork
from tests.helpers.net import HTTP, free_port, wait_until
from tests.helpers.paths import REPO_ROOT
from tests.helpers.streams import stream_in_thread

# In the default suite: the whole module takes ~40 s on a quiet 2-core box since model loads read the
# cached GGUF metadata (it took minutes before); the timeout covers a busy one.
pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(shutil.which("vllm-router") is None and not REPO_ROOT.joinpath(
                  ".venv/bin/vllm-router").exists(), reason="vllm-router is not installed (dev extras)")]

REDIS_DB = 12  # this module's own database on the shared Redis
REDIS_URL = f"redis://127.0.0.1:6379/{REDIS_DB}"
BLOCK = 16
WORDS = ("river", "lantern", "copper", "meadow", "signal", "harbor", "thistle", "granite", "orbit", "velvet",
         "cinder", "willow", "pixel", "saffron", "quartz", "ember", "falcon", "glacier", "juniper", "marble")


def system_prompt(i: int, n_words: int = 250) -> str:
    """A distinct ~300-token system prompt per i (no two share more than the opening words)."""
    words = [WORDS[(i * 7 + k * (i + 3)) % len(WORDS)] for k in range(n_words)]
    return f"You are assistant {i}. Remember these words in order: " + " ".join(words) + "."


def instance(resp: httpx.Response) -> str:
    return resp.headers["x-chatserve-instance"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    redis.Redis.from_url(REDIS_URL).flushdb()
    ports = consecutive_free_ports(6)  # one pick: replicas on the first 2, their KV event sockets on the next 4
    spec = ClusterSpec(
        replicas=2, router_port=free_port(), first_replica_port=ports, policy="sticky_least_loaded",
        redis_url=REDIS_URL, threads_per_replica=1, log_dir=tmp_path_factory.mktemp("cluster-logs"),
        kv_events=True, kv_events_first_port=ports + 2,  # for the kv_aware router
        allowed_origins=("https://app.example",),
        serve_args=("--max-model-len", "2048", "--log-level", "warning", "--session-turn-lock-ttl-s", "4",
                    "--shutdown-grace-s", "2"),
        env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chatserve.cluster, "subprocess", _ReplicasForked())
        with run_cluster(spec) as running:
            yield running
    redis.Redis.from_url(REDIS_URL).flushdb()


class _ReplicasForked:
    """`chatserve.cluster`'s `subprocess` in this module: a replica (`python -m chatserve serve ...`)
    starts as a fork of the worker's warm fork server (tests/helpers/prefork.py: its imports paid
    once, not per replica); the router, Redis and anything else as `subprocess.Popen` would."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(args, stdout=None, stderr=None, env=None, **kw):  # noqa: N802 - subprocess's name
        args = list(args)
        if args[:3] == [sys.executable, "-m", "chatserve"] and getattr(stdout, "name", None) and not kw:
            return prefork.start(args[1:], env=env if env is not None else os.environ, cwd=os.getcwd(),
                                 stdout=Path(stdout.name))
        return subprocess.Popen(args, stdout=stdout, stderr=stderr, env=env, **kw)


def _turn(client: httpx.Client, sid: str, text: str, header: bool) -> httpx.Response:
    headers = {"X-Session-Id": sid} if header else {}
    resp = client.post(f"/v1/sessions/{sid}/messages", headers=headers,
                       json={"content": text, "max_tokens": 4, "temperature": 0, "stream": False})
    assert resp.status_code == 200, resp.text
    return resp


def test_sticky_sessions_keep_their_replica_and_their_cache(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.spec.router_url, timeout=120) as client:
        sids = []
        for i in range(4):
            created = client.post("/v1/sessions", json={"system_prompt": system_prompt(i)})
            assert created.status_code == 201, created.text
            sids.append(created.json()["id"])
        served: dict[str, list[str]] = {sid: [] for sid in sids}
        cached: dict[str, list[tuple[int, int]]] = {sid: [] for sid in sids}
        history = dict.fromkeys(sids, 0)
        for turn in range(3):  # interleaved: every session's turn k before any turn k+1
            for sid in sids:
                resp = _turn(client, sid, f"Turn {turn}: which word came third?", header=True)
                assert resp.headers["x-session-id"] == sid
                usage = resp.json()["usage"]
                served[sid].append(instance(resp))
                cached[sid].append((usage["prompt_tokens_details"]["cached_tokens"], history[sid]))
                history[sid] = usage["prompt_tokens"] + usage["completion_tokens"]
    for sid in sids:
        assert len(set(served[sid])) == 1, f"session {sid} moved between replicas: {served[sid]}"
        for got, hist in cached[sid][1:]:
            assert got >= hist - BLOCK, f"session {sid}: {got} cached of a {hist}-token history"
    assert len({s[0] for s in served.values()}) == 2, f"all sessions on one replica: {served}"


def _message_events(client: httpx.Client, messages: list[dict], sid: str) -> tuple[list[tuple[str, dict]], str]:
    """A streamed /v1/messages call through the router: its (event, data) frames, and the replica that served it."""
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0, "stream": True,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328; cch=" + sid[-5:] + ";"},
                       {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": messages}
    headers = {"anthropic-version": "2023-06-01", "X-Session-Id": sid}
    frames: list[tuple[str, dict]] = []
    with client.stream("POST", "/v1/messages?beta=true", json=body, headers=headers) as resp:
        assert resp.status_code == 200, resp.read()
        event = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                assert event is not None, f"a data line without its event line: {line!r}"
                frames.append((event, json.loads(line[len("data: "):])))
                event = None
        return frames, instance(resp)


def test_messages_stream_through_the_router_and_an_agent_stays_on_its_prefix(cluster: Cluster) -> None:
    """Anthropic's /v1/messages through the unmodified router (it forwards routes it does not know),
    streamed with Anthropic's framing; an agent that sends `X-Session-Id` (Claude Code does with
    ANTHROPIC_CUSTOM_HEADERS, docs/anthropic.md) keeps its replica, so its next turn is a cache hit."""
    with httpx.Client(base_url=cluster.spec.router_url, timeout=120) as client:
        agents = {f"agent-{i}-{os.getpid()}": [{"role": "user", "content": system_prompt(20 + i)}] for i in range(4)}
        served: dict[str, list[str]] = {sid: [] for sid in agents}
        prev: dict[str, int] = {}  # each agent's last prompt length
        for turn in range(2):
            for sid, messages in agents.items():
                frames, where = _message_events(client, messages, sid)
                served[sid].append(where)
                kinds = [e for e, _ in frames if e != "ping"]
                assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
                usage = frames[0][1]["message"]["usage"]
                prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
                if turn == 1:  # the first turn's whole prompt, less a partial block, came from the cache
                    assert usage["cache_read_input_tokens"] >= prev[sid] - BLOCK, (sid, usage, prev[sid])
                prev[sid] = prompt
                text = "".join(d["delta"].get("text", "") for e, d in frames if e == "content_block_delta")
                messages += [{"role": "assistant", "content": text or "ok"}, {"role": "user", "content": "And then?"}]
    for sid, where in served.items():
        assert len(set(where)) == 1, f"agent {sid} moved between replicas: {where}"
    assert len({w[0] for w in served.values()}) == 2, f"all agents on one replica: {served}"


def test_cache_aware_places_stateless_chats_by_their_tokens_without_any_header(cluster: Cluster) -> None:
    router = _start_router(cluster, "cache_aware")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{router.port}", timeout=120) as client:
            convs = [[{"role": "system", "content": system_prompt(10 + i)}] for i in range(4)]
            served: list[list[str]] = [[] for _ in convs]
            prev_prompt = [0] * len(convs)
            for turn in range(3):
                for i, messages in enumerate(convs):
                    messages.append({"role": "user", "content": f"Turn {turn}: which word came first?"})
                    resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4,
                                                                     "temperature": 0})
                    assert resp.status_code == 200, resp.text
                    usage = resp.json()["usage"]
                    served[i].append(instance(resp))
                    if turn > 0:  # the re-rendered history: at least the last prompt, less a partial block
                        cached = usage["prompt_tokens_details"]["cached_tokens"]
                        assert cached >= prev_prompt[i] - BLOCK, (i, turn, cached, prev_prompt[i])
                    prev_prompt[i] = usage["prompt_tokens"]
                    messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
        for i, where in enumerate(served):
            assert len(set(where)) == 1, f"conversation {i} moved between replicas: {where}"
    finally:
        router.stop()


def test_kv_aware_follows_the_replicas_kv_events_to_history_it_never_routed(cluster: Cluster) -> None:
    """kv_aware scores each replica by the blocks its KV event stream (BlockStored / BlockRemoved
    over ZMQ) says it holds, matched against the prompt's tokens. Each conversation's first turn
    goes straight to a replica, past the router (conversation i to replica i % 2), so only the
    events can tell the router where its history is; later turns, with no header, must go there."""
    router = _start_router(cluster, "kv_aware", "--log-level", "debug")  # debug: its routing decisions
    urls = cluster.spec.replica_urls()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{router.port}", timeout=120) as client:
            convs = [[{"role": "system", "content": system_prompt(30 + i)}] for i in range(4)]
            served: list[list[str]] = [[] for _ in convs]
            prev_prompt = [0] * len(convs)
            for turn in range(3):
                for i, messages in enumerate(convs):
                    messages.append({"role": "user", "content": f"Turn {turn}: which word came last?"})
                    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
                    if turn == 0:
                        resp = HTTP.post(f"{urls[i % 2]}/v1/chat/completions", json=body, timeout=120)
                    else:
                        resp = client.post("/v1/chat/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    usage = resp.json()["usage"]
                    served[i].append(instance(resp))
                    if turn > 0:
                        cached = usage["prompt_tokens_details"]["cached_tokens"]
                        assert cached >= prev_prompt[i] - BLOCK, (i, turn, cached, prev_prompt[i])
                    prev_prompt[i] = usage["prompt_tokens"]
                    messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
        for i, where in enumerate(served):
            assert where == [urls[i % 2].removeprefix("http://")] * 3, f"conversation {i}: {where}"
        # The router's own account: each routed turn was placed on credit for the prefix the events
        # say is cached there (its debug log; colour codes stripped).
        log = re.sub(r"\x1b\[[0-9;]*m", "", router.process.log())
        credited = [int(n) for n in re.findall(r"KV prefix decision .*?credited_prefix_tokens=(\d+)", log)]
        assert len(credited) == 8 and min(credited) >= 220, (credited, log[-3000:])  # histories of 287-337+ tokens
    finally:
        router.stop()


def test_a_cancel_through_the_router_stops_the_right_request(cluster: Cluster) -> None:
    """Under cache_aware nothing ties the cancel to the owner: the replica it reaches asks the
    other over Redis. Also cancelled at the replica that does NOT hold it, to prove that path."""
    router = _start_router(cluster, "cache_aware")
    try:
        base = f"http://127.0.0.1:{router.port}"
        urls = cluster.spec.replica_urls()
        for target in ("router", "peer"):
            rid = f"cancel-me-{target}-{time.monotonic_ns()}"
            stream = stream_in_thread(base, "/v1/chat/completions",
                                      {"messages": [{"role": "user", "content": "Tell a long story."}],
                                       "max_tokens": 1500, "ignore_eos": True, "stream": True},
                                      headers={"X-Request-Id": rid})
            wait_until(lambda s=stream: s.data, 120, "the stream to start")
            owner = "http://" + stream.headers["x-chatserve-instance"]
            assert owner in urls
            url = base if target == "router" else next(u for u in urls if u != owner)
            resp = HTTP.post(f"{url}/v1/requests/{rid}/cancel", timeout=30)
            assert resp.status_code == 200, resp.text
            assert resp.json()["id"] == rid and resp.json()["status"] == "aborted"
            stream.join(60)
            assert stream.finish_reasons == ["abort"], stream
    finally:
        router.stop()


def test_pages_through_the_router_keep_working_and_foreign_ones_are_refused(cluster: Cluster) -> None:
    """The router forwards Origin but rewrites Host: each replica allows the router's origin and
    --allowed-origins (which also get the router's CORS headers); any other origin is a 403."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with httpx.Client(base_url=cluster.spec.router_url, timeout=120) as client:
        for origin in cluster.spec.router_origins():  # the web page served through the router
            resp = client.post("/v1/chat/completions", json=body, headers={"Origin": origin})
            assert resp.status_code == 200, (origin, resp.text)
        resp = client.post("/v1/chat/completions", json=body, headers={"Origin": "https://app.example"})
        assert resp.status_code == 200, resp.text
        assert resp.headers["access-control-allow-origin"] == "https://app.example"
        resp = client.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert resp.headers["access-control-allow-origin"] == "https://app.example"
        # (vllm-router itself answers a text/plain body 415; a JSON one reaches the replica, which refuses it)
        resp = client.post("/v1/chat/completions", json=body, headers={"Origin": "https://evil.example"})
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "origin_not_allowed", resp.text
        assert "access-control-allow-origin" not in resp.headers


def test_cluster_origins_reach_the_replicas_and_the_router() -> None:
    spec = ClusterSpec(router_port=9000, first_replica_port=9001, allowed_origins=("https://a.example",))
    replica = replica_command(spec, 0)
    at = replica.index("--allowed-origins")
    assert replica[at + 1:at + 5] == ["http://127.0.0.1:9000", "http://localhost:9000", "http://[::1]:9000",
                                      "https://a.example"]
    assert replica[at + 5].startswith("--")
    router = router_command(ClusterSpec(allowed_origins=("https://a.example",), policy="round_robin"), 1)
    assert router[router.index("--cors-allowed-origins") + 1] == "https://a.example"
    assert "--cors-allowed-origins" not in router_command(ClusterSpec(policy="round_robin"), 1)
    with pytest.raises(RuntimeError, match="--allowed-origins"):
        replica_command(ClusterSpec(serve_args=("--allowed-origins", "https://b.example")), 0)


def test_a_killed_replica_loses_no_finished_turn_and_sessions_continue(cluster: Cluster) -> None:
    """Runs last: it kills replica 0. The turn it was running is stored not at all (SIGKILL: no
    half turn), its lock expires (4 s here), and the session's next turn runs on replica 1."""
    with httpx.Client(base_url=cluster.spec.router_url, timeout=120) as client:
        sids = [client.post("/v1/sessions", json={"system_prompt": system_prompt(20 + i)}).json()["id"]
                for i in range(4)]
        where = {sid: instance(_turn(client, sid, "First turn.", header=True)) for sid in sids}
        victim_url = cluster.spec.replica_urls()[0]
        victim_name = victim_url.removeprefix("http://")
        doomed = next((sid for sid in sids if where[sid] == victim_name), None)
        assert doomed is not None, f"no session on replica 0: {where}"
        running = stream_in_thread(cluster.spec.router_url, f"/v1/sessions/{doomed}/messages",
                                   {"content": "Now a very long answer.", "max_tokens": 1000, "ignore_eos": True,
                                    "stream": True}, headers={"X-Session-Id": doomed})
        wait_until(lambda: running.data or running.status not in (None, 200), 120, "the doomed turn to stream")
        assert running.status == 200, (running.status, running.body)
        cluster.kill("replica-0")
        cluster.replica(0).proc.wait(30)
        running.join(60)
        for sid in sids:  # every session continues (the doomed one once its lock expires)
            deadline = time.monotonic() + 60
            while True:
                resp = client.post(f"/v1/sessions/{sid}/messages", headers={"X-Session-Id": sid},
                                   json={"content": "Still there?", "max_tokens": 4, "temperature": 0, "stream": False})
                if resp.status_code == 200 or time.monotonic() > deadline:
                    break
                assert resp.status_code in (409, 502, 503), resp.text  # busy (dead turn's lock) or routing away
                time.sleep(0.5)
            assert resp.status_code == 200, resp.text
            assert instance(resp) != victim_name
        for sid in sids:
            got = client.get(f"/v1/sessions/{sid}").json()
            roles = [m["role"] for m in got["messages"]]
            assert roles == ["user", "assistant", "user", "assistant"], (sid, roles)  # no half turn, none lost
            assert all(m["content"] for m in got["messages"] if m["role"] == "assistant")


# ---- helpers ----------------------------------------------------------------------------------------
class _Router:
    def __init__(self, process: Process, port: int) -> None:
        self.process, self.port = process, port

    def stop(self) -> None:
        if self.process.proc.poll() is None:
            self.process.proc.send_signal(signal.SIGTERM)
            try:
                self.process.proc.wait(20)
            except Exception:  # noqa: BLE001
                self.process.proc.kill()


def _start_router(cluster: Cluster, policy: str, *router_args: str) -> _Router:
    """A second router over the same replicas, with another policy (the replicas keep their caches)."""
    import subprocess

    port = free_port()
    spec = ClusterSpec(**{**cluster.spec.__dict__, "router_port": port, "policy": policy,
                          "router_args": (*cluster.spec.router_args, *router_args)})
    log = (cluster.spec.log_dir or Path("/tmp")) / f"router-{policy}-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(router_command(spec, free_port()), stdout=out, stderr=subprocess.STDOUT)
    router = _Router(Process(f"router-{policy}", proc, log), port)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, router.process.log()[-3000:]
        try:
            if HTTP.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, router.process.log()[-3000:]
        time.sleep(0.25)
