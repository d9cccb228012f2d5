"""cuFile (GPUDirect Storage) loaded at run time, against the real
nvidia-cufile wheels for CUDA 12 (libcufile 1.14) and CUDA 13 (1.20), which
`make deps` unpacks into .test-deps/ without installing them. On a machine
without a GPU the libraries load; their driver is never opened there."""
import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import fastpersist
from fastpersist import cufile
from fastpersist.options import from_environment

ROOT = pathlib.Path(__file__).resolve().parent.parent
CU12 = ROOT / ".test-deps" / "cufile-cu12"
CU13 = ROOT / ".test-deps" / "cufile-cu13"
CU12_LIB = CU12 / "nvidia" / "cufile" / "lib" / "libcufile.so.0"
CU13_LIB = CU13 / "nvidia" / "cu13" / "lib" / "libcufile.so.0"
NO_DRIVER = cufile.cuda_driver_library() is None


@pytest.fixture(autouse=True)
def wheels():
    if not (CU12_LIB.exists() and CU13_LIB.exists()):
        if os.environ.get("CI"):
            pytest.fail("make deps unpacks the nvidia-cufile wheels into .test-deps/; they are missing")
        pytest.skip("the nvidia-cufile wheels are not in .test-deps/ (make deps)")


@pytest.fixture
def fresh_decisions(monkeypatch):
    monkeypatch.setattr(cufile, "_decided", {})


def test_the_wheels_layouts_are_found_the_torch_cuda_major_first():
    roots = [str(CU12), str(CU13)]
    assert cufile.wheel_library_paths(roots, cuda_major=13) == [str(CU13_LIB), str(CU12_LIB)]
    assert cufile.wheel_library_paths(roots, cuda_major=12) == [str(CU12_LIB), str(CU13_LIB)]
    assert cufile.find_library(roots, 12, environ={}) == str(CU12_LIB)
    assert cufile.find_library(roots, 12, environ={"FASTPERSIST_CUFILE_LIBRARY": "/x/libcufile.so.0"}) == \
        "/x/libcufile.so.0"
    assert cufile.wheel_version(str(CU12_LIB)) == "1.14.1.1"
    assert cufile.wheel_version(str(CU13_LIB)) == "1.20.0.107"


@pytest.mark.parametrize("library, version", [(CU12_LIB, "1.14.0"), (CU13_LIB, "1.20.0")])
def test_probe_reports_the_library_and_never_opens_a_driver_without_libcuda(library, version):
    """libcufile 1.20 hangs in cuFileDriverOpen without libcuda.so.1: the probe
    must answer (well within its timeout) and say why it did not open it."""
    facts = cufile.probe(str(library), timeout=60)
    assert facts["library"] == str(library)
    assert facts["version"] == version  # cuFileGetVersion's own answer, not the wheel's name
    assert "error" not in facts, facts
    if NO_DRIVER:
        assert facts["driver"] == "not opened: no NVIDIA driver (libcuda.so.1 not found)"
        assert cufile.why_not_gds(facts, cuda_available=True) == facts["driver"]
    else:  # a GPU machine: whatever the driver said, named
        assert facts["driver"] == "opened" or facts["driver"].startswith("cuFileDriverOpen failed: ")


def test_probe_that_does_not_answer_in_time_is_reported():
    facts = cufile.probe(str(CU12_LIB), timeout=0.001)
    assert facts["library"] == str(CU12_LIB)
    assert "did not answer within 0.001 s" in facts["error"]


def test_a_file_that_is_not_the_library_is_named(tmp_path):
    fake = tmp_path / "libcufile.so.0"
    fake.write_bytes(b"not an ELF file")
    facts = cufile.probe(str(fake))
    assert facts["error"].startswith(f"libcufile at {fake} does not load")
    assert cufile.why_not_gds(facts, cuda_available=True) == facts["error"]


def test_what_is_missing_for_gds_is_named_first():
    assert cufile.why_not_gds({"library": "x", "driver": "opened"}, cuda_available=False) == "no usable CUDA device"
    assert "libcufile not found" in cufile.why_not_gds({"library": None}, cuda_available=True)
    compat = cufile.why_not_gds({"library": "x", "driver": "opened", "nvidia_fs_loaded": None}, True)
    assert "compatibility mode" in compat and "only where the allow_gds_compat option says so" in compat
    # asked for, compatibility mode is taken, and said to be what it is
    compat_facts = {"library": "x", "driver": "opened", "nvidia_fs_loaded": None}
    assert cufile.why_not_gds(compat_facts, True, allow_compat=True) is None
    assert cufile.gds_mode(compat_facts).startswith("compatibility mode (no nvidia-fs")
    native = {"library": "x", "driver": "opened", "nvidia_fs_loaded": "2.26", "nvfs_version": "2.26"}
    assert cufile.why_not_gds(native, True) is None
    assert cufile.gds_mode(native) == "native GDS (nvidia-fs 2.26)"
    # allow_compat never stands in for a missing driver
    assert cufile.why_not_gds({"library": "x", "driver": "cuFileDriverOpen failed: X"}, True, True) == \
        "cuFileDriverOpen failed: X"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is usable here: tests/test_gpu.py covers it")
