"""Hypothesis strategies over every public field of Tandem's APIs, valid and not.

Each field has values that are valid and values that are anything its type can carry; a request
takes valid values except in a few fields, so that both every refusal and the paths behind valid
fields (tokenizing, sampling, generating) are reached. Valid requests must stay cheap to serve:
`max_tokens` is at most 4 (or far beyond any context), and the gateway under test limits prompts
and totals to a few dozen tokens.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import strategies as st
from tandem.v1 import common_pb2, decode_pb2, gateway_pb2, kvtransfer_pb2, prefill_pb2

UINT32 = 2**32 - 1
INT32 = 2**31 - 1
UINT64 = 2**64 - 1
# An out-of-context value for every max_tokens-like field: no model here has 100k tokens of context.
BEYOND_CONTEXT = 100_000

wide_floats = st.one_of(
    st.sampled_from([-0.0, -1.0, 1e-40, math.nan, math.inf, -math.inf, 3.4e38, -3.4e38]),
    st.floats(width=32),
)
texts = st.one_of(st.text(max_size=40), st.sampled_from(["", "Hello", "<|im_start|>", "{{ 7*7 }}", "\x00", "é" * 20]))
words = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
# Oversized prompts: beyond the gateway's max_prompt_tokens, and some beyond the model's context.
oversized_texts = st.sampled_from(["word " * 200, "x" * 20_000])
in_vocabulary = st.integers(0, 49_151)
valid_prompt_ids = st.lists(in_vocabulary, min_size=1, max_size=30)
token_ids = st.one_of(in_vocabulary, st.integers(49_000, 50_000), st.integers(0, UINT32))
valid_max_tokens = st.integers(0, 4)
wide_max_tokens = st.one_of(st.integers(0, 4), st.integers(BEYOND_CONTEXT, UINT32))

# Per SamplingParams field: (valid values, values of any kind), None meaning "left unset".
_SAMPLING_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "max_tokens": (valid_max_tokens, wide_max_tokens),
    "min_tokens": (st.just(0), st.integers(0, UINT32)),
    "temperature": (st.one_of(st.none(), st.floats(0, 2)), wide_floats),
    "top_k": (st.one_of(st.integers(-1, 60), st.integers(49_000, 10**6)), st.integers(-INT32 - 1, INT32)),
    "top_p": (st.one_of(st.none(), st.floats(0.05, 1)), wide_floats),
    "min_p": (st.floats(0, 1), wide_floats),
    "repetition_penalty": (st.one_of(st.none(), st.floats(0.1, 10)), wide_floats),
    "presence_penalty": (st.floats(-2, 2), wide_floats),
    "frequency_penalty": (st.floats(-2, 2), wide_floats),
    "seed": (st.one_of(st.none(), st.integers(0, 2**63 - 1)), st.integers(0, UINT64)),
    "stop": (st.lists(words, max_size=3), st.lists(texts, max_size=18)),
    "stop_token_ids": (st.lists(token_ids, max_size=3), st.lists(st.integers(0, UINT32), max_size=4)),
    "ignore_eos": (st.booleans(), st.booleans()),
    "logprobs": (st.one_of(st.none(), st.integers(0, 20)), st.integers(0, UINT32)),
    "skip_special_tokens": (st.one_of(st.none(), st.booleans()), st.booleans()),
}


@st.composite
def sampling_protos(draw: st.DrawFn) -> common_pb2.SamplingParams:
    """A SamplingParams message, valid but for a few fields set to anything the proto can carry."""
    wild = draw(st.sets(st.sampled_from(sorted(_SAMPLING_FIELDS)), max_size=2))
    msg = common_pb2.SamplingParams()
    for name, (valid, wide) in _SAMPLING_FIELDS.items():
        value = draw(wide if name in wild else valid)
        if isinstance(value, list):
            getattr(msg, name).extend(value)
        elif value is not None:
            setattr(msg, name, value)
    return msg


@st.composite
def chat_protos(draw: st.DrawFn, wild: bool) -> gateway_pb2.ChatMessages:
    """Chat turns: a user's, or (`wild`) any roles and contents, possibly none."""
    roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", ""]), texts) if wild else st.just("user")
    messages = draw(st.lists(st.tuples(roles, texts if wild else words), min_size=0 if wild else 1, max_size=4))
    return gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages])


