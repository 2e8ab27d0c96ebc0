"""Lower KV tiers in real processes: a colocated worker with the node's host tier (its owner a
process of its own) and a disk tier. A conversation's second turn after the worker was killed
answers as the worker computed it before, its prefix loaded back from memory (the owner kept it)
and, once the owner too was killed, from disk; the worker's metrics say which tier served it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from reference import PINNED_FLAGS
from tandem.v1 import decode_pb2, decode_pb2_grpc

from engine.sampling_params import SamplingParams
from harness.worker import WorkerProcess, start_worker
from services.common.convert import sampling_params_to_proto
from services.common.server import channel_options

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DEADLINE_S = 60.0


class Node:
    """A host tier owner and one worker on it, each restartable; the worker's disk tier in `disk`."""

    def __init__(self, directory) -> None:
        self.socket = str(directory / "host.sock")
        self.disk = str(directory / "disk")
        self.owner: subprocess.Popen | None = None
        self.worker: WorkerProcess | None = None

    def start_owner(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.owner = subprocess.Popen([sys.executable, "-m", "services.cli", "kv-host-tier", "--socket", self.socket,
                                       "--capacity-mib", "64"], env=env)
        deadline = time.monotonic() + DEADLINE_S
        while not _answers(self.socket):  # a killed owner's socket file stays until the next one replaces it
            assert time.monotonic() < deadline and self.owner.poll() is None, "the host tier owner did not start"
            time.sleep(0.05)

    def start_worker(self) -> None:
        # 10 blocks of 16 tokens: the two turns do not fit the device cache together.
        self.worker = start_worker(["worker", "--role", "colocated", "--port", "0", "--threads", "1",
                                    "--kv-cache-blocks", "10", "--block-size", "16", *PINNED_FLAGS,
                                    "--kv-host-tier", self.socket, "--kv-disk-tier", self.disk])

    def kill(self, process) -> None:
        process.kill()
        process.wait()

    def generate(self, prompt: list[int]) -> list[int]:
        with grpc.insecure_channel(self.worker.address, options=channel_options()) as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)
            request = decode_pb2.DecodeRequest(prompt_token_ids=prompt, sampling=sampling_params_to_proto(GREEDY))
            return [t for chunk in stub.Generate(request, timeout=120) for t in chunk.token_ids]

    def tier_hits(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://{self.worker.metrics_address}/metrics", timeout=30) as response:
            families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
        return {s.labels["tier"]: s.value for s in families["tandem:kv_tier_hits"].samples}


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[Node]:
    node = Node(tmp_path_factory.mktemp("node"))
    node.start_owner()
    node.start_worker()
    yield node
    node.worker.stop()
    node.kill(node.owner)


def test_second_turn_after_restarts_loads_from_memory_then_disk(node, tokenizer) -> None:
    question = tokenizer.encode("A short story about a lighthouse keeper who finds a message in a bottle. "
                                "Once upon a time, on a rocky island far from the coast,")
    first = node.generate(question)
    second = [*question, *first, *tokenizer.encode(" Then one stormy night, the keeper heard a knock", False)]
    expected = node.generate(second)  # the turn as computed with its prefix in the device cache
    node.worker.proc.kill()  # mid-service: whatever it was copying down is lost, never half-stored
    node.worker.proc.wait()
    node.start_worker()
    assert node.generate(second) == expected
    assert node.tier_hits()["host"] > 0 and node.tier_hits()["disk"] == 0
    node.worker.stop()
    node.kill(node.owner)  # the node's memory tier is gone too: only the disk keeps the turn
    node.start_owner()
    node.start_worker()
    assert node.generate(second) == expected
    assert node.tier_hits()["disk"] > 0 and node.tier_hits()["host"] == 0