def test_gds_asked_for_without_cuda_is_refused_and_auto_says_why_once(fresh_decisions, caplog):
    with pytest.raises(cufile.GdsUnavailable, match="transfer='gds'.*no usable CUDA device"):
        cufile.transfer_for("gds")
    with pytest.raises(cufile.GdsUnavailable, match="no usable CUDA device"):
        cufile.transfer_for("gds", allow_compat=True)
    with pytest.raises(cufile.GdsUnavailable, match="cuFile's driver is not open"):
        cufile.driver()
    caplog.set_level(logging.INFO, logger="fastpersist")
    assert cufile.transfer_for("auto") == "bounce"
    assert cufile.transfer_for("auto") == "bounce"
    said = [r.getMessage() for r in caplog.records if "transfer=auto" in r.getMessage()]
    assert said == ["fastpersist: transfer=auto moves GPU tensors through the engine's pinned buffers, not "
                    "GPUDirect Storage: no usable CUDA device"]
    assert cufile.transfer_for("bounce") == "bounce"


def test_a_bad_transfer_is_named(monkeypatch):
    with pytest.raises(ValueError, match=r"fastpersist option transfer='direct': expected one of \('auto', 'bounce', "
                                         r"'gds'\)"):
        from_environment({"FASTPERSIST_TRANSFER": "direct"})
    assert from_environment({"FASTPERSIST_TRANSFER": "bounce"}).transfer == "bounce"
    with pytest.raises(ValueError, match="transfer='GDS'"):
        fastpersist.save({"a": torch.ones(2)}, "/nonexistent/x.pt", transfer="GDS")


def test_cpu_saves_and_loads_map_no_cuda_library(tmp_path):
    """Even with transfer='gds' asked for and a libcufile named: CPU tensors
    never meet CUDA, so nothing of it is loaded and CUDA is not started. (A
    CUDA build of torch maps libcudart and its own libcufile when imported:
    those are torch's, and fastpersist must add none.)"""
    script = f"""
import torch
def cuda_libraries():
    return sorted({{line.split()[-1] for line in open("/proc/self/maps")
                    if any(n in line for n in ("libcufile", "libcuda", "libcudart"))}})
torchs = cuda_libraries()
import fastpersist
state = {{"w": torch.randn(1000), "step": 3}}
fastpersist.save(state, {str(tmp_path / 'c.pt')!r}, transfer="gds")
back = fastpersist.load({str(tmp_path / 'c.pt')!r})
fastpersist.load_into(state, {str(tmp_path / 'c.pt')!r}, transfer="gds")
assert torch.equal(back["w"], state["w"])
assert not torch.cuda.is_initialized()
import json
print(json.dumps({{"torch": torchs if torch.version.cuda else [], "after": cuda_libraries()}}))
"""
    env = dict(os.environ, FASTPERSIST_CUFILE_LIBRARY=str(CU13_LIB), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    mapped = json.loads(out.stdout.strip().splitlines()[-1])
    assert mapped["after"] == mapped["torch"]


def test_info_reports_cufile(tmp_path):
    env = dict(os.environ, FASTPERSIST_CUFILE_LIBRARY=str(CU13_LIB))
    out = subprocess.run([sys.executable, "-m", "fastpersist", "info", "--json", "--folder", str(tmp_path)], env=env,
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert info["cufile"]["library"] == str(CU13_LIB)
    assert info["cufile"]["version"] == "1.20.0"
    assert info["transfer"]["option"] == "auto" and info["transfer"]["gpu_tensors_take"] == "bounce"
    text = subprocess.run([sys.executable, "-m", "fastpersist", "info", "--folder", str(tmp_path)], env=env,
                          capture_output=True, text=True, check=True).stdout
    assert "cuFile:" in text and f"{CU13_LIB} (version 1.20.0)" in text
    assert "GPU tensors move:" in text
    if NO_DRIVER:
        assert "not opened: no NVIDIA driver (libcuda.so.1 not found)" in text


def test_info_says_what_each_transfer_option_makes_of_gpu_tensors():
    from fastpersist.cli import _transfer_choice

    compat = {"library": "x", "driver": "opened", "nvidia_fs_loaded": None}
    native = {"library": "x", "driver": "opened", "nvidia_fs_loaded": "2.26", "nvfs_version": "2.26"}
    assert _transfer_choice({"transfer": "bounce"}, native, True)["gpu_tensors_take"] == "bounce"
    assert _transfer_choice({"transfer": "auto"}, native, True) == {
        "option": "auto", "gpu_tensors_take": "gds", "why": "native GDS (nvidia-fs 2.26)"}
    # auto never takes compatibility mode, even where allowed for gds
    auto = _transfer_choice({"transfer": "auto", "allow_gds_compat": True}, compat, True)
    assert auto["gpu_tensors_take"] == "bounce" and "compatibility mode" in auto["why"]
    refused = _transfer_choice({"transfer": "gds"}, compat, True)
    assert refused["gpu_tensors_take"].startswith("refused") and "allow_gds_compat" in refused["why"]
    allowed = _transfer_choice({"transfer": "gds", "allow_gds_compat": True}, compat, True)
    assert allowed["gpu_tensors_take"] == "gds" and allowed["why"].startswith("compatibility mode")
    assert _transfer_choice({"transfer": "gds", "allow_gds_compat": True}, native, False)["why"] == \
        "no usable CUDA device"


@pytest.mark.skipif(not NO_DRIVER, reason="an NVIDIA driver is here: tests/test_gpu.py runs the data path")
def test_the_data_path_calls_reach_the_real_library_and_fail_cleanly(tmp_path):
    """cuFileHandleRegister and cuFileRead through the shim's declarations,
    against libcufile 1.14 (CUDA 12's wheel, which fails cleanly where
    libcuda.so.1 is missing; 1.20 would hang): each refusal comes back as a
    GdsError naming cuFile's reason, never a crash. In a child process: a
    library that misbehaves cannot take the test run down."""
    script = f"""
import os
from fastpersist import cufile
lib = cufile.CuFile({str(CU12_LIB)!r})
fd = os.open({str(tmp_path / 'f.bin')!r}, os.O_RDWR | os.O_CREAT, 0o644)
for name, call in (("register", lambda: lib.register(fd, "f.bin")),
                   ("read", lambda: lib.transfer(lib.ffi.NULL, False, 0, 4096, 0, "f.bin"))):
    try:
        call()
        print(name, "succeeded")
    except cufile.GdsError as exc:
        print(name, "refused:", exc.reason)
"""
    (tmp_path / "cwd").mkdir()
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CUFILE_LOGFILE_PATH"}
    env["TMPDIR"] = str(tmp_path / "tmp")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                         cwd=tmp_path / "cwd", env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("register", "read"))]
    assert lines[0].startswith("register refused: cuFileHandleRegister refused the file: CU_FILE_"), out.stdout
    assert lines[1].startswith("read refused: cuFileRead failed: "), out.stdout
    # cuFile's own log (its ERROR lines) lands in the temporary folder, never in the user's current one
    assert list((tmp_path / "cwd").iterdir()) == []
    assert "ERROR" in (tmp_path / "tmp" / f"fastpersist-cufile-{os.getuid()}.log").read_text()


