"""The memory of fastpersist.load results: kept briefly for the next load
after the last tensor dies, then given back; never handed to a load while a
tensor still uses it; never a lock in the path a garbage collection takes."""
import gc
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fastpersist
from fastpersist import load_memory

load_module = sys.modules["fastpersist.load"]  # the package's `load` attribute is the function


@pytest.fixture
def keep(monkeypatch):
    """Sets how long freed load memory is kept, starting from an empty pool."""
    from fastpersist import options

    def set_seconds(seconds):
        monkeypatch.setenv("FASTPERSIST_LOAD_MEMORY_SECONDS", str(seconds))
        if options._patched_options is not None:  # patch() options win over the environment
            monkeypatch.setattr(options, "_patched_options",
                                options._patched_options.replace(load_memory_seconds=seconds))
    gc.collect()  # results of earlier tests give their memory back now, not during this test
    load_module.release_load_memory()
    set_seconds(600)
    yield set_seconds
    gc.collect()
    load_module.release_load_memory()


def pool_state() -> str:
    """Why the pool might hold less than expected: for assertion messages."""
    from fastpersist.options import current_options

    return (f"kept for {current_options().load_memory_seconds} s; room {load_memory._available_memory() >> 20} MiB; "
            f"free {len(load_memory._freed_images.free)}, unfiled {len(load_memory._freed_images.returned)}")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_script(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs script in a fresh interpreter; a hang fails the test (TimeoutExpired) instead of the suite."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "FASTPERSIST_AUTOPATCH": "0"})


def test_a_later_load_reuses_the_memory_of_freed_results_and_sees_only_its_own_bytes(folder, keep):
    first, second = folder / "first.pt", folder / "second.pt"
    torch.save({"w": torch.full((3 << 20,), 1.0), "b": torch.arange(10)}, first)
    torch.save({"w": torch.full((3 << 20,), 2.0), "tail": torch.arange(5)}, second)  # same size: the same mapping fits
    one = fastpersist.load(first)
    address = one["w"].data_ptr()
    two = fastpersist.load(second)  # the first result is alive: new memory
    assert two["w"].data_ptr() != address
    del one
    gc.collect()
    assert len(load_memory._freed_images.kept()) == 1, pool_state()
    three = fastpersist.load(second)
    assert three["w"].data_ptr() == address  # the freed mapping, touched already
    assert torch.equal(three["w"], torch.full((3 << 20,), 2.0)) and torch.equal(three["tail"], torch.arange(5))
    assert "b" not in three
    assert torch.equal(two["w"], three["w"])
    del two, three
    gc.collect()
    load_module.release_load_memory()
    assert not load_memory._freed_images.kept()


def test_freed_load_memory_is_bounded_in_count(folder, keep):
    paths = []
    for i in range(4):
        paths.append(folder / f"c{i}.pt")
        torch.save({"w": torch.zeros((i + 1) << 19)}, paths[-1])
    results = [fastpersist.load(p) for p in paths]
    del results
    gc.collect()
    assert len(load_memory._freed_images.kept()) == load_memory._FreedImages.KEEP


def test_freed_load_memory_goes_back_to_the_system_when_idle(folder, keep):
    """Kept for load_memory_seconds, then unmapped by the keeper thread with
    no further call: the process's RSS falls back as it does after torch.load."""
    keep(0.5)
    path = folder / "big.pt"
    torch.save({"w": torch.ones(64 << 20)}, path)  # 256 MiB
    result = fastpersist.load(path)
    assert float(result["w"].sum()) == 64 << 20  # touched: resident
    loaded = rss()
    memory = load_memory._freed_images  # noqa: F841 - the pool of this process
    del result
    gc.collect()
    assert len(load_memory._freed_images.free) + len(load_memory._freed_images.returned) >= 1
    deadline = time.monotonic() + 30
    while (load_memory._freed_images.free or load_memory._freed_images.returned) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not load_memory._freed_images.free and not load_memory._freed_images.returned, \
        "freed load memory was still kept 30 s after load_memory_seconds=0.5"
    assert loaded - rss() > 200 << 20, "the memory was dropped from the pool but not given back"


def test_zero_seconds_keeps_nothing(folder, keep):
    keep(0)
    path = folder / "c.pt"
    torch.save({"w": torch.ones(1 << 20)}, path)
    result = fastpersist.load(path)
    del result
    gc.collect()
    assert load_memory._freed_images.kept() == []


def test_nothing_is_kept_under_memory_pressure(folder, keep, monkeypatch):
    """Less available memory than the result held: given back at once."""
    path = folder / "c.pt"
    torch.save({"w": torch.ones(1 << 20)}, path)
    result = fastpersist.load(path)
    monkeypatch.setattr(load_memory, "_available_memory", lambda: 1 << 20)  # less than the 4 MiB result
    del result
    gc.collect()
    assert load_memory._freed_images.kept() == []


def test_release_load_memory_gives_it_back_now(folder, keep):
    path = folder / "c.pt"
    torch.save({"w": torch.ones(1 << 20)}, path)
    result = fastpersist.load(path)
    del result
    gc.collect()
    kept = load_memory._freed_images.kept()
    assert len(kept) == 1, pool_state()
    fastpersist.release_load_memory()
    assert kept[0].closed and load_memory._freed_images.kept() == []


def test_a_forked_child_keeps_none_of_the_parents_freed_load_memory(folder, keep):
    from conftest import fork_child

    path = folder / "c.pt"
    torch.save({"w": torch.zeros(1 << 20)}, path)
    result = fastpersist.load(path)
    del result
    gc.collect()
    kept = load_memory._freed_images.kept()
    assert kept

    def child():
        assert not sys.modules["fastpersist.load_memory"]._freed_images.kept()
        assert torch.equal(fastpersist.load(path)["w"], torch.zeros(1 << 20))

    _, status = os.waitpid(fork_child(child), 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the load in the forked child failed (see stderr)"
    # the parent gave it back before forking: the child's pages would have been its copy
    assert kept[0].closed and not load_memory._freed_images.kept()


def test_a_result_freed_by_a_garbage_collection_inside_the_pool_does_not_deadlock(folder):
    """A result in a reference cycle dies when a collection runs, and a
    collection runs on whatever allocation comes next: inside the pool's own
    locked code too. Its memory must reach the pool without that lock."""
    path = folder / "c.pt"
    torch.save({"w": torch.ones(1 << 20)}, path)
    out = run_script(f"""
        import gc, sys, torch, fastpersist
        pool = sys.modules["fastpersist.load_memory"]._freed_images

        class Cycle:
            pass

        # the last reference dies while this thread holds the pool's lock, as when a
        # collection fires on an allocation inside take()
        result = fastpersist.load({str(path)!r})
        with pool.lock:
            del result
        # and as it happens in a long job: cyclic garbage, collected on whatever allocates next
        for _ in range(50):
            cycle = Cycle()
            cycle.self, cycle.result = cycle, fastpersist.load({str(path)!r})
            del cycle
            gc.set_threshold(1)
            fastpersist.load({str(path)!r})
            gc.set_threshold(700)
        gc.collect()
        print("done", len(pool.kept()))
    """, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("done")


def test_tensors_alive_at_exit_keep_their_memory_from_an_exit_time_load(folder):
    """At interpreter exit a result still in use is not given back to the
    pool: a load in an exit handler gets other memory."""
    one, two = folder / "one.pt", folder / "two.pt"
    torch.save({"w": torch.full((1 << 20,), 1.0)}, one)
    torch.save({"w": torch.full((1 << 20,), 2.0)}, two)
    out = run_script(f"""
        import atexit

        def checkpoint_on_exit():  # registered before anything else: runs last
            import torch, fastpersist
            late = fastpersist.load({str(two)!r})
            print("model", float(model["w"].max()), "late", float(late["w"].min()))

        atexit.register(checkpoint_on_exit)
        import fastpersist
        model = fastpersist.load({str(one)!r})
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["model", "1.0", "late", "2.0"]


def test_a_freed_result_is_seen_by_the_pool_at_once(folder, keep):
    """The keeper thread wakes on every freed result; a look at the pool
    right after the result died always finds its memory, never a moment
    where only the keeper's hands hold it (that race failed CI runs)."""
    path = folder / "c.pt"
    torch.save({"w": torch.ones(1 << 16)}, path)
    for attempt in range(300):
        result = fastpersist.load(path)
        del result
        kept = load_memory._freed_images.kept()
        assert len(kept) == 1, f"attempt {attempt}: the pool held {len(kept)} mappings; {pool_state()}"
        load_module.release_load_memory()


def write_with_hole(saved, path, hole: int) -> None:
    """torch.save's file with `hole` bytes of zeros (sparse: no disk) between
    its last record and its central directory, which the end record points
    past them: a valid zip, and a valid checkpoint to torch.load."""
    import struct

    data = _saved_bytes(saved)
    end, z64, locator = data.rfind(b"PK\x05\x06"), data.rfind(b"PK\x06\x06"), data.rfind(b"PK\x06\x07")
    assert 0 < z64 < locator < end  # torch's writer ends with zip64 records: their offsets move too
    cd_offset = struct.unpack_from("<Q", data, z64 + 48)[0]
    tail = bytearray(data[cd_offset:])
    for at, fmt in ((z64 + 48, "<Q"), (locator + 8, "<Q"), (end + 16, "<I")):
        value = struct.unpack_from(fmt, data, at)[0]
        if value != 0xFFFFFFFF:
            struct.pack_into(fmt, tail, at - cd_offset, value + hole)
    with open(path, "wb") as f:
        f.write(data[:cd_offset])
        f.seek(cd_offset + hole)
        f.write(tail)


def _saved_bytes(saved) -> bytes:
    import io

    from fastpersist.patching import original_save

    buf = io.BytesIO()
    original_save()(saved, buf)
    return buf.getvalue()


def test_a_small_tensor_of_a_file_with_a_huge_hole_holds_no_image_of_the_hole(folder):
    """A 16-byte tensor of a file that is 512 MiB of unreferenced zeros held
    an image of the whole file alive (its RSS 512 MiB) for as long as it
    lived; such a file is read record by record, as torch.load reads it."""
    from fastpersist.patching import original_load

    saved = {"w": torch.tensor([1.0, -2.0, 3.5, 4.25]), "i": torch.arange(3)}
    path, normal = folder / "hole.pt", folder / "normal.pt"
    write_with_hole(saved, path, 512 << 20)
    torch.save(saved, normal)
    assert os.path.getsize(path) > 512 << 20
    for loaded in (original_load()(path), fastpersist.load(path, verify=True),
                   fastpersist.load(path, weights_only=False)):
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    with load_module._CheckpointImage.open(str(normal), fastpersist.options.current_options()) as image:
        assert not image.mostly_outside_records()  # torch.save's files: one image, as before
    result = run_script(f"""
        import os, torch, fastpersist
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        fastpersist.load({str(normal)!r})  # the first load's imports and threads
        before = rss()
        loaded = fastpersist.load({str(path)!r})
        print(rss() - before, loaded["w"].untyped_storage().nbytes())
    """)
    assert result.returncode == 0, result.stderr
    grown, nbytes = map(int, result.stdout.split())
    assert nbytes == 16
    assert grown < 64 << 20, f"loading a 16-byte tensor grew the process by {grown >> 20} MiB"
