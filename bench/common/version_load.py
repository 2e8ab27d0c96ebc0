"""Steady closed-loop load on a gateway that serves model versions: each client sends its next
greedy request (a distinct random prompt, exactly `max_tokens` tokens, EOS ignored) as soon as its
last one ended, naming a model, and records what it saw: TTFT and TPOT at the client, the tokens
that came, the version that served it (the call's trailer), or the error.

    load = VersionLoad(gateway_address, "smollm2", clients=2, prompt_tokens=32, max_tokens=16)
    ... load.wait_for(since, lambda replies: ..., "traffic on fp32") ...
    samples = load.stop()
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from harness.load_clients import CALL_TIMEOUT_S, random_tokens
from harness.token_timer import TokenTimer
from services.client import TandemClient


@dataclass(frozen=True)
class Sample:
    """One request as its client saw it; `error` is empty when the stream ended normally."""

    started_at: float  # time.monotonic() when it was sent
    ttft_s: float | None
    tpot_s: float | None
    tokens: int
    version: str  # NAME@VERSION that served it ("" when it failed)
    error: str = ""


class VersionLoad:
    """`clients` threads sending requests for `model` through one gRPC connection until `stop`."""

    def __init__(self, address: str, model: str, clients: int, prompt_tokens: int, max_tokens: int,
                 seed: int = 0) -> None:
        self.samples: list[Sample] = []  # appended by the client threads (list.append is atomic)
        self._client = TandemClient(address)
        self._model = model
        self._prompt_tokens = prompt_tokens
        self._max_tokens = max_tokens
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(random.Random(seed * 1000 + i),), daemon=True)
                         for i in range(clients)]
        for thread in self._threads:
            thread.start()

    def request(self, model: str, prompt: list[int], max_tokens: int) -> Sample:
        """Send one request for `model` now and wait for its end."""
        clock = TokenTimer(time.monotonic)
        try:
            stream = self._client.generate(token_ids=prompt, model=model, max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True, timeout=CALL_TIMEOUT_S)
            for chunk in stream:
                clock.add(len(chunk.token_ids))
            version = stream.model_version()
        except grpc.RpcError as error:
            return Sample(clock.started_at, clock.ttft_s, clock.tpot_s, clock.tokens, "",
                          f"{error.code().name}: {error.details()}")
        return Sample(clock.started_at, clock.ttft_s, clock.tpot_s, clock.tokens, version)

    def _run(self, rng: random.Random) -> None:
        while not self._stop.is_set():
            self.samples.append(self.request(self._model, random_tokens(rng, self._prompt_tokens), self._max_tokens))

    def wait_for(self, since: float, done: Callable[[list[Sample]], bool], what: str, timeout_s: float) -> None:
        """Until `done` holds for the replies that started at `since` or later (in the order they
        ended); RuntimeError naming `what` after `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        while not done([s for s in list(self.samples) if s.started_at >= since]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not within {timeout_s:.0f} s; the latest replies: "
                                   f"{[(s.version, s.error) for s in self.samples[-5:]]}")
            time.sleep(0.1)

    def stop(self) -> list[Sample]:
        """Stop sending, wait for the requests in flight, close the connection; every sample."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._client.close()
        return list(self.samples)
