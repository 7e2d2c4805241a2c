"""free_port(): a TCP port on 127.0.0.1 free now, for a child's process group
(MASTER_PORT).

The port comes from a block of its own for each pytest-xdist worker, below the kernel's
ephemeral range (32768-60999 by default): a port the kernel hands out for "any free port"
can be taken by another worker's connections between this check and the child's bind
(EADDRINUSE). Within a worker, each call moves on to the next port, so a child never
inherits a port that an earlier test's process group may still hold (after the block's
last port it starts again at its first)."""
import itertools
import os
import socket

_BLOCK = 400
_worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
_start = 20000 + _BLOCK * _worker
_next = itertools.cycle(range(_start, _start + _BLOCK))


def free_port() -> int:
    for _ in range(_BLOCK):
        port = next(_next)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in this worker's block of {_BLOCK} below 32768")
