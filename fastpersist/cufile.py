"""NVIDIA cuFile (GPUDirect Storage), loaded at run time: never a build- or
install-time dependency. The ``fastpersist[gds]`` extra brings the
``nvidia-cufile`` wheel; a system CUDA install or FASTPERSIST_CUFILE_LIBRARY
(a path to libcufile.so.0) works too.

This module finds the library, loads it through a small cffi ABI-mode shim
(no compiler, no header), and says what GDS could do here: the library's
path and version, whether its driver opens, whether nvidia-fs is loaded
(without it cuFile only runs in compatibility mode, POSIX I/O through its
own bounce buffers), and so which transfer ``transfer="auto"`` takes and
why. Nothing of cuFile is loaded in a process that has no usable CUDA
device, and cuFile's driver is opened only once CUDA is usable: libcufile
1.20 (CUDA 13) hangs in cuFileDriverOpen on a machine without
libcuda.so.1. ``fastpersist info`` asks a child process that runs this file alone, with
a timeout, so that a hang cannot take it down.

The data path (each record's 4 KiB-aligned middle moved by cuFileRead and
cuFileWrite, its edges through the engine) is fastpersist.gds; this module
gives it the opened driver (``driver()``) and a registered file handle
(``CuFile.register``). ``transfer="gds"`` takes it where the driver opens
with nvidia-fs loaded, or in compatibility mode where the
``allow_gds_compat`` option says so (reported as such); elsewhere it is
refused with the reason, and ``auto`` takes the bounce buffers, saying why
once in the log.
"""
from __future__ import annotations

import atexit
import ctypes.util
import glob
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from typing import Optional

log = logging.getLogger("fastpersist")

# The declarations this shim needs, as cufile.h (1.14 and 1.20) has them;
# enums are ints. Symbols a library lacks fail only when used.
_CDEF = """
typedef struct { int err; int cu_err; } CUfileError_t;
typedef struct {
    struct {
        unsigned int major_version;
        unsigned int minor_version;
        size_t poll_thresh_size;
        size_t max_direct_io_size;
        unsigned int dstatusflags;
        unsigned int dcontrolflags;
    } nvfs;
    unsigned int fflags;
    unsigned int max_device_cache_size;
    unsigned int per_buffer_cache_size;
    unsigned int max_device_pinned_mem_size;
    unsigned int max_batch_io_size;
    unsigned int max_batch_io_timeout_msecs;
} CUfileDrvProps_t;
CUfileError_t cuFileDriverOpen(void);
CUfileError_t cuFileDriverClose(void);
CUfileError_t cuFileDriverClose_v2(void);
CUfileError_t cuFileDriverGetProperties(CUfileDrvProps_t *props);
CUfileError_t cuFileGetVersion(int *version);
typedef void *CUfileHandle_t;
typedef struct {
    int type;
    union { int fd; void *handle; } handle;
    const void *fs_ops;
} CUfileDescr_t;
CUfileError_t cuFileHandleRegister(CUfileHandle_t *fh, CUfileDescr_t *descr);
void cuFileHandleDeregister(CUfileHandle_t fh);
ssize_t cuFileRead(CUfileHandle_t fh, void *bufPtr_base, size_t size, long file_offset, long bufPtr_offset);
ssize_t cuFileWrite(CUfileHandle_t fh, const void *bufPtr_base, size_t size, long file_offset, long bufPtr_offset);
"""
_HANDLE_TYPE_OPAQUE_FD = 1

