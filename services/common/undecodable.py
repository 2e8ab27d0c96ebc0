"""A request message that does not parse (e.g. a string field that is not UTF-8) is bad input.

grpc.aio answers a request its deserializer cannot parse with UNKNOWN ("Unexpected DecodeError"),
before any handler runs. `DecodeErrorInterceptor` gives every unary-request RPC a deserializer that
keeps the failure instead, and a handler that answers it with INVALID_ARGUMENT naming the string
field that is not UTF-8 (found by walking the wire format), else the message type. Client-streaming
RPCs (the KV Push stream, checksummed chunks between workers) are left alone.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor


@dataclass(frozen=True)
class _Undecodable:
    """What the deserializer returns for bytes that do not parse."""

    message: str


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT, not UNKNOWN, for a unary request that does not parse."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserialize = handler.request_deserializer
        # The generated code passes `Message.FromString`, bound to the message class.
        descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)

        def tolerant(data: bytes) -> Any:
            try:
                return deserialize(data)
            except Exception as error:
                return _Undecodable(_what_is_wrong(data, descriptor, error))

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _checked_stream(handler.unary_stream), tolerant, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            _checked_unary(handler.unary_unary), tolerant, handler.response_serializer)


def _checked_unary(behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]):
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return unary


def _checked_stream(behavior: Callable[[Any, grpc.aio.ServicerContext], Any]):
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        responses = behavior(request, context)
        if inspect.isawaitable(responses):  # a handler that writes with context.write
            await responses
            return
        # aclosing: when this stream is closed early (the client went away), the handler's own
        # clean-up runs now rather than whenever the garbage collector finalizes it.
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response

    return stream


def _what_is_wrong(data: bytes, descriptor: Descriptor | None, error: Exception) -> str:
    """"<field path>: ..." for the first string field that is not UTF-8, else the parser's error."""
    if descriptor is not None:
        try:
            field = _bad_string_field(data, descriptor)
        except (IndexError, ValueError):  # the wire format itself is broken
            field = None
        if field is not None:
            return f"{field}: is not valid UTF-8"
    return f"request: does not parse as {descriptor.full_name if descriptor else 'the request'}: {error}"


def _bad_string_field(data: bytes, descriptor: Descriptor, prefix: str = "") -> str | None:
    """The path (e.g. "chat.messages.1.content") of the first string field in `data` whose bytes
    are not UTF-8; None when there is none. IndexError or ValueError when the wire format is broken."""
    seen: dict[int, int] = {}
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, position = _varint(data, position)
        elif wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        elif wire_type == 2:
            length, position = _varint(data, position)
            value, position = data[position:position + length], position + length
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            index = seen.get(number, 0)
            seen[number] = index + 1
            path = prefix + field.name + (f".{index}" if field.is_repeated else "")
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    value.decode("utf-8")
                except UnicodeDecodeError:
                    return path
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = _bad_string_field(value, field.message_type, path + ".")
                if found is not None:
                    return found
        else:
            raise ValueError(f"wire type {wire_type}")
    return None


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position
