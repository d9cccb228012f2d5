"""A seccomp filter that makes io_uring_setup fail with EPERM in the calling
process only (and the threads and children it starts afterwards), for tests
that need a kernel refusing io_uring without touching the machine-wide
kernel.io_uring_disabled. Install it first thing in a child process: a
filter covers only the thread that installs it and threads started later."""
import ctypes
import errno
import platform

NR_IO_URING_SETUP = 425  # the same number on x86_64 and aarch64

# seccomp_data.arch for the native ABI: EM_* | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "arm64": 0xC00000B7}

_PR_SET_SECCOMP = 22
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_MODE_FILTER = 2
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_OFFSET_NR, _OFFSET_ARCH = 0, 4  # in struct seccomp_data


class Unavailable(Exception):
    """This machine or kernel cannot run the filter: a reason to skip, not a failure."""


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def native_arch():
    """seccomp_data.arch of this machine's native syscalls; raises Unavailable elsewhere."""
    machine = platform.machine()
    if machine not in AUDIT_ARCH:
        raise Unavailable(f"no seccomp arch constant for {machine!r} in this test helper")
    return AUDIT_ARCH[machine]


def _program(arch):
    # A syscall from another ABI (x86_64's int 0x80, say) numbers differently: let it through
    # rather than kill the process; nothing the tests run makes one.
    return [
        (_LD_W_ABS, 0, 0, _OFFSET_ARCH),
        (_JEQ_K, 1, 0, arch),
        (_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
        (_LD_W_ABS, 0, 0, _OFFSET_NR),
        (_JEQ_K, 0, 1, NR_IO_URING_SETUP),
        (_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.EPERM),
        (_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
    ]


def refuse_io_uring_setup():
    """Installs the filter on the calling thread; raises Unavailable where the kernel has no seccomp filters."""
    arch = native_arch()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl.restype = ctypes.c_int
    insns = _program(arch)
    table = (_SockFilter * len(insns))(*[_SockFilter(*insn) for insn in insns])
    prog = _SockFprog(len(insns), table)
    # Without CAP_SYS_ADMIN the kernel takes a filter only from a process that can gain no privileges.
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        err = ctypes.get_errno()
        raise Unavailable(f"prctl(PR_SET_NO_NEW_PRIVS) failed: {errno.errorcode.get(err, err)}")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        # EINVAL: a kernel built without CONFIG_SECCOMP_FILTER
        raise Unavailable(f"prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER) failed: {errno.errorcode.get(err, err)}")


def io_uring_setup_errno():
    """0 if a raw io_uring_setup(1, params) gives a ring (closed again), else its errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(ctypes.c_long(NR_IO_URING_SETUP), ctypes.c_long(1), params)
    if fd < 0:
        return ctypes.get_errno()
    libc.close(ctypes.c_int(fd))
    return 0

