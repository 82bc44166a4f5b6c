"""Ports for the servers and rendezvous that tests start on 127.0.0.1.

A port found free by binding to port 0 and closing the socket is free only until someone else binds
it, and the kernel hands out the same ephemeral ports to everyone: a torchrun `--standalone` run of
another xdist worker took such a port in the seconds before the test's own launcher bound it, and
the two jobs' ranks met in one store (CI hung for 300 s, then aborted). So the tests take their
ports below the kernel's ephemeral range, where no bind to port 0 lands, each xdist worker in a
band of its own, and not the same one again in one process until the band is used up.
"""
from __future__ import annotations

import itertools
import os
import random
import socket
from pathlib import Path

# below 29500, DeepSpeed's and torchrun's default port (and the single-process rendezvous's
# 29500 + pid % 1000 in dare_core.process.process_group)
FIRST, BAND = 20000, 1000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _band() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    start = FIRST + (index % 9) * BAND
    if start + BAND > _ephemeral_low():
        raise RuntimeError(f"ports {start}-{start + BAND} reach this kernel's ephemeral range "
                           f"(ip_local_port_range starts at {_ephemeral_low()})")
    return range(start, start + BAND)


# a random start within the band: two test sessions on one machine rarely begin on the same port
_offset = random.Random(os.getpid()).randrange(BAND)
_candidates = itertools.cycle([*_band()[_offset:], *_band()[:_offset]])


def unused_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now and that no bind to port 0 can be given."""
    for _ in range(BAND):
        port = next(_candidates)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no unused port in {_band()}")
