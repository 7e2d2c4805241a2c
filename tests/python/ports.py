"""free_port(): a TCP port on 127.0.0.1 free now, for a child's process group
(MASTER_PORT). A child that inherits the port a test earlier in the same pytest process
put into os.environ meets that process's own store on it (EADDRINUSE)."""
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