@st.composite
def generate_requests(draw: st.DrawFn, model_id: str) -> gateway_pb2.GenerateRequest:
    """A tandem.v1.GenerateRequest with every field drawn: valid, or (a few fields) anything."""
    wild = draw(st.sets(st.sampled_from(["model", "prompt", "slo"]), max_size=2))
    msg = gateway_pb2.GenerateRequest(
        request_id=draw(texts),
        model=draw(texts if "model" in wild else st.sampled_from(["", model_id])),
        sampling=draw(sampling_protos()),
        priority=draw(st.integers(-INT32 - 1, INT32)),
    )
    slo = st.integers(0, UINT32) if "slo" in wild else st.integers(0, 600_000)
    msg.slo.CopyFrom(common_pb2.Slo(ttft_ms=draw(slo), tpot_ms=draw(slo)))
    kinds = ["text", "oversized", "token_ids", "chat", "none"] if "prompt" in wild else ["text", "token_ids", "chat"]
    kind = draw(st.sampled_from(kinds))
    if kind == "text":
        msg.text = draw(texts if "prompt" in wild else words)
    elif kind == "oversized":
        msg.text = draw(oversized_texts)
    elif kind == "token_ids":
        ids = st.lists(token_ids, max_size=120) if "prompt" in wild else valid_prompt_ids
        msg.token_ids.ids.extend(draw(ids))
    elif kind == "chat":
        msg.chat.CopyFrom(draw(chat_protos("prompt" in wild)))
    return msg


@st.composite
def decode_requests(draw: st.DrawFn, prefill_address: str) -> decode_pb2.DecodeRequest:
    """A decode worker's tandem.v1.DecodeRequest, as only a gateway should send it: valid, or (a
    few fields) anything."""
    wild = draw(st.sets(st.sampled_from(["request_id", "prompt_token_ids", "prefill_address", "output"]),
                        max_size=2))
    prompt = st.lists(token_ids, max_size=120) if "prompt_token_ids" in wild else valid_prompt_ids
    request = decode_pb2.DecodeRequest(
        request_id=draw(texts if "request_id" in wild else st.uuids().map(str)),
        prompt_token_ids=draw(prompt),
        sampling=draw(sampling_protos()),
        prefill_address=draw(texts if "prefill_address" in wild else st.sampled_from(["", prefill_address])),
    )
    if "output" in wild:  # a migrated request's delivered output (services.gateway.migration)
        request.output_token_ids.extend(draw(st.lists(token_ids, max_size=8)))
        request.output_text_length = draw(st.one_of(st.integers(0, 40), st.integers(0, UINT32)))
    return request


@st.composite
def kv_targets(draw: st.DrawFn, layout: kvtransfer_pb2.KVLayout) -> kvtransfer_pb2.KVTarget | None:
    """Where a prefill worker is told to push pages: nowhere, a layout of anything, or the real layout
    with destination blocks and a rendezvous of anything."""
    kind = draw(st.sampled_from(["unset", "layout", "grpc", "torch_dist"]))
    if kind == "unset":
        return None
    target = kvtransfer_pb2.KVTarget(
        layout=layout, block_ids=draw(st.lists(st.integers(0, UINT32), max_size=4)),
        num_cached_tokens=draw(st.integers(0, UINT32)), transfer_id=draw(st.integers(0, UINT64)))
    if kind == "layout":
        target.layout.CopyFrom(kvtransfer_pb2.KVLayout(
            model=draw(texts), num_layers=draw(st.integers(0, UINT32)), num_kv_heads=draw(st.integers(0, UINT32)),
            head_dim=draw(st.integers(0, UINT32)), dtype=draw(st.sampled_from(["float32", "int8", ""])),
            block_size=draw(st.integers(0, UINT32))))
    elif kind == "grpc":
        target.grpc.address = draw(texts)
    else:
        target.torch_dist.CopyFrom(kvtransfer_pb2.TorchDistTarget(
            host=draw(texts), port=draw(st.integers(0, UINT32)), namespace=draw(texts), backend=draw(texts)))
    return target


@st.composite
def prefill_requests(draw: st.DrawFn, layout: kvtransfer_pb2.KVLayout) -> prefill_pb2.PrefillRequest:
    """A prefill worker's tandem.v1.PrefillRequest, as only a decode worker should send it, drawn freely."""
    prompt = draw(st.lists(token_ids, max_size=40))
    sampling = draw(sampling_protos())
    request = prefill_pb2.PrefillRequest(request_id=draw(texts), prompt_token_ids=prompt, sampling=sampling,
                                         output_token_ids=draw(st.lists(token_ids, max_size=4)))
    target = draw(kv_targets(layout))
    if target is not None:
        request.kv_target.CopyFrom(target)
    return request


