"""`--kv-checksum`: the same flag on every command that ends a KV transfer."""

from __future__ import annotations

import pytest

from services.cli import build_parser
from services.commands.kv_flags import KVLinkFlags
from services.common.config_flags import from_args

COMMANDS = [["prefill"], ["decode"], ["worker"], ["mesh"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_checksums_are_on_unless_the_flag_says_off(command: list[str]) -> None:
    parser = build_parser()

    def kv_checksum(argv: list[str]) -> str:
        return from_args(KVLinkFlags, parser.parse_args(argv)).kv_checksum

    assert kv_checksum(command) == "on"
    assert kv_checksum([*command, "--kv-checksum", "on"]) == "on"
    assert kv_checksum([*command, "--kv-checksum", "off"]) == "off"


@pytest.mark.parametrize("command", COMMANDS)
def test_another_word_is_refused(command: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--kv-checksum", "no"])
