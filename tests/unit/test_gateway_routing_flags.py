"""The gateway's routing flags, as the CLI translates and checks them."""

from __future__ import annotations

import pytest

from services.cli import build_parser, main
from services.commands.gateway import GatewayFlags
from services.common.config_flags import from_args
from services.gateway.routing_policy import RoutingPolicy


def test_routing_flags_become_the_policy_and_default_to_it():
    args = build_parser().parse_args(["gateway", "--decode", "h:2", "--prefill", "h:1",
                                      "--remote-ttft-share", "0.8", "--tpot-slack-share", "0.6",
                                      "--split-ttft-share", "0.5"])
    assert from_args(GatewayFlags, args).routing == RoutingPolicy(remote_ttft_share=0.8, tpot_slack_share=0.6,
                                                                  split_ttft_share=0.5)
    defaults = build_parser().parse_args(["gateway", "--decode", "h:2", "--prefill", "h:1"])
    assert from_args(GatewayFlags, defaults).routing == RoutingPolicy()


@pytest.mark.parametrize(("flag", "value"), [("--remote-ttft-share", "0"), ("--remote-ttft-share", "1.5"),
                                             ("--tpot-slack-share", "-0.2"), ("--split-ttft-share", "2")])
def test_a_share_outside_zero_to_one_is_refused_naming_the_flag(flag, value, capsys):
    assert main(["gateway", "--prefill", "h:1", "--decode", "h:2", flag, value]) == 2
    assert flag in capsys.readouterr().err
    with pytest.raises(ValueError, match=flag.removeprefix("--").replace("-", "_")):
        RoutingPolicy(**{flag.removeprefix("--").replace("-", "_"): float(value)})