# cufile.h's CUfileOpError names (CUFILEOP_BASE_ERR 5000 + n), so that a failure on a machine
# borrowed for minutes names itself; a few carry what they mean here
_ERRORS = {
    0: "CU_FILE_SUCCESS",
    5001: "CU_FILE_DRIVER_NOT_INITIALIZED (nvidia-fs is not loaded and compatibility mode is not allowed)",
    5002: "CU_FILE_DRIVER_INVALID_PROPS",
    5003: "CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
    5004: "CU_FILE_DRIVER_VERSION_MISMATCH",
    5005: "CU_FILE_DRIVER_VERSION_READ_ERROR",
    5006: "CU_FILE_DRIVER_CLOSING",
    5007: "CU_FILE_PLATFORM_NOT_SUPPORTED",
    5008: "CU_FILE_IO_NOT_SUPPORTED (GDS does not support this file or its filesystem)",
    5009: "CU_FILE_DEVICE_NOT_SUPPORTED",
    5010: "CU_FILE_NVFS_DRIVER_ERROR",
    5011: "CU_FILE_CUDA_DRIVER_ERROR",
    5012: "CU_FILE_CUDA_POINTER_INVALID",
    5013: "CU_FILE_CUDA_MEMORY_TYPE_INVALID (the memory is not plain device memory cuFile accepts)",
    5014: "CU_FILE_CUDA_POINTER_RANGE_ERROR",
    5015: "CU_FILE_CUDA_CONTEXT_MISMATCH",
    5016: "CU_FILE_INVALID_MAPPING_SIZE",
    5017: "CU_FILE_INVALID_MAPPING_RANGE",
    5018: "CU_FILE_INVALID_FILE_TYPE",
    5019: "CU_FILE_INVALID_FILE_OPEN_FLAG",
    5020: "CU_FILE_DIO_NOT_SET (the file was not opened with O_DIRECT)",
    5022: "CU_FILE_INVALID_VALUE",
    5023: "CU_FILE_MEMORY_ALREADY_REGISTERED",
    5024: "CU_FILE_MEMORY_NOT_REGISTERED",
    5025: "CU_FILE_PERMISSION_DENIED",
    5026: "CU_FILE_DRIVER_ALREADY_OPEN",
    5027: "CU_FILE_HANDLE_NOT_REGISTERED",
    5028: "CU_FILE_HANDLE_ALREADY_REGISTERED",
    5029: "CU_FILE_DEVICE_NOT_FOUND",
    5030: "CU_FILE_INTERNAL_ERROR",
    5031: "CU_FILE_GETNEWFD_FAILED",
    5033: "CU_FILE_NVFS_SETUP_ERROR",
    5034: "CU_FILE_IO_DISABLED",
    5035: "CU_FILE_BATCH_SUBMIT_FAILED",
    5036: "CU_FILE_GPU_MEMORY_PINNING_FAILED",
    5037: "CU_FILE_BATCH_FULL",
    5038: "CU_FILE_ASYNC_NOT_SUPPORTED",
    5039: "CU_FILE_INTERNAL_BATCH_SETUP_ERROR",
    5040: "CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR",
    5041: "CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR",
    5042: "CU_FILE_INTERNAL_BATCH_CANCEL_ERROR",
    5043: "CU_FILE_NOMEM_ERROR",
    5044: "CU_FILE_IO_ERROR",
    5045: "CU_FILE_INTERNAL_BUF_REGISTER_ERROR",
    5046: "CU_FILE_HASH_OPR_ERROR",
    5047: "CU_FILE_INVALID_CONTEXT_ERROR",
    5048: "CU_FILE_NVFS_INTERNAL_DRIVER_ERROR",
    5049: "CU_FILE_BATCH_NOCOMPAT_ERROR",
    5050: "CU_FILE_IO_MAX_ERROR",
}

NVIDIA_FS_VERSION = "/proc/driver/nvidia-fs/version"
PROBE_TIMEOUT_S = 20.0


class GdsUnavailable(RuntimeError):
    """transfer="gds" was asked for and cannot be given; the message says why."""


class GdsError(OSError):
    """cuFile refused a file or failed an I/O: the data path falls back to
    the engine's buffers for it (fastpersist.gds). ``reason``: what failed,
    without the path or offset (fallbacks are counted and logged by it)."""

    def __init__(self, message: str, reason: Optional[str] = None):
        super().__init__(message)
        self.reason = reason or message


