"""cffi build script for the I/O engine (out-of-line API mode).

Used by setup.py through ``cffi_modules``. liburing and libaio are linked
from their static archives (liburing.a, libaio.a, which Debian's -dev
packages ship) wherever those are found, so that the module, and a wheel
made from it, needs neither library at run time; from their shared
libraries where only those are found (the module then needs them installed
wherever it runs); and where neither is found that engine is left out, said
loudly at build time. ISA-L's CRC is not linked at all: the engine loads
libisal.so.2 at run time where it is installed, and uses zlib's otherwise.
"""
import os
import shutil
import subprocess
import sys
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def _cc() -> str:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or ""


def _links(snippet: str, link_args: list) -> bool:
    """True if a program using `snippet` compiles and links with link_args."""
    cc = _cc()
    if not cc:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(snippet)
        result = subprocess.run([cc, src, "-o", os.path.join(tmp, "probe"), *link_args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return result.returncode == 0


def _static_archive(lib: str):
    """The path of lib<lib>.a where the compiler finds one, else None."""
    cc = _cc()
    if not cc:
        return None
    found = subprocess.run([cc, f"-print-file-name=lib{lib}.a"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


OPTIONAL = [
    # (macro, library, source file, what is lost without it, probe program)
    ("FP_HAVE_LIBURING", "uring", "fp_backend_uring.c", "the io_uring engine (liburing-dev)",
     "#include <liburing.h>\nint main(void){struct io_uring r; return io_uring_queue_init(1,&r,0);}"),
    ("FP_HAVE_LIBAIO", "aio", "fp_backend_aio.c", "the libaio engine (libaio-dev)",
     "#include <libaio.h>\nint main(void){io_context_t c=0; return io_setup(1,&c);}"),
]

sources = ["fp_engine.c", "fp_backend_psync.c", "fp_pickle.c"]
macros = []
libraries = ["pthread", "dl", "z"]  # the copy-out helper thread; dlopen of ISA-L; zlib's CRC-32 without it
static_archives = []  # linked into the module whole: no run-time dependency
linkage = {}  # library -> "static", "shared" or "missing", for the build log
for macro, lib, source, what, probe in OPTIONAL:
    archive = _static_archive(lib)
    if archive and _links(probe, [archive]):
        static_archives.append(archive)
        linkage[lib] = "static"
    elif _links(probe, ["-l" + lib]):
        libraries.append(lib)
        linkage[lib] = "shared"
    else:
        linkage[lib] = "missing"
        print(f"fastpersist build: WARNING: lib{lib} was not found: this build has no {what[4:]}; fastpersist "
              "will fall back to slower engines. Install the -dev package and rebuild.", file=sys.stderr)
        continue
    macros.append((macro, "1"))
    sources.append(source)
    if linkage[lib] == "shared":
        print(f"fastpersist build: note: lib{lib} is linked as a shared library (no lib{lib}.a found): the "
              f"module needs lib{lib} installed wherever it runs", file=sys.stderr)

# FASTPERSIST_EXTRA_CFLAGS: extra flags for both compiling and linking, added
# after the usual ones (so an -O level there wins); `make sanitize` uses it for
# its ASan/UBSan build. Unset, the build is as before.
EXTRA_FLAGS = os.environ.get("FASTPERSIST_EXTRA_CFLAGS", "").split()

ffibuilder = FFI()
def _declarations() -> str:
    """fp_engine.h without its preprocessor lines: cffi parses the rest as is."""
    with open(os.path.join(HERE, "fp_engine.h")) as f:
        return "".join(line for line in f if not line.lstrip().startswith("#"))


ffibuilder.cdef(_declarations())
ffibuilder.set_source(
    "fastpersist._engine_cffi",
    '#include "fp_engine.h"',
    sources=[os.path.join("csrc", s) for s in sources],
    include_dirs=["csrc"],
    define_macros=macros,
    libraries=libraries,
    extra_objects=static_archives,
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"] + EXTRA_FLAGS,
    # the module exports its init function alone: the archives' symbols are
    # never exported to, or taken for, another library's liburing or libaio
    # (--exclude-libs trips over libaio's versioned symbols; a version script does not)
    extra_link_args=([f"-Wl,--version-script={os.path.join(HERE, 'engine_exports.map')}"] if static_archives
                     else []) + EXTRA_FLAGS,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
