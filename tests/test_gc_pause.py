"""gc_pause holds the cyclic collector off while fastpersist builds a
checkpoint's objects, and always gives it back as it found it."""
import gc
import os
import threading

import pytest
import torch

import fastpersist
from fastpersist import _torch_api, gc_pause


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_off_inside_and_back_on_after_even_on_error():
    with gc_pause.paused():
        assert not gc.isenabled()
        with gc_pause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    with pytest.raises(KeyError), gc_pause.paused():
        raise KeyError
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    with gc_pause.paused():
        pass
    assert not gc.isenabled()


def test_overlapping_pauses_in_two_threads():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with gc_pause.paused():
            first_in.set()
            second_in.wait(5)
        seen["after first"] = gc.isenabled()  # the second still holds it off
        first_out.set()

    def second():
        first_in.wait(5)
        with gc_pause.paused():
            second_in.set()
            first_out.wait(5)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after first": False}
    assert gc.isenabled()


def test_a_child_forked_during_a_pause_has_its_collector():
    with gc_pause.paused():
        pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() and gc_pause._depth == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_loads_and_saves_build_their_objects_with_the_collector_off(tmp_path, monkeypatch):
    seen = []
    real = _torch_api._rebuild_plain_tensor

    def spy(*args):
        seen.append(gc.isenabled())
        return real(*args)

    monkeypatch.setattr(_torch_api, "_rebuild_plain_tensor", spy)
    path = tmp_path / "x.pt"
    fastpersist.save({"a": torch.ones(3), "b": torch.zeros(2)}, path)
    assert gc.isenabled()
    loaded = fastpersist.load(path)
    assert seen == [False, False] and gc.isenabled()
    assert torch.equal(loaded["a"], torch.ones(3))


def test_a_failed_load_gives_the_collector_back(tmp_path):
    path = tmp_path / "x.pt"
    fastpersist.save({"a": torch.ones(3)}, path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 30)  # the end records gone
    with pytest.raises(Exception):
        fastpersist.load(path)
    assert gc.isenabled()