def error_text(code: int) -> str:
    return _ERRORS.get(code, f"cuFile error {code}")


# ---------------------------------------------------------------------------
# finding the library

def wheel_library_paths(roots=None, cuda_major: Optional[int] = None) -> list:
    """libcufile.so.0 where the nvidia-cufile wheels put it under each root
    (sys.path by default): CUDA 13's ``nvidia/cu13/lib``, CUDA 12's
    ``nvidia/cufile/lib``; the layout of cuda_major first."""
    layouts = {13: os.path.join("nvidia", "cu13", "lib"), 12: os.path.join("nvidia", "cufile", "lib")}
    order = sorted(layouts, key=lambda major: (major != cuda_major, -major))
    found = []
    for major in order:
        for root in (sys.path if roots is None else roots):
            path = os.path.join(root or ".", layouts[major], "libcufile.so.0")
            if os.path.isfile(path) and path not in found:
                found.append(os.path.abspath(path))
    return found


def _system_library_paths() -> list:
    paths = []
    for folder in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib",
                   "/usr/local/cuda/targets/sbsa-linux/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"):
        path = os.path.join(folder, "libcufile.so.0")
        if os.path.isfile(path):
            paths.append(path)
    name = ctypes.util.find_library("cufile")  # the dynamic linker's cache
    if name and name not in paths:
        paths.append(name)
    return paths


def find_library(roots=None, cuda_major: Optional[int] = None, environ=os.environ) -> Optional[str]:
    """The libcufile to load, without loading it: FASTPERSIST_CUFILE_LIBRARY,
    else an nvidia-cufile wheel's, else the system's; None where there is none."""
    explicit = environ.get("FASTPERSIST_CUFILE_LIBRARY")
    if explicit:
        return explicit
    found = wheel_library_paths(roots, cuda_major) + _system_library_paths()
    return found[0] if found else None


def wheel_version(path: str) -> Optional[str]:
    """The version of the nvidia-cufile wheel that installed path, if one did."""
    site = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(path)))))
    for info in sorted(glob.glob(os.path.join(site, "nvidia_cufile*.dist-info"))):
        try:
            with open(os.path.join(info, "RECORD")) as record:
                rel = os.path.relpath(os.path.abspath(path), site)
                if any(line.split(",", 1)[0] == rel for line in record):
                    return os.path.basename(info)[:-len(".dist-info")].split("-", 1)[1]
        except OSError:
            continue
    return None


# ---------------------------------------------------------------------------
# loading it

def log_file() -> str:
    """Where cuFile writes its own log: CUFILE_LOGFILE_PATH where the user
    set it, else one file per user in the temporary folder. Left to itself,
    cuFile writes cufile.log into the current folder, the user's."""
    return os.environ.get("CUFILE_LOGFILE_PATH") or os.path.join(
        tempfile.gettempdir(), f"fastpersist-cufile-{os.getuid()}.log")


