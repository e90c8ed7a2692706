"""The deployment examples cannot run here (no container runtime), so what can be checked is: they
parse, every chatserve command in them is one our CLI accepts, and every replica shares one Redis
and answers readiness on /health."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from chatserve.cli import parse_args
from tests.helpers.paths import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"


def _commands(doc: Any) -> list[list[str]]:
    """Every command/args list in a compose or Kubernetes document."""
    found: list[list[str]] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("command", "args") and isinstance(value, list) and all(isinstance(v, str) for v in value):
                found.append(value)
            else:
                found += _commands(value)
    elif isinstance(doc, list):
        for item in doc:
            found += _commands(item)
    return found


def _docs() -> list[Any]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def test_every_chatserve_command_parses_and_shares_redis() -> None:
    serves = [c for c in _commands(_docs()) if c[:2] == ["chatserve", "serve"]]
    assert len(serves) >= 3  # two compose replicas and the Kubernetes one
    for cmd in serves:
        args = parse_args(cmd[1:], environ={})
        assert args.redis_url and args.redis_url.startswith("redis://"), cmd
        assert args.drain_notice_s > 0 and args.host == "0.0.0.0", cmd


def test_routers_check_health_and_replicas_have_readiness() -> None:
    routers = [c for c in _commands(_docs()) if c and c[0] == "vllm-router"]
    assert len(routers) == 2
    for cmd in routers:
        assert cmd[cmd.index("--health-check-endpoint") + 1] == "/health"
        assert cmd[cmd.index("--policy") + 1] in ("cache_aware", "sticky_least_loaded")
    k8s = [d for d in _docs() if d.get("kind") == "StatefulSet"]
    assert k8s, "the Kubernetes replicas are missing"
    container = k8s[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("path", sorted(p.name for p in DEPLOY.rglob("*.yaml")))
def test_each_file_is_valid_yaml(path: str) -> None:
    (match,) = list(DEPLOY.rglob(path))
    assert list(yaml.safe_load_all(match.read_text()))
