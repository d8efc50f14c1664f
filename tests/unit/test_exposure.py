"""`serve` refuses to expose an unauthenticated API beyond this machine."""

from __future__ import annotations

import pytest

from thunderpool.cli import main
from thunderpool.cli.serve import check_exposure
from thunderpool.errors import ThunderpoolError


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_needs_no_key(host):
    check_exposure(host, None, False)


def test_a_public_host_needs_a_key_or_insecure():
    with pytest.raises(ThunderpoolError, match="--api-key KEY or set \\$THUNDERPOOL_API_KEY"):
        check_exposure("0.0.0.0", None, False)
    check_exposure("0.0.0.0", "secret", False)
    check_exposure("0.0.0.0", None, True)


def test_a_host_that_is_not_an_address_is_named():
    with pytest.raises(ThunderpoolError, match="--host myhost is not an IP address"):
        check_exposure("myhost", None, False)


def test_serve_exits_2_before_loading_anything(capsys, monkeypatch):
    monkeypatch.delenv("THUNDERPOOL_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    assert "exposes the API beyond this machine" in capsys.readouterr().err
