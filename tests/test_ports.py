"""The tests' ports stay out of the kernel's ephemeral range and do not repeat."""
import socket

from ports import _ephemeral_low, unused_port


def test_ports_are_below_the_ephemeral_range_and_distinct():
    ports = [unused_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert max(ports) < _ephemeral_low()
    for port in ports[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))

