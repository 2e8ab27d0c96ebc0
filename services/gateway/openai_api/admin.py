"""The HTTP API's administrative route: a model's A/B split, changed at run time.

    PUT /v1/admin/models/{name}/split   {"split": {"q4": 90, "fp32": 10}}

It asks for an API key marked `admin` in the key file (services.gateway.key_file): 401 without a
valid key (the key middleware), 403 with a key that is not admin or on a gateway that asks for no
keys, 404 for a model the repository lacks, 400 for a split the repository would refuse (weights
not summing to 100, an unknown version). The change holds until the repository file changes next
(services.gateway.repository_watch): the file stays the deployment's record.
"""

from __future__ import annotations

import json
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.gateway.api_keys import current_caller
from services.gateway.caller import Caller
from services.gateway.catalog import UnknownModel
from services.gateway.openai_api.errors import ApiError, bad_request
from services.gateway.openai_api.http_limits import read_json_body
from services.gateway.service import GatewayService

log = logging.getLogger(__name__)

_MAX_BODY_BYTES = 64 * 1024


def admin_caller(action: str) -> Caller:
    """The key of an administrative request; 403 (naming `action`) unless it is marked admin."""
    caller = current_caller()
    if caller is None or not caller.admin:
        raise ApiError(403, f"{action} needs an API key marked admin in --api-key-file", "PermissionDeniedError")
    return caller


async def put_split(service: GatewayService, request: Request) -> Response:
    """Set a model's split; the answer is the split now in force."""
    caller = admin_caller("changing a split")
    name = request.path_params["name"]
    try:
        body = json.loads(await read_json_body(request, _MAX_BODY_BYTES))
    except json.JSONDecodeError as error:
        raise bad_request(f"the body is not JSON: {error}", None) from error
    split = body.get("split") if isinstance(body, dict) else None
    if not isinstance(split, dict) or not split:
        raise bad_request('split: expected {"split": {"VERSION": weight, ...}}', "split")
    try:
        service.catalog = service.served_catalog().with_split(name, split)
    except UnknownModel as error:
        raise ApiError(404, str(error), "NotFoundError", "name") from error
    except ValueError as error:
        raise bad_request(str(error), "split") from error
    log.info("split of model %s set to %s by key %s", name, split, caller.name)
    return JSONResponse({"model": name, "split": split})