def with_invalid_utf8(message: Any, text: str) -> bytes:
    """`message` serialized with the UTF-8 bytes of `text` (a string field's value) made invalid."""
    data = message.SerializeToString()
    encoded = text.encode()
    assert data.count(encoded) == 1, "the marker must occur once"
    return data.replace(encoded, b"\xff" * len(encoded))


# JSON values of every type, for fields given the wrong one.
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), texts),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(texts, children, max_size=3)),
    max_leaves=6,
)
# Valid and cheap values of the fields whose schema allows costly or out-of-range ones (a body's
# mutated fields get any JSON value instead).
_INT = "integer"
_VALID_FIELDS: dict[str, Any] = {
    "n": {"type": _INT, "minimum": 1, "maximum": 2},
    "max_tokens": {"type": _INT, "minimum": 1, "maximum": 4},
    "max_completion_tokens": {"anyOf": [{"type": _INT, "minimum": 1, "maximum": 4}, {"type": "null"}]},
    "min_tokens": {"type": _INT, "minimum": 0, "maximum": 1},
    "temperature": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 2}, {"type": "null"}]},
    "top_p": {"anyOf": [{"type": "number", "minimum": 0.05, "maximum": 1}, {"type": "null"}]},
    "top_k": {"anyOf": [{"type": _INT, "minimum": -1, "maximum": 60}, {"type": _INT, "minimum": 49_000}]},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repetition_penalty": {"type": "number", "minimum": 0.1, "maximum": 10},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": {"anyOf": [{"type": _INT, "minimum": 0, "maximum": 2**63 - 1}, {"type": "null"}]},
    "stop_token_ids": {"type": "array", "items": {"type": _INT, "minimum": 0, "maximum": 50_000}},
    "top_logprobs": {"anyOf": [{"type": _INT, "minimum": 0, "maximum": 5}, {"type": "null"}]},
    "ttft_ms": {"anyOf": [{"type": _INT, "minimum": 1}, {"type": "null"}]},
    "tpot_ms": {"anyOf": [{"type": _INT, "minimum": 1}, {"type": "null"}]},
}


def from_json_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values of a JSON schema, for the subset pydantic writes ($ref, anyOf, enum, typed values with
    bounds, objects with required and optional properties)."""
    if "$ref" in schema:
        return from_json_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return st.one_of([from_json_schema(option, defs) for option in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        low = schema.get("minimum", schema["exclusiveMinimum"] + 1 if "exclusiveMinimum" in schema else None)
        return st.integers(low, schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False)
    if kind == "array":
        least = schema.get("minItems", 0)
        return st.lists(from_json_schema(schema.get("items", {}), defs), min_size=least, max_size=least + 3)
    if kind == "object":
        properties = {name: from_json_schema(field, defs) for name, field in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        optional = {name: value for name, value in properties.items() if name not in required}
        return st.fixed_dictionaries({name: properties[name] for name in required}, optional=optional)
    scalars = {"string": texts, "boolean": st.booleans(), "null": st.none()}
    return scalars.get(kind, json_values)


def openai_bodies(schema: dict[str, Any], model_id: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies of an OpenAI API request from its pydantic JSON schema, its numbers narrowed to valid
    and cheap values, with up to two fields replaced by a JSON value of any type."""
    schema = json.loads(json.dumps(schema))
    properties = schema["properties"]
    properties.update({name: field for name, field in _VALID_FIELDS.items() if name in properties})
    properties["model"] = {"enum": [model_id, "no-such-model"]}
    valid = from_json_schema(schema, schema.get("$defs", {}))

    @st.composite
    def bodies(draw: st.DrawFn) -> dict[str, Any]:
        body = draw(valid)
        for field in draw(st.sets(st.sampled_from(sorted(properties)), max_size=2)):
            body[field] = draw(json_values)
        return body

    return bodies()


malformed_json = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b'{"prompt": "x", ', b"[1, 2]", b"null", b'"text"', b'{"prompt": NaN}',
                     b'{"prompt": "\xff\xfe", "max_tokens": 1}', b'{"messages": [{"role": "user", "content": "\xc3"}]}',
                     b'{"prompt": "x", "max_tokens": 1e999}', b'{"prompt": "x", "temperature": Infinity}']),
)
