"""Runs a command with io_uring blocked, as a container's seccomp profile blocks it:

    python seccomp_block.py [--errno EPERM|ENOSYS] -- COMMAND ARGS...

A seccomp filter makes io_uring_setup fail with the errno (default EPERM, as Docker's
profile does); everything else is allowed. The filter stays on through exec, so COMMAND
runs under it. Exits 77 when this kernel or sandbox refuses to install seccomp filters.
"""
import ctypes
import errno
import os
import struct
import sys

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
NR_IO_URING_SETUP = 425  # the same on every Linux architecture
NR_OFFSET = 0            # offsetof(struct seccomp_data, nr)


def block_io_uring(err: int) -> bool:
    # struct sock_filter {u16 code; u8 jt; u8 jf; u32 k;}: load nr; if io_uring_setup,
    # return the errno, else allow.
    program = b"".join(struct.pack("=HBBI", *insn) for insn in (
        (BPF_LD_W_ABS, 0, 0, NR_OFFSET),
        (BPF_JEQ_K, 0, 1, NR_IO_URING_SETUP),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | err),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ))
    buf = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    return (libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            and libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0)


def main() -> None:
    args = sys.argv[1:]
    err = errno.EPERM
    if args[:1] == ["--errno"]:
        err = getattr(errno, args[1])
        args = args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not block_io_uring(err):
        sys.exit(77)
    os.execvp(args[0], args)


if __name__ == "__main__":
    main()
