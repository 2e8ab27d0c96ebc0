"""Reading the gateway's API keys (services.gateway.key_file): the TOML format with names, limits
and admin marks, the older one-key-a-line format and TANDEM_API_KEYS, and the start-up errors that
name the key and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gateway.api_keys import ApiKey, ApiKeys
from services.gateway.caller import Caller, KeyLimits
from services.gateway.key_file import load_api_keys

TOML = """
# Two teams and the operators.
[[key]]
name = "team-a"
secret = "sk-team-a"
requests_per_minute = 60
tokens_per_minute = 20000

[[key]]
name = "team-b"
secret_env = "TEAM_B_KEY"
tokens_per_minute = 5000

[[key]]
name = "ops"
secret = "sk-ops"
admin = true
"""


def _load(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> ApiKeys | None:
    key_file = tmp_path / "keys"
    key_file.write_text(text)
    return load_api_keys(key_file, environ or {})


def test_a_toml_file_names_each_key_with_its_limits(tmp_path: Path) -> None:
    keys = _load(tmp_path, TOML, {"TEAM_B_KEY": "sk-team-b", "TANDEM_API_KEYS": "sk-ops,sk-extra"})
    assert keys == ApiKeys((
        ApiKey(Caller("team-a", KeyLimits(60, 20000)), b"sk-team-a"),
        ApiKey(Caller("team-b", KeyLimits(tokens_per_minute=5000)), b"sk-team-b"),
        ApiKey(Caller("ops", admin=True), b"sk-ops"),
        ApiKey(Caller("env-1"), b"sk-extra"),  # sk-ops is the file's already
    ))
    assert keys.identify("Bearer sk-team-b") == Caller("team-b", KeyLimits(tokens_per_minute=5000))
    assert "sk-" not in repr(keys)


def test_a_file_of_one_key_a_line_still_works(tmp_path: Path) -> None:
    lines = "# team A\nalpha-key\n\n  beta-key  \nalpha-key\n"
    keys = _load(tmp_path, lines, {"TANDEM_API_KEYS": "gamma-key, alpha-key,"})
    assert keys == ApiKeys((ApiKey(Caller("key-1"), b"alpha-key"), ApiKey(Caller("key-2"), b"beta-key"),
                            ApiKey(Caller("env-1"), b"gamma-key")))
    assert all(not key.caller.limits.limited and not key.caller.admin for key in keys.keys)
    assert load_api_keys(None, {}) is None
    assert load_api_keys(None, {"TANDEM_API_KEYS": "solo"}) == ApiKeys((ApiKey(Caller("env-1"), b"solo"),))


def test_a_bad_key_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--api-key-file: cannot read"):
        load_api_keys(tmp_path / "missing", {})
    with pytest.raises(ValueError, match="holds no key"):
        _load(tmp_path, "# nothing yet\n")
    with pytest.raises(ValueError, match=r"^TANDEM_API_KEYS: key #2: secret: holds whitespace"):
        load_api_keys(None, {"TANDEM_API_KEYS": "one,two words"})
    # A name the variable's keys take may not be taken in the file already.
    with pytest.raises(ValueError, match=r"^--api-key-file/TANDEM_API_KEYS: key #2 \(env-1\): name: already"):
        _load(tmp_path, _entry(name="env-1", secret="s1"), {"TANDEM_API_KEYS": "s2"})


def _entry(**fields: object) -> str:
    def value(item: object) -> str:
        return str(item).lower() if isinstance(item, bool) else repr(item) if isinstance(item, str) else str(item)

    return "[[key]]\n" + "".join(f"{name} = {value(item)}\n" for name, item in fields.items())


@pytest.mark.parametrize(("text", "message"), [
    (_entry(name="a", secret="s1") + _entry(name="a", secret="s2"), r"key #2 \(a\): name: already the name of key #1"),
    (_entry(name="a", secret="s1") + _entry(name="b", secret="s1"), r"key #2 \(b\): secret: already .* of key #1"),
    (_entry(name="a", secret="s1", requests_per_minute=0), r"key #1 \(a\): requests_per_minute: must be .* got 0"),
    (_entry(name="a", secret="s1", tokens_per_minute=-5), r"key #1 \(a\): tokens_per_minute: must be .* got -5"),
    (_entry(name="a", secret="s1", tokens_per_minute=1.5), r"key #1 \(a\): tokens_per_minute: must be a whole number"),
    (_entry(name="a", secret="s1", requests_per_minute=True), r"key #1 \(a\): requests_per_minute: must be a whole"),
    (_entry(name="a", secret="s1", rpm=5), r"key #1 \(a\): rpm: unknown field"),
    (_entry(name="a", secret=""), r"key #1 \(a\): secret: is empty"),
    (_entry(name="a", secret="two words"), r"key #1 \(a\): secret: holds whitespace"),
    (_entry(name="a"), r"key #1 \(a\): secret: give either secret or secret_env"),
    (_entry(name="a", secret="s1", secret_env="VAR"), r"key #1 \(a\): secret: give either secret or secret_env"),
    (_entry(name="a", secret_env="UNSET_VAR"), r"key #1 \(a\): secret_env: the environment variable UNSET_VAR"),
    (_entry(secret="s1"), r"key #1: name: is missing"),
    (_entry(name="a b", secret="s1"), r"key #1 \(a b\): name: must be 1 to 64 letters"),
    (_entry(name=7, secret="s1"), r"key #1: name: must be a string"),
    (_entry(name="a", secret="s1", admin="yes"), r"key #1 \(a\): admin: must be a boolean"),
    ("[[keys]]\nname = 'a'\n", r"unknown top-level field 'keys'"),
    ("key = 'abc'\n", r"key: must be \[\[key\]\] tables"),
    ("[[key]]\nname = 'a\n", r"line 2: secret: holds whitespace or a comma \(not TOML either: "),
])
def test_a_bad_key_is_refused_at_start_naming_the_key_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^--api-key-file: {tmp_path / 'keys'}: {message}"):
        _load(tmp_path, text)
