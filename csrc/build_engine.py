"""cffi build script for the I/O engine (out-of-line API mode).

Used by setup.py through ``cffi_modules``. Each optional backend is compiled
in only when its header and library are present, so the build succeeds on a
machine without liburing-dev or libaio-dev; that engine is then absent.
"""
import os
import shutil
import subprocess
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def _links(snippet: str, lib: str) -> bool:
    """True if a program using `snippet` compiles and links against `lib`."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(snippet)
        result = subprocess.run(
            [cc, src, "-o", os.path.join(tmp, "probe"), "-l" + lib],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return result.returncode == 0


OPTIONAL = [
    # (macro, library, source file or None, probe program)
    ("FP_HAVE_LIBURING", "uring", "fp_backend_uring.c",
     "#include <liburing.h>\nint main(void){struct io_uring r; return io_uring_queue_init(1,&r,0);}"),
    ("FP_HAVE_LIBAIO", "aio", "fp_backend_aio.c",
     "#include <libaio.h>\nint main(void){io_context_t c=0; return io_setup(1,&c);}"),
    ("FP_HAVE_ISAL", "isal", None,
     "#include <isa-l/crc.h>\nint main(void){return (int)crc32_gzip_refl(0,0,0);}"),
]

sources = ["fp_engine.c", "fp_backend_psync.c"]
macros = []
libraries = ["pthread"]  # the copy-out helper thread of fp_read_extents
for macro, lib, source, probe in OPTIONAL:
    if _links(probe, lib):
        macros.append((macro, "1"))
        libraries.append(lib)
        if source:
            sources.append(source)
if ("FP_HAVE_ISAL", "1") not in macros:
    libraries.append("z")  # CRC-32 from zlib instead

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
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"] + EXTRA_FLAGS,
    extra_link_args=EXTRA_FLAGS,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
