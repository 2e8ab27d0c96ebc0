"""A small synchronous Python client of the Tandem gateway.

    with TandemClient("127.0.0.1:50051") as client:
        for chunk in client.chat([{"role": "user", "content": "Hello"}], max_tokens=32):
            print(chunk.text, end="", flush=True)

Errors are the gRPC ones (`grpc.RpcError`, with `.code()` and `.details()`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from services.common.chunk import Chunk, Timings, TokenLogprob, Usage
from services.common.convert import chunk_from_proto
from services.common.grpc_limits import DEFAULT_GRPC_LIMITS

# Message sizes as the gateway's defaults (services.common.grpc_limits); `options` may add others.
_LIMITS = DEFAULT_GRPC_LIMITS.channel_options()

__all__ = ["Chunk", "ChunkStream", "ModelInfo", "TandemClient", "Timings", "TokenLogprob", "Usage"]


@dataclass(frozen=True)
class ModelInfo:
    """A served model version: the model's name, its context length in tokens, and (in a deployment
    with a model repository) the version, which `model="NAME@VERSION"` asks for exactly."""

    id: str
    max_model_len: int
    version: str = ""
    state: str = ""  # "serving", "loading" or "draining"


class TandemClient:
    """A connection to a gateway; cheap to keep, safe to share between threads."""

    def __init__(
        self,
        address: str,
        options: Sequence[tuple[str, object]] = (),
        *,
        api_key: str | None = None,
        tls: bool = False,
        ca_file: str | Path | None = None,
    ) -> None:
        """Connect (lazily) to the gateway at host:port: over TLS with `tls` or a `ca_file` (the PEM
        CA the gateway's certificate must chain to; default the system's roots), else plaintext.
        `api_key` goes with every call as `authorization: Bearer <key>`."""
        if tls or ca_file is not None:
            roots = Path(ca_file).read_bytes() if ca_file is not None else None
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
            self._channel = grpc.secure_channel(address, credentials, options=[*_LIMITS, *options])
        else:
            self._channel = grpc.insecure_channel(address, options=[*_LIMITS, *options])
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def generate(
        self,
        prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        *,
        model: str = "",
        request_id: str = "",
        timeout: float | None = None,
        ttft_ms: int = 0,
        tpot_ms: int = 0,
        priority: int = 0,
        user: str = "",
        **sampling: object,
    ) -> ChunkStream:
        """Stream a completion of exactly one of: text, token ids, or chat messages.

        `sampling` takes the fields of tandem.v1.SamplingParams (max_tokens, temperature, top_p,
        seed, stop, ignore_eos, ...); None leaves a field unset. `ttft_ms` and `tpot_ms` are the
        request's latency objectives (0: the gateway's defaults); a higher `priority` is served
        first when requests must wait; `user` names the caller (a model's A/B split gives one user one
        version). The request starts at once.
        """
        given = [value is not None for value in (prompt, token_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, token_ids or messages")
        request = gateway_pb2.GenerateRequest(
            request_id=request_id,
            model=model,
            slo=common_pb2.Slo(ttft_ms=ttft_ms, tpot_ms=tpot_ms),
            priority=priority,
            user=user,
            sampling=common_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
        )
        if prompt is not None:
            request.text = prompt
        elif token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        else:
            request.chat.messages.extend(
                gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()
            )
        return ChunkStream(self._stub.Generate(request, timeout=timeout, metadata=self._metadata))

    def chat(self, messages: Sequence[Mapping[str, str]], **kwargs: object) -> ChunkStream:
        """Stream the assistant's reply to a conversation; keyword arguments as for `generate`."""
        return self.generate(messages=messages, **kwargs)

    def list_models(self, timeout: float | None = None) -> list[ModelInfo]:
        """The models the deployment serves."""
        response = self._stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=timeout, metadata=self._metadata)
        return [ModelInfo(id=m.id, max_model_len=m.max_model_len, version=m.version, state=m.state)
                for m in response.models]

    def close(self) -> None:
        """Close the connection; streams still open are cancelled."""
        self._channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ChunkStream(Iterator[Chunk]):
    """One request's chunks as they arrive.

    `cancel()` stops the request on the server; so does leaving a `with` block over the stream, or
    dropping the stream, before its end. Reading a cancelled stream raises grpc.RpcError (CANCELLED).
    """

    def __init__(self, call: grpc.Call) -> None:
        self._call = call

    def __next__(self) -> Chunk:
        return _chunk(next(self._call))

    def trailers(self) -> dict[str, str]:
        """The call's trailing metadata (known once the stream has ended): the model version that
        served it, and for a key with rate limits OpenAI's x-ratelimit-* fields."""
        return dict(self._call.trailing_metadata() or ())

    def model_version(self) -> str:
        """The model version that served the request (NAME@VERSION, or the model's name)."""
        return self.trailers().get("tandem-model-version", "")

    def cancel(self) -> None:
        """Cancel the request (a no-op once it has ended)."""
        self._call.cancel()

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()


def _chunk(response: gateway_pb2.GenerateResponse) -> Chunk:
    return chunk_from_proto(response.chunk, response.request_id)
