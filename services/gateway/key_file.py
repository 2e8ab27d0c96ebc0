"""Where the gateway's API keys come from: `--api-key-file` and `TANDEM_API_KEYS`.

The file is TOML, one `[[key]]` table a key:

    [[key]]
    name = "team-a"            # in metrics and logs (never the secret)
    secret = "sk-..."          # or secret_env = "VAR": the value of that environment variable
    requests_per_minute = 60   # optional; absent = unlimited
    tokens_per_minute = 20000  # optional; prompt plus max_tokens, settled with the tokens used
    admin = false              # optional
    models = ["smollm2", "sql-lora"]  # optional: the models and LoRA adapters it may use (a
                                      # request for another gets 403); absent = any

or, as before, one key a line (blank lines and `#` comments skipped). A file that parses as TOML
and holds anything is read as TOML and must hold only `[[key]]` tables; any other file is read a
line a key. Keys of the one-a-line format and of TANDEM_API_KEYS (comma-separated) are unlimited,
not admin, and named by their place: `key-1`, `key-2`, ... in the file, `env-1`, ... in the
variable (names that move when keys are added or removed: give TOML names for steady metrics).
Those repeat no secret: a secret given again keeps its first place and name.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from services.gateway.api_keys import ApiKey, ApiKeys
from services.gateway.caller import Caller, KeyLimits

ENV_VAR = "TANDEM_API_KEYS"
_FIELDS = ("name", "secret", "secret_env", "requests_per_minute", "tokens_per_minute", "admin", "models")


def load_api_keys(key_file: Path | None, environ: dict[str, str] | None = None) -> ApiKeys | None:
    """The keys from `key_file` and the environment's TANDEM_API_KEYS; None when neither gives any
    (the gateway then asks for none). ValueError naming the source, the key and the field when a
    key is unusable."""
    environ = dict(os.environ) if environ is None else environ
    keys: list[ApiKey] = []
    if key_file is not None:
        try:
            text = key_file.read_text()
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {key_file}: {exc.strerror}") from None
        try:
            keys = _file_keys(text, environ)
        except ValueError as error:
            raise ValueError(f"--api-key-file: {key_file}: {error}") from None
        if not keys:
            raise ValueError(f"--api-key-file: {key_file} holds no key")
    given = {key.secret for key in keys}
    parts = [part.strip().encode() for part in environ.get(ENV_VAR, "").split(",") if part.strip()]
    fresh = [secret for secret in dict.fromkeys(parts) if secret not in given]
    for number, secret in enumerate(fresh, 1):
        try:
            keys.append(ApiKey(Caller(f"env-{number}"), secret))
        except ValueError as error:
            raise ValueError(f"{ENV_VAR}: key #{number}: {error}") from None
    try:
        return ApiKeys(tuple(keys)) if keys else None
    except ValueError as error:
        raise ValueError(f"--api-key-file/{ENV_VAR}: {error}") from None


def _file_keys(text: str, environ: dict[str, str]) -> list[ApiKey]:
    """The keys of a key file's text, in either format (see the module's docstring)."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        return _line_keys(text, f"not TOML either: {error}")
    if not document:  # comments and blank lines alone: an empty file of either format
        return _line_keys(text, "")
    return _toml_keys(document, environ)


def _line_keys(text: str, toml_error: str) -> list[ApiKey]:
    keys: list[ApiKey] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        secret = line.strip()
        if not secret or secret.startswith("#") or secret in seen:
            continue
        seen.add(secret)
        try:
            keys.append(ApiKey(Caller(f"key-{len(keys) + 1}"), secret.encode()))
        except ValueError as error:
            # A broken TOML file lands here: say why it was not read as TOML.
            raise ValueError(f"line {number}: {error}" + (f" ({toml_error})" if toml_error else "")) from None
    return keys


def _toml_keys(document: dict[str, Any], environ: dict[str, str]) -> list[ApiKey]:
    unknown = sorted(set(document) - {"key"})
    if unknown:
        raise ValueError(f"unknown top-level field {unknown[0]!r}: a key file holds [[key]] tables only")
    entries = document["key"]
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ValueError("key: must be [[key]] tables")
    keys = []
    for number, entry in enumerate(entries, 1):
        name = entry.get("name")
        label = f"key #{number}" + (f" ({name})" if isinstance(name, str) else "")
        try:
            keys.append(_toml_key(entry, environ))
        except ValueError as error:
            raise ValueError(f"{label}: {error}") from None
    if keys:
        ApiKeys(tuple(keys))  # refuses a name or a secret given twice, naming both keys
    return keys


def _toml_key(entry: dict[str, Any], environ: dict[str, str]) -> ApiKey:
    unknown = [name for name in entry if name not in _FIELDS]
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field (known: {', '.join(_FIELDS)})")
    name = _typed(entry, "name", str, None)
    if name is None:
        raise ValueError("name: is missing")
    admin = _typed(entry, "admin", bool, False)
    limits = KeyLimits(entry.get("requests_per_minute"), entry.get("tokens_per_minute"))
    return ApiKey(Caller(name, limits, admin, _models(entry)), _secret(entry, environ).encode())


def _models(entry: dict[str, Any]) -> frozenset[str] | None:
    models = entry.get("models")
    if models is None:
        return None
    if not isinstance(models, list) or not all(isinstance(model, str) and model for model in models):
        raise ValueError(f"models: must be a list of model or adapter names, got {models!r}")
    if any("@" in model for model in models):
        raise ValueError(f"models: name models without @VERSION (a key allowed a model may use its every "
                         f"version), got {models!r}")
    return frozenset(models)


def _secret(entry: dict[str, Any], environ: dict[str, str]) -> str:
    secret, variable = _typed(entry, "secret", str, None), _typed(entry, "secret_env", str, None)
    if secret is not None and variable is None:
        return secret
    if variable is not None and secret is None:
        value = environ.get(variable, "")
        if not value:
            raise ValueError(f"secret_env: the environment variable {variable} is unset or empty")
        return value
    raise ValueError("secret: give either secret or secret_env")


def _typed(entry: dict[str, Any], field: str, kind: type, default: Any) -> Any:
    value = entry.get(field, default)
    if value is not default and not isinstance(value, kind):
        raise ValueError(f"{field}: must be a {'boolean' if kind is bool else 'string'}, got {value!r}")
    return value