class CuFile:
    """A loaded libcufile (cffi ABI mode: dlopen, no compiler)."""

    def __init__(self, path: str):
        import cffi

        os.environ["CUFILE_LOGFILE_PATH"] = log_file()  # read by the library, before it opens its log

        self.path = path
        self.ffi = cffi.FFI()
        self.ffi.cdef(_CDEF)
        try:
            self.lib = self.ffi.dlopen(path)
        except OSError as exc:
            raise GdsUnavailable(f"libcufile at {path} does not load: {exc}") from None
        self.driver_open = False

    def version(self) -> Optional[str]:
        """The library's version ("1.20.0"), from cuFileGetVersion (libcufile
        1.15 and later) or the wheel that installed it."""
        try:
            get = self.lib.cuFileGetVersion
        except AttributeError:
            return wheel_version(self.path)
        out = self.ffi.new("int *")
        if get(out).err != 0:
            return wheel_version(self.path)
        v = out[0]  # 1000 * major + 10 * minor
        return f"{v // 1000}.{v % 1000 // 10}.{v % 10}"

    def open_driver(self) -> None:
        """cuFileDriverOpen; GdsUnavailable with cuFile's reason where it
        fails. Only once CUDA is usable (see the module's docstring)."""
        status = self.lib.cuFileDriverOpen()
        if status.err != 0:
            cuda = f", CUDA driver error {status.cu_err}" if status.cu_err else ""
            raise GdsUnavailable(f"cuFileDriverOpen failed: {error_text(status.err)}{cuda}")
        self.driver_open = True

    def close_driver(self) -> None:
        if self.driver_open:
            self.driver_open = False
            try:
                close = self.lib.cuFileDriverClose_v2
            except AttributeError:
                close = self.lib.cuFileDriverClose
            close()

    # -- the data path (driver open) -------------------------------------
    def register(self, fd: int, path: str):
        """cuFileHandleRegister of an open file descriptor; GdsError with
        cuFile's reason where it refuses the file (its filesystem, or an fd
        without O_DIRECT where nvidia-fs needs one)."""
        handle = self.ffi.new("CUfileHandle_t *")
        descr = self.ffi.new("CUfileDescr_t *")
        descr.type = _HANDLE_TYPE_OPAQUE_FD
        descr.handle.fd = fd
        status = self.lib.cuFileHandleRegister(handle, descr)
        if status.err != 0:
            what = error_text(status.err) + (f", CUDA driver error {status.cu_err}" if status.cu_err else "")
            raise GdsError(f"cuFileHandleRegister refused {path}: {what}",
                           reason=f"cuFileHandleRegister refused the file: {what}")
        return handle[0]

    def deregister(self, handle) -> None:
        self.lib.cuFileHandleDeregister(handle)

    def transfer(self, handle, write: bool, address: int, nbytes: int, offset: int, path: str) -> None:
        """Moves nbytes between device memory at address and the file at
        offset (cuFileWrite or cuFileRead, again until all have moved);
        GdsError where cuFile fails, EOFError where a read meets the end."""
        call = self.lib.cuFileWrite if write else self.lib.cuFileRead
        base = self.ffi.cast("void *", address)
        done = 0
        while done < nbytes:
            n = call(handle, base, nbytes - done, offset + done, done)
            name = "cuFileWrite" if write else "cuFileRead"
            if n < 0:
                # -1: errno says; -CUfileOpError: cuFile says; other small ones: an errno, negated
                what = (os.strerror(self.ffi.errno) if n == -1 else error_text(-n) if -n >= 5000
                        else os.strerror(-n))
                raise GdsError(f"{name} of {nbytes - done} bytes at offset {offset + done} of {path} failed: {what}",
                               reason=f"{name} failed: {what}")
            if n == 0:
                if write:
                    raise GdsError(f"cuFileWrite wrote nothing at offset {offset + done} of {path}",
                                   reason="cuFileWrite wrote nothing")
                raise EOFError(path)
            done += n

    def nvfs_version(self) -> Optional[str]:
        """nvidia-fs's version as the open driver reports it; None where it
        reports none (compatibility mode)."""
        props = self.ffi.new("CUfileDrvProps_t *")
        if self.lib.cuFileDriverGetProperties(props).err != 0:
            return None
        major, minor = props.nvfs.major_version, props.nvfs.minor_version
        return f"{major}.{minor}" if (major or minor) else None


def nvidia_fs_version() -> Optional[str]:
    """The loaded nvidia-fs kernel module's version, or None."""
    try:
        with open(NVIDIA_FS_VERSION) as f:
            return f.read().strip().splitlines()[0].split(":")[-1].strip() or "unknown"
    except (OSError, IndexError):
        return None


def cuda_driver_library() -> Optional[str]:
    """libcuda.so.1 as the dynamic linker finds it, or None (no NVIDIA driver)."""
    return ctypes.util.find_library("cuda")


