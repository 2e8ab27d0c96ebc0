"""A real Prometheus server for tests: the `prometheus` binary (Debian's package, which `make
prometheus` installs) scraping the given targets every second, its storage in the caller's folder,
queried through its HTTP API.

    with PrometheusServer({"gateway": [gateway.http_address]}, tmp_path) as prometheus:
        result = prometheus.wait_for('tandem:requests_served_total{job="gateway"} > 0', timeout=60)
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.ports import free_port

# Samples of an instant query's result: each {"metric": {label: value}, "value": [time, "number"]}.
Result = list[dict[str, Any]]


class PrometheusServer:
    """A `prometheus` process scraping `jobs` (job name -> host:port targets, each serving /metrics)."""

    def __init__(self, jobs: Mapping[str, Sequence[str]], folder: Path, binary: str = "prometheus") -> None:
        """`folder`: where its configuration, storage and log go."""
        self.address = f"127.0.0.1:{free_port()}"
        config = folder / "prometheus.json"  # JSON is YAML too
        config.write_text(json.dumps({
            # The timeout may not exceed the interval; a test wants samples soon.
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]}
                               for job, targets in jobs.items()],
        }))
        self.log_path = folder / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                 f"--web.listen-address={self.address}"], stdout=log, stderr=subprocess.STDOUT)

    def __enter__(self) -> PrometheusServer:
        try:
            self._wait_ready(timeout=60.0)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM, and SIGKILL if it has not exited after 10 s."""
        self.proc.terminate()
        try:
            self.proc.wait(10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready after {timeout} s:\n{self.log_path.read_text()}")
            time.sleep(0.2)

    def query(self, expr: str) -> Result:
        """An instant PromQL query's samples now; ValueError with Prometheus's error for a bad query."""
        url = f"http://{self.address}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            body = json.load(error)
        if body["status"] != "success":
            raise ValueError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def wait_for(self, expr: str, accept: Callable[[Result], bool] = bool, timeout: float = 60.0) -> Result:
        """`expr`'s samples once `accept` takes them (by default: once there are any); TimeoutError
        with the last ones if that does not happen within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if accept(result):
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expr}: still {result} after {timeout} s")
            time.sleep(0.5)


def values(result: Result, label: str | None = None) -> dict[str | None, float]:
    """An instant query's sample values by one label's value (None: the only sample's, by None)."""
    return {(sample["metric"].get(label) if label else None): float(sample["value"][1]) for sample in result}