class _Loaded(Exception):
    pass


@pytest.fixture
def cuda_said_usable(monkeypatch, fresh_decisions):
    """This process as a CUDA torch sees itself (is_available True); CuFile
    counts its loads, and raises _Loaded unless the test says otherwise."""
    loads = []

    def load(path):
        loads.append(path)
        raise _Loaded(path)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cufile, "CuFile", lambda path: load(path))
    monkeypatch.setattr(cufile, "_driver", None)
    monkeypatch.setenv("FASTPERSIST_CUFILE_LIBRARY", str(CU13_LIB))
    return loads


def test_auto_without_nvidia_fs_loads_nothing_of_cufile(cuda_said_usable, monkeypatch, caplog):
    monkeypatch.setattr(cufile, "nvidia_fs_version", lambda: None)
    caplog.set_level(logging.INFO, logger="fastpersist")
    assert cufile.transfer_for("auto") == "bounce"
    assert cufile.transfer_for("auto") == "bounce"
    with pytest.raises(cufile.GdsUnavailable, match="nvidia-fs is not loaded.*allow_gds_compat"):
        cufile.transfer_for("gds")
    assert cuda_said_usable == []  # no dlopen, no driver open
    said = [r.getMessage() for r in caplog.records if "transfer=auto" in r.getMessage()]
    assert len(said) == 1 and "nvidia-fs is not loaded" in said[0] and "cuFile was not loaded" in said[0]


def test_any_failure_to_probe_cufile_means_the_buffers_decided_once(cuda_said_usable, monkeypatch, caplog):
    """cffi without its parser (the GPU machines' case), or anything else
    cuFile's loading raises: auto takes the buffers, says why once and does
    not probe again; gds is refused naming it."""
    monkeypatch.setattr(cufile, "nvidia_fs_version", lambda: "2.26")
    caplog.set_level(logging.INFO, logger="fastpersist")
    for _ in range(3):
        assert cufile.transfer_for("auto") == "bounce"
    assert cuda_said_usable == [str(CU13_LIB)]
    said = [r.getMessage() for r in caplog.records if "transfer=auto" in r.getMessage()]
    assert len(said) == 1 and "cuFile could not be probed: _Loaded" in said[0]
    with pytest.raises(cufile.GdsUnavailable, match="cuFile could not be probed: _Loaded"):
        cufile.transfer_for("gds", allow_compat=True)
    monkeypatch.setattr(cufile, "CuFile", lambda path: (_ for _ in ()).throw(ModuleNotFoundError("pycparser")))
    monkeypatch.setattr(cufile, "_decided", {})
    assert cufile.transfer_for("auto") == "bounce"
    assert "ModuleNotFoundError: pycparser" in cufile._decided[("auto", False)][1]
