"""fastpersist.save and the patched torch.save: round trips through vanilla
torch.load, fallbacks, options, and failures that must lose nothing."""
import errno
import inspect
import io
import os
import pickle
import stat
import subprocess
import sys
import warnings

import pytest
import torch

import fastpersist
from fastpersist.writer import FastFileWriter

from conftest import SMALL, leftovers, mounted, vanilla_load
from corpus import assert_same, corpus


def test_round_trip_corpus_through_vanilla_load(folder, engine):
    obj = corpus()
    fastpersist.save(obj, folder / "c.pt", engine=engine, **SMALL)
    loaded = vanilla_load(folder / "c.pt")
    assert_same(obj, loaded)
    shared = loaded["shared"]
    assert shared[0].untyped_storage().data_ptr() == shared[1].untyped_storage().data_ptr()
    assert shared[2].untyped_storage().data_ptr() == shared[0].untyped_storage().data_ptr()


def test_whole_module_round_trip(folder):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    fastpersist.save(model, folder / "m.pt")
    loaded = vanilla_load(folder / "m.pt")
    assert isinstance(loaded, torch.nn.Sequential)
    assert_same(model.state_dict(), loaded.state_dict())


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 200_000])
def test_payload_sizes_each_engine(folder, engine, nbytes):
    """Sizes around a page, and larger than the 64 KiB test buffers."""
    t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    fastpersist.save({"t": t}, folder / "p.pt", engine=engine, **SMALL)
    assert torch.equal(vanilla_load(folder / "p.pt")["t"], t)


def test_buffered_filesystem_refusing_o_direct(engine):
    with mounted("ramfs") as mnt:
        obj = {"t": torch.randn(50_000)}
        fastpersist.save(obj, os.path.join(mnt, "r.pt"), engine=engine, **SMALL)
        assert torch.equal(vanilla_load(os.path.join(mnt, "r.pt"))["t"], obj["t"])


def test_options_direct_off_and_no_fsync_no_atomic(folder):
    obj = {"t": torch.randn(1000)}
    fastpersist.save(obj, folder / "a.pt", direct=False, fsync=False, atomic=False)
    assert torch.equal(vanilla_load(folder / "a.pt")["t"], obj["t"])


def test_overwrite_keeps_permissions_and_follows_symlink(folder):
    target = folder / "real.pt"
    fastpersist.save({"v": 1}, target)
    os.chmod(target, 0o640)
    link = folder / "link.pt"
    os.symlink(target, link)
    fastpersist.save({"v": 2}, link)
    assert os.path.islink(link)
    assert vanilla_load(target) == {"v": 2}
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640


# ---- patching --------------------------------------------------------------


def test_patch_routes_torch_save_and_keeps_signature(folder, monkeypatch):
    original = torch.save
    calls = []
    save_module = sys.modules["fastpersist.save"]
    real_save_to_path = save_module.save_to_path

    def spy(obj, path, *args, **kwargs):
        calls.append(path)
        return real_save_to_path(obj, path, *args, **kwargs)

    monkeypatch.setattr(save_module, "save_to_path", spy)
    fastpersist.patch()
    assert fastpersist.is_patched()
    assert torch.save is torch.serialization.save
    assert inspect.signature(torch.save) == inspect.signature(original)
    assert torch.save.__doc__ == original.__doc__
    torch.save({"x": torch.ones(3)}, folder / "p.pt")
    assert calls == [str(folder / "p.pt")]
    fastpersist.patch()  # twice is harmless
    fastpersist.unpatch()
    fastpersist.unpatch()
    assert torch.save is original and torch.serialization.save is original
    assert not fastpersist.is_patched()


def test_patch_options_apply_and_bad_ones_are_refused(folder, monkeypatch):
    fastpersist.patch(engine="psync", buffer_size=1 << 20)
    assert fastpersist.patching.current_options().engine == "psync"
    with pytest.raises(ValueError, match="queue_depth"):
        fastpersist.patch(queue_depth=0)
    assert fastpersist.patching.current_options().engine == "psync"  # unchanged by the refused call
    with pytest.raises(TypeError, match="colour"):
        fastpersist.patch(colour="blue")


def test_environment_options(monkeypatch):
    monkeypatch.setenv("FASTPERSIST_BUFFER_SIZE", "8M")
    monkeypatch.setenv("FASTPERSIST_FSYNC", "off")
    monkeypatch.setenv("FASTPERSIST_ENGINE", "libaio")
    opts = fastpersist.patching.current_options()
    assert (opts.buffer_size, opts.fsync, opts.engine) == (8 << 20, False, "libaio")
    monkeypatch.setenv("FASTPERSIST_NUM_BUFFERS", "many")
    with pytest.raises(ValueError, match="num_buffers"):
        fastpersist.patching.current_options()
    with pytest.raises(ValueError, match="num_buffers"):  # every time it is met, not once
        fastpersist.patching.current_options()


def test_environment_is_read_on_every_call(monkeypatch):
    """Options parsed once per set of values, and still read anew on each
    call: a program may change the variables between saves."""
    monkeypatch.delenv("FASTPERSIST_BUFFER_SIZE", raising=False)
    default = fastpersist.patching.current_options().buffer_size
    for value, expected in (("8M", 8 << 20), ("2M", 2 << 20), ("8M", 8 << 20), ("", default)):
        monkeypatch.setenv("FASTPERSIST_BUFFER_SIZE", value)
        assert fastpersist.patching.current_options().buffer_size == expected
        assert fastpersist.patching.current_options().buffer_size == expected
    monkeypatch.delenv("FASTPERSIST_BUFFER_SIZE")
    assert fastpersist.patching.current_options().buffer_size == default


