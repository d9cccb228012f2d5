"""The wheel `make wheel` builds carries its engines: liburing and libaio
are inside the module (from their static archives), so it needs no Debian
package at run time; ISA-L is loaded at run time, never linked."""
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def static_archive(lib: str):
    cc = shutil.which("cc") or shutil.which("gcc")
    found = subprocess.run([cc, f"-print-file-name=lib{lib}.a"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) else None


@pytest.fixture(scope="module")
def wheel_module(tmp_path_factory):
    if not shutil.which("readelf"):
        pytest.skip("needs readelf (binutils)")
    if not static_archive("uring") or not static_archive("aio"):
        pytest.skip("needs liburing.a and libaio.a (liburing-dev, libaio-dev): `make deps` installs them")
    out = tmp_path_factory.mktemp("wheel")
    # from a copy of the source tree without its build outputs, so the module is compiled now
    source = out / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns("build", "dist", "*.so", "*.o", "*.egg-info",
                                                                 "__pycache__", ".git", ".fastpersist-bench-*"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(out / "dist"), str(source)], capture_output=True, text=True, timeout=600,
                           cwd=str(out))
    assert build.returncode == 0, build.stderr
    wheels = list((out / "dist").glob("fastpersist-*.whl"))
    assert len(wheels) == 1
    with zipfile.ZipFile(wheels[0]) as z:
        for module in ("fastpersist/integrations/lightning.py", "fastpersist/bench/small.py",
                       "fastpersist/save_api.py"):
            assert module in z.namelist(), module  # every package of the source tree is in the wheel
        names = [n for n in z.namelist() if "_engine_cffi" in n and n.endswith(".so")]
        assert len(names) == 1, z.namelist()
        z.extract(names[0], out / "unpacked")
    return out / "unpacked" / names[0]


def needed(path) -> list:
    dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]


def test_the_wheels_engine_needs_no_io_library_at_run_time(wheel_module):
    libraries = needed(wheel_module)
    assert not [lib for lib in libraries if lib.startswith(("liburing", "libaio", "libisal"))], libraries
    assert set(libraries) <= {"libz.so.1", "libc.so.6", "libpthread.so.0", "libdl.so.2"}, libraries
    exported = subprocess.run(["nm", "-D", "--defined-only", str(wheel_module)], capture_output=True,
                              text=True).stdout
    functions = [line.split()[-1].split("@")[0] for line in exported.splitlines() if " T " in line]
    assert functions == ["PyInit__engine_cffi"], functions  # liburing's and libaio's stay inside the module


def test_the_wheels_engine_has_io_uring_and_libaio_and_runs(wheel_module, tmp_path):
    """The module from the wheel, loaded on its own: io_uring and libaio
    compiled in, and each engine kind writes a file that reads back."""
    spec = importlib.util.spec_from_file_location("fastpersist._engine_cffi", wheel_module)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lib, ffi = module.lib, module.ffi
    assert [lib.fp_kind_compiled(k) for k in (0, 1, 2)] == [1, 1, 1]
    data = os.urandom(3 << 20)
    for kind in (0, 1, 2):
        config = ffi.new("struct fp_config *")
        config.kind, config.buffer_size, config.num_buffers = kind, 1 << 20, 2
        config.queue_depth, config.request_size = 8, 1 << 20
        engine = ffi.new("struct fp_engine **")
        rc = lib.fp_engine_create(config, engine)
        if rc == -1 * 38 or rc == -1 * 1:  # ENOSYS, EPERM: the kernel refuses io_uring here
            continue
        assert rc == 0, os.strerror(-rc)
        path = tmp_path / f"k{kind}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            assert lib.fp_stream_begin(engine[0], -1, fd, 0, 0) == 0
            assert lib.fp_stream_write(engine[0], ffi.from_buffer(data), len(data), ffi.NULL) == 0
            assert lib.fp_stream_end(engine[0]) == 0
        finally:
            os.close(fd)
            lib.fp_engine_destroy(engine[0])
        assert path.read_bytes() == data