# ---------------------------------------------------------------------------
# what GDS can do here, asked in a child process (info) ...

def probe(library: Optional[str] = None, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """What `fastpersist info` shows about cuFile, gathered by a child
    process with a timeout (a driver open that hangs cannot hang info)."""
    library = library or find_library(cuda_major=_torch_cuda_major())
    if library is None:
        return {"library": None, "reason": "libcufile not found (pip install fastpersist[gds], or set "
                                           "FASTPERSIST_CUFILE_LIBRARY)"}
    try:
        # this file alone, not the package: the child imports neither torch nor fastpersist
        out = subprocess.run([sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')",
                              os.path.abspath(__file__), library], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"library": library, "error": f"the probe did not answer within {timeout:g} s (cuFileDriverOpen "
                                             "hung?)"}
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"library": library, "error": f"the probe failed (exit {out.returncode}): "
                                             f"{(out.stderr.strip().splitlines() or ['no output'])[-1]}"}


def _probe_here(library: str) -> dict:
    """The child's side of probe(): loads the library, opens its driver where
    CUDA is usable, reports."""
    facts: dict = {"library": library, "version": None, "driver": None, "nvfs_version": None,
                   "nvidia_fs_loaded": nvidia_fs_version()}
    try:
        cufile = CuFile(library)
    except GdsUnavailable as exc:
        facts["error"] = str(exc)
        return facts
    facts["version"] = cufile.version()
    if cuda_driver_library() is None:
        facts["driver"] = "not opened: no NVIDIA driver (libcuda.so.1 not found)"
        return facts
    try:
        cufile.open_driver()
    except GdsUnavailable as exc:
        facts["driver"] = str(exc)
        return facts
    facts["driver"] = "opened"
    facts["nvfs_version"] = cufile.nvfs_version()
    cufile.close_driver()
    return facts


def why_not_gds(facts: dict, cuda_available: bool, allow_compat: bool = False) -> Optional[str]:
    """Why GDS is not used here, the first missing piece named; None where
    it is (natively, or in compatibility mode where allow_compat)."""
    if not cuda_available:
        return "no usable CUDA device"
    if not facts.get("library"):
        return facts.get("reason") or "libcufile not found"
    if facts.get("error"):
        return facts["error"]
    if facts.get("driver") != "opened":
        return facts.get("driver") or "cuFile's driver was not opened"
    if (not facts.get("nvidia_fs_loaded") or not facts.get("nvfs_version")) and not allow_compat:
        return ("nvidia-fs is not loaded: cuFile would run in compatibility mode (POSIX I/O through its own "
                "bounce buffers), which fastpersist takes only where the allow_gds_compat option says so")
    return None


def gds_mode(facts: dict) -> str:
    """How cuFile moves bytes once its driver is open."""
    if facts.get("nvidia_fs_loaded") and facts.get("nvfs_version"):
        return f"native GDS (nvidia-fs {facts['nvfs_version']})"
    return "compatibility mode (no nvidia-fs: POSIX I/O through cuFile's own bounce buffers)"


# ---------------------------------------------------------------------------
# ... and in this process, the first time a CUDA storage is met

_decided: dict = {}  # (requested transfer, allow_compat) -> (transfer, why)
_lock = threading.Lock()
_driver: Optional[CuFile] = None  # opened by the first decision that takes GDS, closed at exit
_driver_mode = ""


