"""Per-key rate limits through the gateway's real edges and core, in process and on an injected
clock: the HTTP app behind ApiKeyMiddleware (429, Retry-After, x-ratelimit-* headers) and the gRPC
Gateway behind ApiKeyInterceptor on loopback (RESOURCE_EXHAUSTED with a retry-after trailer).

The registry has no worker, so a request the limits let in ends UNAVAILABLE (503) having used
nothing; what matters here is whether the key's limits let it in, and that they saw which key it was.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from gateway_calls import generate_failures
from starlette.testclient import TestClient
from tandem.v1 import gateway_pb2

from services.gateway.api_keys import ApiKeyMiddleware, ApiKeys
from services.gateway.catalog import ModelCatalog
from services.gateway.key_file import load_api_keys
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import ServedModel
from services.gateway.openai_api.app import create_app
from services.gateway.rate_limits import RateLimiter
from services.gateway.registry import WorkerRegistry
from services.gateway.service import GatewayService

KEYS = """
[[key]]
name = "tight"
secret = "sk-tight"
requests_per_minute = 1
tokens_per_minute = 1000

[[key]]
name = "free"
secret = "sk-free"
"""


class FakeClock:
    """Seconds that move only when a test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def gateway(tmp_path: Path, tokenizer) -> tuple[GatewayService, ApiKeys, FakeClock]:
    key_file = tmp_path / "keys.toml"
    key_file.write_text(KEYS)
    keys = load_api_keys(key_file, {})
    assert keys is not None
    clock = FakeClock()
    service = GatewayService(WorkerRegistry(), GatewayMetrics("smollm2"), rate_limits=RateLimiter(clock))
    service.catalog = ModelCatalog.single(ServedModel("smollm2", 8192, tokenizer))
    return service, keys, clock


def _sample(metrics: str, family: str, key: str) -> float:
    prefix = f'{family}{{key="{key}",model_name="smollm2",model_version=""}} '
    return next(float(line[len(prefix):]) for line in metrics.splitlines() if line.startswith(prefix))


def test_an_http_caller_over_its_limit_gets_429_with_when_to_retry(gateway) -> None:
    service, keys, clock = gateway
    app = ApiKeyMiddleware(create_app(service), keys, metrics_auth=False, rate_limits=service.rate_limits)
    body = {"prompt": "Hello there", "max_tokens": 5}
    with TestClient(app) as client:
        def complete(secret: str):
            return client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {secret}"})

        let_in = complete("sk-tight")
        assert let_in.status_code == 503  # past the limits, then no worker; it used no token
        assert {name: value for name, value in let_in.headers.items() if name.startswith("x-ratelimit-")} == {
            "x-ratelimit-limit-requests": "1", "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "1m0s", "x-ratelimit-limit-tokens": "1000",
            "x-ratelimit-remaining-tokens": "1000", "x-ratelimit-reset-tokens": "0s",
        }
        refused = complete("sk-tight")
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "60"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        error = refused.json()["error"]
        assert error["type"] == "RateLimitError" and "'tight'" in error["message"]
        assert "sk-tight" not in error["message"]
        clock.now += 30.5
        assert complete("sk-tight").headers["retry-after"] == "30"  # 29.5 s, rounded up
        clock.now += 29.5
        assert complete("sk-tight").status_code == 503
        # A key without limits is never refused and gets no x-ratelimit-* headers.
        for _ in range(3):
            free = complete("sk-free")
            assert free.status_code == 503
            assert not [name for name in free.headers if name.startswith("x-ratelimit-")]
        metrics = client.get("/metrics").text
    assert _sample(metrics, "tandem:key_requests_total", "tight") == 4
    assert _sample(metrics, "tandem:key_rate_limited_total", "tight") == 2
    # Refused for capacity, by why: the key's limits; none let in was admitted (no worker).
    assert 'tandem:requests_refused_total{model_name="smollm2",model_version="",reason="rate_limit"} 2.0' in metrics
    assert 'tandem:requests_admitted_total{model_name="smollm2",model_version=""} 0.0' in metrics
    assert _sample(metrics, "tandem:key_requests_total", "free") == 3
    assert _sample(metrics, "tandem:key_prompt_tokens_total", "tight") == 0


async def _generate_codes(service: GatewayService, keys: ApiKeys,
                         secrets: list[str]) -> list[tuple[str, str | None, str | None] | None]:
    """(status code name, retry-after trailer, x-ratelimit-remaining-requests trailer) of a Generate
    call with each secret, in turn."""
    request = gateway_pb2.GenerateRequest(text="Hello there")
    request.sampling.max_tokens = 5
    answers = []
    for error in await generate_failures(service, keys, [(secret, request) for secret in secrets]):
        trailers = dict(error.trailing_metadata() or ()) if error is not None else {}
        answers.append((error.code().name, trailers.get("retry-after"), trailers.get("x-ratelimit-remaining-requests"))
                       if error is not None else None)
    return answers


def test_a_grpc_caller_over_its_limit_gets_resource_exhausted_with_a_retry_after_trailer(gateway) -> None:
    service, keys, _ = gateway
    answers = asyncio.run(_generate_codes(service, keys, ["sk-tight", "sk-tight", "sk-free", "sk-free"]))
    # The limited key's answers carry its limits as trailers, as HTTP answers carry them as headers.
    assert answers == [("UNAVAILABLE", None, "0"), ("RESOURCE_EXHAUSTED", "60", "0"), ("UNAVAILABLE", None, None),
                       ("UNAVAILABLE", None, None)]
