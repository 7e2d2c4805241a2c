"""What shows a read wrote nothing to a store: store_files(pager), every file of its
directory with its bytes' digest and modification time, and writes(pager), the stats()
counters of its writes (to the store files and to the host tier); and
file_size_limit(nbytes), under which writes past nbytes fail (EFBIG, as on a full disk)."""
import contextlib
import hashlib
import os
import resource

WRITES = ("bytes_written", "write_requests", "bytes_to_host", "spills")


def store_files(pager):
    """Every file of the store directory: its bytes' digest and modification time."""
    out = {}
    for d, _, names in os.walk(pager.directory):
        for n in names:
            path = os.path.join(d, n)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            out[path] = (digest, os.stat(path).st_mtime_ns)
    return out


def writes(pager):
    s = pager.stats()
    return {k: s[k] for k in WRITES}


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """RLIMIT_FSIZE: writes past nbytes fail with EFBIG (NoSpaceError); the Pager ignores
    SIGXFSZ, so the process lives on."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
