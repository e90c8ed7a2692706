"""deploy/grafana/chatserve-dashboard.json queries only metrics a real server exports: every `expr`'s
metric names are looked up in a live server's /metrics (with speculative decoding on, so its
counters exist), so renaming a metric in chatserve/server/metrics.py breaks this test instead of
leaving an empty panel."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.helpers.net import HTTP
from tests.helpers.server import ROOT, ServerProcess, start_server

DASHBOARD = ROOT / "deploy" / "grafana" / "chatserve-dashboard.json"
_METRIC = re.compile(r"\b(chatserve:[A-Za-z0-9_:]+)")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s")


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out += _panels(p.get("panels") or [])  # panels inside a collapsed row
    return out


def dashboard_exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query target."""
    return [(p.get("title", "?"), t["expr"]) for p in _panels(dash["panels"]) for t in p.get("targets") or [] if "expr" in t]


def metric_names(expr: str) -> set[str]:
    """The chatserve metric names a PromQL expression reads (label names and functions are not ones)."""
    return set(_METRIC.findall(expr))


def exported_names(text: str) -> set[str]:
    """Every series name a /metrics page can be queried by: each sample's name, each `# TYPE` name
    (a labelled counter with no child yet has no sample), and a histogram's _bucket/_sum/_count."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            if kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            if m:
                names.add(m.group(1))
    return names


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    srv = start_server("--max-model-len", "512", "--num-threads", "1",
                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    yield srv
    srv.stop()


def test_dashboard_is_importable_json_with_a_datasource_input() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and dash["panels"]
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert "model_name" in variables
    ids = [p["id"] for p in _panels(dash["panels"])]
    assert len(ids) == len(set(ids))
    for title, expr in dashboard_exprs(dash):
        assert metric_names(expr), f"{title}: {expr} reads no chatserve metric"
        assert expr.count("(") == expr.count(")"), f"{title}: unbalanced parentheses in {expr}"
        assert 'model_name="$model_name"' in expr, f"{title}: {expr} ignores the model variable"
        for name in metric_names(expr):
            if "histogram_quantile" in expr and name.endswith("_bucket"):
                continue
            assert not (name.endswith("_bucket") and "histogram_quantile" not in expr), f"{title}: raw buckets"


def test_every_metric_the_dashboard_queries_is_exported(server: ServerProcess) -> None:
    # One request first: every family is exported from the start, but a request proves the labels hold too.
    r = HTTP.post(f"{server.url}/v1/completions", json={"prompt": "one two three one two three one two", "max_tokens": 4},
                   timeout=120)
    assert r.status_code == 200, r.text
    text = HTTP.get(f"{server.url}/metrics", timeout=10).text
    exported = exported_names(text)
    dash = json.loads(DASHBOARD.read_text())
    queried = {name: title for title, expr in dashboard_exprs(dash) for name in metric_names(expr)}
    missing = {name: title for name, title in queried.items() if name not in exported}
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
    # What the dashboard must chart (the list): a family dropped from it fails here.
    for family in ("request_success_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "generation_tokens_total", "prompt_tokens_total",
                   "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total",
                   "prefix_cache_queries_total", "spec_decode_num_accepted_tokens_total", "request_aborts_total"):
        assert f"chatserve:{family}" in queried, f"no panel charts chatserve:{family}"
    # And the check itself can fail: a renamed metric is not among the exported names.
    assert "chatserve:time_to_first_token_secs_bucket" not in exported
    assert "chatserve:time_to_first_token_seconds_bucket" in exported