@pytest.mark.parametrize("target", ["bytesio", "fileobj"])
def test_file_objects_are_written_through_their_write(folder, target, log_records, monkeypatch):
    monkeypatch.setattr(fastpersist._torch_api, "_original_save",
                        lambda *a, **k: pytest.fail("the original torch.save ran"))
    fastpersist.patch()
    obj = {"x": torch.arange(10)}
    if target == "bytesio":
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        fastpersist.unpatch()
        assert torch.equal(torch.load(buf)["x"], obj["x"])
    else:
        with open(folder / "f.pt", "wb") as f:
            torch.save(obj, f)
        fastpersist.unpatch()
        assert torch.equal(vanilla_load(folder / "f.pt")["x"], obj["x"])
    assert "goes to the original torch.save" not in log_records.text


def test_legacy_format_goes_to_original(folder):
    fastpersist.patch()
    torch.save({"x": torch.arange(3)}, folder / "l.pt", _use_new_zipfile_serialization=False)
    fastpersist.unpatch()
    assert torch.equal(vanilla_load(folder / "l.pt")["x"], torch.arange(3))
    with open(folder / "l.pt", "rb") as f:
        assert f.read(2) != b"PK"


def test_save_emits_no_warnings(folder):
    fastpersist.patch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.save({"x": torch.ones(3)}, folder / "w.pt")
        torch.save({"x": torch.ones(3)}, io.BytesIO())


def test_import_is_light_and_autopatches():
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import fastpersist\n"
        "new = set(sys.modules) - before\n"
        "assert fastpersist.is_patched()\n"
        "assert 'fastpersist._engine_cffi' not in new, 'engine loaded at import'\n"
        "heavy = [m for m in new if m.startswith(('torch.distributed', 'torch.cuda.', 'numpy'))]\n"
        "assert not heavy, heavy\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FASTPERSIST_AUTOPATCH"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    env["FASTPERSIST_AUTOPATCH"] = "0"
    subprocess.run([sys.executable, "-c", "import fastpersist; assert not fastpersist.is_patched()"],
                   check=True, env=env)


# ---- failures lose nothing ---------------------------------------------------


def previous(folder):
    path = folder / "ckpt.pt"
    fastpersist.save({"generation": 1, "t": torch.arange(100)}, path)
    return path, path.read_bytes()


def test_missing_folder_same_error_as_torch(folder):
    with pytest.raises(RuntimeError) as ours:
        fastpersist.save({"x": 1}, folder / "nope" / "x.pt")
    with pytest.raises(RuntimeError) as theirs:
        fastpersist.patching.original_save()({"x": 1}, folder / "nope" / "x.pt")
    assert "does not exist" in str(ours.value) and str(ours.value) == str(theirs.value)


class Unpicklable:
    def __reduce__(self):
        raise pickle.PicklingError("this object refuses to be pickled")


def test_pickling_failure_keeps_previous_file(folder):
    path, before = previous(folder)
    with pytest.raises(pickle.PicklingError, match="refuses"):
        fastpersist.save({"generation": 2, "bad": Unpicklable()}, path)
    assert path.read_bytes() == before
    assert leftovers(folder) == []


class InterruptDuringPickling:
    def __reduce__(self):
        raise KeyboardInterrupt


def test_keyboard_interrupt_while_pickling(folder):
    path, before = previous(folder)
    with pytest.raises(KeyboardInterrupt):
        fastpersist.save({"t": torch.randn(1000), "x": InterruptDuringPickling()}, path)
    assert path.read_bytes() == before
    assert leftovers(folder) == []


def test_keyboard_interrupt_while_writing_data(folder, monkeypatch):
    path, before = previous(folder)
    real = FastFileWriter.write_address
    calls = []

    def interrupt_on_second(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(FastFileWriter, "write_address", interrupt_on_second)
    with pytest.raises(KeyboardInterrupt):
        fastpersist.save({"a": torch.randn(100_000), "b": torch.randn(100_000)}, path, **SMALL)
    assert len(calls) == 2
    assert path.read_bytes() == before
    assert leftovers(folder) == []


@pytest.mark.parametrize("fstype", ["tmpfs", "ext4"])
def test_enospc_keeps_previous_file(fstype, engine):
    with mounted(fstype, size_kib=2048) as mnt:
        path = os.path.join(mnt, "ckpt.pt")
        fastpersist.save({"generation": 1, "t": torch.arange(1000)}, path)
        before = open(path, "rb").read()
        with pytest.raises(OSError) as info:
            fastpersist.save({"generation": 2, "t": torch.randn(4 << 20)}, path, engine=engine, **SMALL)
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == path
        assert open(path, "rb").read() == before
        assert leftovers(mnt) == []
        assert vanilla_load(path)["generation"] == 1


def test_unwritable_folder(folder):
    if os.geteuid() != 0:
        ro = folder / "ro"
        ro.mkdir()
        os.chmod(ro, 0o500)
        ctx = None
        target = ro / "x.pt"
    else:
        ctx = mounted("tmpfs", size_kib=1024, options="ro")
        target = None
    if ctx is None:
        with pytest.raises(OSError) as info:
            fastpersist.save({"x": 1}, target)
        assert info.value.errno in (errno.EACCES, errno.EROFS, errno.EPERM)
        return
    with ctx as mnt:
        target = os.path.join(mnt, "x.pt")
        with pytest.raises(OSError) as info:
            fastpersist.save({"x": 1}, target)
        assert info.value.errno in (errno.EACCES, errno.EROFS, errno.EPERM)
        assert info.value.filename == target
        assert os.listdir(mnt) == []
