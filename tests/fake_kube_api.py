"""A local HTTP server that stands in for the few Kubernetes API endpoints the gateway calls.

No Kubernetes API server can run on these machines, so discovery and the planner's adapter are
tested against this one, driven by the real `kubernetes` client over HTTP: EndpointSlice list and
watch (resource versions, bookmarks-free event streams, `410 Gone` for compacted versions),
Deployment `scale` get/patch, and coordination.k8s.io Lease get/create/update with optimistic
concurrency on resourceVersion.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from kubernetes import client

_SLICES = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/([^/]+)/endpointslices$")
_SCALE = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
_LEASES = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases(?:/([^/]+))?$")


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message}


class FakeKubeApi:
    """The stand-in API server's state and its HTTP server (on 127.0.0.1, a free port)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.resource_version = 1
        self._slices: dict[str, dict] = {}
        self._events: list[tuple[int, str, dict]] = []
        self._compacted_below = 0
        self._watch_generation = 0
        self.failures_to_inject = 0
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.replicas: dict[str, int] = {}
        self.patches: list[tuple[str, int]] = []
        self.leases: dict[str, dict] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def configuration(self) -> client.Configuration:
        """A client configuration pointing at this server."""
        configuration = client.Configuration()
        configuration.host = f"http://127.0.0.1:{self._server.server_address[1]}"
        return configuration

    def close(self) -> None:
        """Stop serving (open watches end)."""
        with self._changed:
            self._watch_generation += 1
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def put_slice(self, name: str, service: str, endpoints: list[tuple[str, bool | None]], port: int,
                  port_name: str = "grpc") -> None:
        """Create or replace an EndpointSlice of `service`: (address, ready) per endpoint."""
        items = []
        for address, ready in endpoints:
            conditions = {} if ready is None else {"ready": ready}
            items.append({"addresses": [address], "conditions": conditions})
        with self._changed:
            kind = "MODIFIED" if name in self._slices else "ADDED"
            self.resource_version += 1
            self._slices[name] = {
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
                "metadata": {"name": name, "namespace": "tandem", "resourceVersion": str(self.resource_version),
                             "labels": {"kubernetes.io/service-name": service}},
                "endpoints": items,
                "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
            }
            self._events.append((self.resource_version, kind, self._slices[name]))
            self._changed.notify_all()

    def delete_slice(self, name: str) -> None:
        """Delete an EndpointSlice."""
        with self._changed:
            self.resource_version += 1
            removed = self._slices.pop(name)
            self._events.append((self.resource_version, "DELETED", removed))
            self._changed.notify_all()

    def expire_watches(self) -> None:
        """Forget the event history and end open watches: resuming from any version seen so far
        is answered 410 Gone, as after an etcd compaction."""
        with self._changed:
            self._compacted_below = self.resource_version + 1
            self._watch_generation += 1
            self._changed.notify_all()

    def count(self, method: str, path: str, **query: str) -> int:
        """How many requests with this method and path (and these query values) arrived."""
        return sum(1 for m, p, q in self.requests
                   if m == method and p == path and all(q.get(k) == v for k, v in query.items()))

    def _selected(self, selector: str | None, obj: dict) -> bool:
        if not selector:
            return True
        key, _, value = selector.partition("=")
        return obj["metadata"]["labels"].get(key) == value

    def list_slices(self, selector: str | None) -> dict:
        with self._changed:
            items = [obj for obj in self._slices.values() if self._selected(selector, obj)]
            return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self.resource_version)}, "items": items}

    def watch_slices(self, selector: str | None, since: int, timeout_s: float, write) -> None:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            if since < self._compacted_below:
                write({"type": "ERROR", "object": _status(410, "Expired", "too old resource version")})
                return
            generation = self._watch_generation
        while True:
            with self._changed:
                events = [(rv, kind, obj) for rv, kind, obj in self._events
                          if rv > since and self._selected(selector, obj)]
                if not events:
                    self._changed.wait(max(0.0, deadline - time.monotonic()))
                    if generation != self._watch_generation or time.monotonic() >= deadline:
                        return
                    continue
            for rv, kind, obj in events:
                write({"type": kind, "object": obj})
                since = rv


def _handler(api: FakeKubeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args) -> None:
            pass

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            query = {key: values[-1] for key, values in parse_qs(url.query).items()}
            api.requests.append((method, url.path, query))
            if api.failures_to_inject:
                api.failures_to_inject -= 1
                self._reply(500, _status(500, "InternalError", "injected failure"))
                return
            if (match := _SLICES.match(url.path)) and method == "GET":
                self._slices(query)
            elif match := _SCALE.match(url.path):
                self._scale(method, match.group(2))
            elif match := _LEASES.match(url.path):
                self._lease(method, match.group(2))
            else:
                self._reply(404, _status(404, "NotFound", url.path))

        def _slices(self, query: dict[str, str]) -> None:
            selector = query.get("labelSelector")
            if query.get("watch") != "true":
                self._reply(200, api.list_slices(selector))
                return
            # Chunked, one event per line, as the API server streams a watch.
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def write(event: dict) -> None:
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()

            api.watch_slices(selector, int(query.get("resourceVersion", "0")),
                             float(query.get("timeoutSeconds", "30")), write)
            self.wfile.write(b"0\r\n\r\n")

        def _scale(self, method: str, name: str) -> None:
            if name not in api.replicas:
                self._reply(404, _status(404, "NotFound", f"deployments.apps {name!r} not found"))
                return
            if method == "PATCH":
                replicas = self._body()["spec"]["replicas"]
                api.replicas[name] = replicas
                api.patches.append((name, replicas))
            self._reply(200, {"apiVersion": "autoscaling/v1", "kind": "Scale",
                              "metadata": {"name": name, "namespace": "tandem"},
                              "spec": {"replicas": api.replicas[name]},
                              "status": {"replicas": api.replicas[name]}})

        def _lease(self, method: str, name: str | None) -> None:
            if method == "POST":
                lease = self._body()
                name = lease["metadata"]["name"]
                if name in api.leases:
                    self._reply(409, _status(409, "AlreadyExists", f"lease {name!r} exists"))
                    return
            elif name not in api.leases:
                self._reply(404, _status(404, "NotFound", f"lease {name!r} not found"))
                return
            elif method == "GET":
                self._reply(200, api.leases[name])
                return
            else:
                lease = self._body()
                current = api.leases[name]["metadata"]["resourceVersion"]
                if lease["metadata"].get("resourceVersion") != current:
                    self._reply(409, _status(409, "Conflict", "the object has been modified"))
                    return
            api.resource_version += 1
            lease.setdefault("metadata", {})["resourceVersion"] = str(api.resource_version)
            api.leases[name] = lease
            self._reply(201 if method == "POST" else 200, lease)

        def do_GET(self) -> None:
            self._route("GET")

        def do_PATCH(self) -> None:
            self._route("PATCH")

        def do_POST(self) -> None:
            self._route("POST")

        def do_PUT(self) -> None:
            self._route("PUT")

    return Handler
