"""vLLM's routes for LoRA adapters at run time, over every worker of the adapter's base:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql", "base_model_name": "m@v"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

`base_model_name` (vLLM's name for an adapter's base) is needed only where the gateway serves more
than one model version. Like the split's route (admin.py) they ask for an API key marked admin: 401
without a valid key, 403 with another. 400 names the adapter and why it cannot be served (a name a
model or another adapter has, a worker's refusal: another base, a rank too high, a module not
served), 404 an adapter unknown on unload, 503 names it when a worker cannot take the change now;
then no worker changed (services.gateway.adapter_admin). Success answers vLLM's text.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from services.gateway.adapter_admin import AdapterAdmin
from services.gateway.openai_api.admin import admin_caller
from services.gateway.openai_api.errors import bad_request
from services.gateway.openai_api.http_limits import read_json_body

log = logging.getLogger(__name__)

_MAX_BODY_BYTES = 64 * 1024


async def load_lora_adapter(admin: AdapterAdmin, request: Request) -> Response:
    """Load an adapter on every worker of its base."""
    caller = admin_caller("loading a LoRA adapter")
    body = await _body(request, ("lora_name", "lora_path", "base_model_name"))
    name, path = body.get("lora_name", ""), body.get("lora_path", "")
    if not name or not path:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.",
                          "lora_name" if not name else "lora_path")
    await admin.load(name, path, body.get("base_model_name", ""))
    log.info("LoRA adapter %s loaded by key %s", name, caller.name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(admin: AdapterAdmin, request: Request) -> Response:
    """Unload an adapter from every worker serving it."""
    caller = admin_caller("unloading a LoRA adapter")
    name = (await _body(request, ("lora_name", "lora_int_id"))).get("lora_name", "")
    if not name:
        raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    await admin.unload(name)
    log.info("LoRA adapter %s unloaded by key %s", name, caller.name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _body(request: Request, fields: tuple[str, ...]) -> dict[str, Any]:
    """The JSON object of the body; 400 naming the field that is unknown or not a string (vLLM's
    `lora_int_id` is taken and ignored: adapters are named, not numbered, here)."""
    try:
        body = json.loads(await read_json_body(request, _MAX_BODY_BYTES))
    except json.JSONDecodeError as error:
        raise bad_request(f"the body is not JSON: {error}", None) from error
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", None)
    for field, value in body.items():
        if field not in fields:
            raise bad_request(f"{field}: unknown field (known: {', '.join(fields)})", field)
        if field != "lora_int_id" and not isinstance(value, str):
            raise bad_request(f"{field}: must be a string, got {json.dumps(value)[:64]}", field)
    return body
