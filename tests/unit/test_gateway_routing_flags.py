"""The gateway's routing flag, as the CLI translates and checks it."""

from __future__ import annotations

import pytest

from services.cli import main
from services.gateway.registry import WorkerRegistry


@pytest.mark.parametrize("share", ["0", "1.5", "-0.2"])
def test_a_remote_ttft_share_outside_zero_to_one_is_refused_naming_the_flag(share, capsys):
    assert main(["gateway", "--prefill", "h:1", "--decode", "h:2", "--remote-ttft-share", share]) == 2
    assert "--remote-ttft-share" in capsys.readouterr().err
    with pytest.raises(ValueError, match="remote_ttft_share"):
        WorkerRegistry(prefill=["h:1"], decode=["h:2"], remote_ttft_share=float(share))
