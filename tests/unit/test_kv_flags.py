"""`--kv-checksum`: the same flag on every command that ends a KV transfer, translated to a bool."""

from __future__ import annotations

import pytest

from services.cli import build_parser
from services.commands.kv_flags import kv_checksum

COMMANDS = [["prefill"], ["decode"], ["worker"], ["mesh"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_checksums_are_on_unless_the_flag_says_off(command: list[str]) -> None:
    parser = build_parser()
    assert kv_checksum(parser.parse_args(command)) is True
    assert kv_checksum(parser.parse_args([*command, "--kv-checksum", "on"])) is True
    assert kv_checksum(parser.parse_args([*command, "--kv-checksum", "off"])) is False


@pytest.mark.parametrize("command", COMMANDS)
def test_another_word_is_refused(command: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--kv-checksum", "no"])
