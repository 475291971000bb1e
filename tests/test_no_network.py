"""The suite's network guard: remote connections fail, loopback works."""

import socket

import pytest

from tests._helpers import NetworkAccessError


def test_a_remote_connection_fails():
    with socket.socket() as s, pytest.raises(NetworkAccessError, match="93.184.216.34"):
        s.connect(("93.184.216.34", 443))


def test_loopback_connections_are_allowed():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.socket() as client:
            client.connect(server.getsockname())
