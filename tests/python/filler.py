"""fill(directory, leave): a file filling `directory`'s filesystem up to `leave` free
bytes, for loads and saves that run out of space midway (remove it to free the space)."""
import os


def fill(directory: str, leave: int) -> str:
    """A file filling `directory`'s filesystem up to `leave` free bytes."""
    st = os.statvfs(directory)
    path = os.path.join(directory, "filler")
    with open(path, "wb") as f:
        left = st.f_bavail * st.f_frsize - leave
        chunk = b"\xa5" * (1 << 20)
        while left > 0:
            left -= f.write(chunk[:left])
    return path