def transfer_for(requested: str, allow_compat: bool = False) -> str:
    """The transfer a save or load of CUDA storages takes for the
    ``transfer`` option: "bounce" (the engine's pinned buffers) or "gds"
    (then driver() is open). "gds" that cannot be had raises GdsUnavailable
    naming what is missing; "auto" says once in the log which it took and
    why. Called only once a CUDA storage is met."""
    if requested == "bounce":
        return "bounce"
    key = (requested, bool(allow_compat) and requested == "gds")  # auto never takes compatibility mode
    with _lock:
        if key not in _decided:
            _decided[key] = _decide(key[1])
            if requested == "auto":
                if _decided[key][0] == "gds":
                    log.info("fastpersist: transfer=auto moves GPU tensors with GPUDirect Storage: %s",
                             _decided[key][1])
                else:
                    log.info("fastpersist: transfer=auto moves GPU tensors through the engine's pinned buffers, "
                             "not GPUDirect Storage: %s", _decided[key][1])
            elif _decided[key][0] == "gds" and "compatibility" in _decided[key][1]:
                log.warning("fastpersist: transfer='gds' runs in cuFile's %s (allow_gds_compat)", _decided[key][1])
    transfer, why = _decided[key]
    if requested == "gds" and transfer != "gds":
        raise GdsUnavailable(f"fastpersist option transfer='gds': GPUDirect Storage cannot be used here: {why}; "
                             "transfer='auto' or 'bounce' moves GPU tensors through pinned host buffers")
    return transfer


def driver() -> CuFile:
    """The process's open cuFile driver, once transfer_for took GDS."""
    if _driver is None:
        raise GdsUnavailable("cuFile's driver is not open (transfer_for did not take GDS)")
    return _driver


def driver_mode() -> str:
    """How the open driver moves bytes (gds_mode), "" where none is open."""
    return _driver_mode


def _decide(allow_compat: bool) -> tuple:
    """(transfer, why) from this process. Whatever goes wrong while probing
    cuFile (a library that does not load, cffi without its parser, a driver
    that refuses) means the buffers, with the reason: it never fails a save."""
    try:
        return _decide_here(allow_compat)
    except Exception as exc:
        return ("bounce", f"cuFile could not be probed: {type(exc).__name__}: {exc}")


def _decide_here(allow_compat: bool) -> tuple:
    """torch has CUDA up already, so a driver open cannot meet the
    missing-libcuda hang; without nvidia-fs, and compatibility mode not
    allowed, nothing of cuFile is loaded at all (its driver open costs time
    and could hang a default save, for a mode that would be refused)."""
    global _driver, _driver_mode
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:
        cuda = False
    if not cuda:
        return ("bounce", "no usable CUDA device")
    if _driver is not None:  # opened by an earlier decision
        mode_ok = allow_compat or _driver_mode.startswith("native")
        return ("gds", _driver_mode) if mode_ok else ("bounce", why_not_gds({"library": _driver.path,
                                                                             "driver": "opened"}, True))
    facts: dict = {"nvidia_fs_loaded": nvidia_fs_version()}
    if facts["nvidia_fs_loaded"] is None and not allow_compat:
        return ("bounce", f"nvidia-fs is not loaded ({os.path.dirname(NVIDIA_FS_VERSION)} is absent): cuFile "
                          "could run only in compatibility mode, which takes the allow_gds_compat option; "
                          "cuFile was not loaded")
    library = find_library(cuda_major=_torch_cuda_major())
    if library is None:
        return ("bounce", "libcufile not found (pip install fastpersist[gds], or set FASTPERSIST_CUFILE_LIBRARY)")
    facts["library"] = library
    try:
        opened = CuFile(library)
        opened.open_driver()
    except GdsUnavailable as exc:
        return ("bounce", str(exc))
    facts["driver"] = "opened"
    facts["nvfs_version"] = opened.nvfs_version()
    why = why_not_gds(facts, True, allow_compat)
    if why is not None:
        opened.close_driver()
        return ("bounce", why)
    _driver, _driver_mode = opened, gds_mode(facts)
    atexit.register(opened.close_driver)
    return ("gds", _driver_mode)


def _torch_cuda_major() -> Optional[int]:
    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None)
    try:
        return int(str(version).split(".")[0]) if version else None
    except ValueError:
        return None


if __name__ == "__main__":  # the child process of probe()
    print(json.dumps(_probe_here(sys.argv[-1])))
