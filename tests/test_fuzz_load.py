"""Fuzzing the load path: damaged checkpoints fed to fastpersist.load and
fastpersist.load_into.

Seed checkpoints written by torch.save and fastpersist.save (one holds an
80 KB tensor, nested dicts and lists, tied tensors) are damaged by
hypothesis: bit flips, byte overwrites (zip signatures, all-ones, zeros...),
truncations, cut-out ranges and splices of two checkpoints, aimed half the
time at the zip structures and the pickle. Each damaged file is written to a
real file and loaded with weights_only=True and False, and restored with
load_into into a matching state dict. Required of every example:

- only clean exceptions: anything fastpersist raises itself is a
  CheckpointError naming the file (load_into's key and shape checks a
  RuntimeError naming it); other exceptions must come from torch's code
  (its unpickler, torch.load where fastpersist delegates);
- load_into that refuses leaves its target untouched;
- no crash: a fatal signal kills the run, and faulthandler prints where; the
  input that did it is left in /tmp/pytest-of-$USER/pytest-<n>/fuzz0/fuzz.pt;
- no hang: hypothesis fails an example that takes over 10 s, SIGALRM
  interrupts one after HANG_SECONDS, and faulthandler ends the process
  (printing every thread's stack) if C code never returns;
- no allocation beyond the file: see check_memory.

The default run is bounded (FASTPERSIST_FUZZ_EXAMPLES examples per test,
100 by default: about 15 s). Long runs (about 12 examples a second):

    FASTPERSIST_FUZZ_EXAMPLES=100000 python -m pytest -q -x tests/test_fuzz_load.py -p no:cacheprovider \\
        --hypothesis-show-statistics

(FASTPERSIST_FUZZ_SEED=<n> fixes hypothesis's seed to replay a run.)
"""
import contextlib
import faulthandler
import importlib
import mmap
import os
import resource
import signal
import struct
import tracemalloc
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

import fastpersist
from fastpersist import CheckpointError
from fastpersist.patching import original_save

from test_archive_parity import acceptable_refusal

fp_load = importlib.import_module("fastpersist.load")  # the module; fastpersist.load is the function

EXAMPLES = int(os.environ.get("FASTPERSIST_FUZZ_EXAMPLES", "100"))
HANG_SECONDS = 30

FUZZ = settings(
    max_examples=EXAMPLES,
    # An example takes 30-500 ms: hypothesis fails one that takes over 10 s
    # (twice); time_limit interrupts one that never ends.
    deadline=timedelta(seconds=10),
    database=None,  # no .hypothesis folder in the repository; failures print their input
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def maybe_seeded(test):
    value = os.environ.get("FASTPERSIST_FUZZ_SEED")
    return seed(int(value))(test) if value else test


# -- seeds ----------------------------------------------------------------------


def small_state():
    torch.manual_seed(0)
    return {"w": torch.randn(4, 5), "b": torch.arange(5), "step": 3}


def nested_state():
    torch.manual_seed(1)
    tied = torch.randn(3, 2)
    return {
        "big": torch.arange(20000, dtype=torch.float32),  # 80 KB: more than 64 KiB in one record
        "nested": {"list": [torch.arange(3), {"x": torch.ones(2, dtype=torch.float64)}],
                   "half": torch.randn(8).half(), "meta": {"lr": 0.1, "name": "adam"}},
        "tied_a": tied,
        "tied_b": tied,
        "view": tied[1:],
    }


def zeroed(obj):
    """A target shaped like obj: tensors of zeros, other values as they are."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: zeroed(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [zeroed(v) for v in obj]
    return obj


def snapshot(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    return obj


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def zones(data: bytes) -> list:
    """(start, end) of the bytes readers interpret: every local header with
    its name and extra field, the central directory and end records, and the
    small records (pickle, version, byte order) whose contents are parsed."""
    found = []
    at = data.find(b"PK\x03\x04")
    while at >= 0:
        name_len, extra_len = struct.unpack_from("<HH", data, at + 26)
        end = at + 30 + name_len + extra_len
        found.append((at, end - 1))
        name = data[at + 30:at + 30 + name_len]
        if not name.split(b"/", 1)[-1].startswith(b"data/"):
            found.append((end, min(end + 400, len(data) - 1)))  # the record's contents
        at = data.find(b"PK\x03\x04", end)
    central = data.find(b"PK\x01\x02")
    found.append((central, len(data) - 1))
    return found


class Seed:
    def __init__(self, data: bytes, state):
        self.data = data
        self.state = state
        self.zones = zones(data)
        self.boundaries = sorted({z[0] for z in self.zones} | {0, len(data)})


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz-seeds")
    made = {}
    for name, state, save in (("torch_small", small_state, original_save()),
                              ("torch_nested", nested_state, original_save()),
                              ("fastpersist_nested", nested_state, fastpersist.save)):
        save(state(), folder / f"{name}.pt")
        made[name] = Seed((folder / f"{name}.pt").read_bytes(), state)
    assert same(fastpersist.load(folder / "fastpersist_nested.pt"), nested_state())
    return made


# -- damage -----------------------------------------------------------------------

INTERESTING = [b"\x00", b"\xff", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\xff" * 8, b"\x01\x00",
               b"\xff\xff\xff\x7f", b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07",
               b"/", b"r", b"q"]


class Damaged:
    """A damaged seed; its repr (which hypothesis prints for a failing
    example) says what was done rather than dumping the bytes."""

    def __init__(self, name: str, data: bytes, steps: list):
        self.name, self.data, self.steps = name, data, steps

    def __repr__(self) -> str:
        return f"Damaged({self.name!r}, {len(self.data)} bytes: {'; '.join(self.steps) or 'intact'})"


@st.composite
def damaged(draw, seeds):
    """A Damaged seed: 1 to 4 steps of damage."""
    names = sorted(seeds)
    name = draw(st.sampled_from(names))
    base = seeds[name]
    data = bytearray(base.data)
    steps = []

    def position(length):
        anywhere = st.integers(0, max(length - 1, 0))
        aimed = st.sampled_from(base.zones).flatmap(lambda z: st.integers(z[0], z[1]))
        return draw(st.one_of(anywhere, aimed)) % max(length, 1)

    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "flip", "overwrite", "overwrite", "truncate", "cut", "splice"]))
        if kind == "flip" and data:
            at, bit = position(len(data)), draw(st.integers(0, 7))
            data[at] ^= 1 << bit
            steps.append(f"flip bit {bit} at {at}")
        elif kind == "overwrite" and data:
            at = position(len(data))
            value = draw(st.one_of(st.sampled_from(INTERESTING), st.binary(min_size=1, max_size=8)))
            data[at:at + len(value)] = value
            steps.append(f"write {value!r} at {at}")
        elif kind == "truncate":
            keep = draw(st.one_of(st.integers(0, len(data)), st.sampled_from(base.boundaries)))
            del data[min(keep, len(data)):]
            steps.append(f"truncate to {len(data)}")
        elif kind == "cut" and data:
            at, n = position(len(data)), draw(st.integers(1, 4096))
            del data[at:at + n]
            steps.append(f"cut {n} at {at}")
        elif kind == "splice":
            other = seeds[draw(st.sampled_from(names))]
            i = draw(st.one_of(st.integers(0, len(data)), st.sampled_from(base.boundaries))) % (len(data) + 1)
            j = draw(st.one_of(st.integers(0, len(other.data)), st.sampled_from(other.boundaries)))
            data = data[:i] + other.data[j:]
            steps.append(f"splice at {i} from {j} of another seed")
    return Damaged(name, bytes(data), steps)


# -- checks -----------------------------------------------------------------------


class Hang(BaseException):
    """An example ran past HANG_SECONDS (a BaseException: no `except Exception` swallows it)."""


class _MmapSpy:
    """Stands in for the mmap module inside fastpersist.load: records the
    largest mapping fastpersist asks for (its one allocation the size of a
    file image, which tracemalloc does not see)."""

    def __init__(self):
        self.largest = 0

    def __getattr__(self, name):
        return getattr(mmap, name)

    def mmap(self, fileno, length, *args, **kwargs):
        self.largest = max(self.largest, length)
        return mmap.mmap(fileno, length, *args, **kwargs)


@pytest.fixture(scope="module")
def guard():
    """Module-wide instruments: tracemalloc, the mmap spy, and a data-segment
    limit 2 GiB above what the process uses now, so that an allocation of
    many GiB (from a size in a damaged file, in fastpersist, torch or the
    pickle module) fails with MemoryError instead of taking the machine's
    memory. Restored afterwards."""
    spy = _MmapSpy()
    original = fp_load._mmap
    fp_load._mmap = spy
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    with open("/proc/self/status") as f:
        data_kib = next(int(line.split()[1]) for line in f if line.startswith("VmData:"))
    limit = data_kib * 1024 + (2 << 30)
    if hard == resource.RLIM_INFINITY or limit < hard:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    tracemalloc.start(1)
    try:
        yield spy
    finally:
        tracemalloc.stop()
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        fp_load._mmap = original


@contextlib.contextmanager
def time_limit(seconds: float):
    """SIGALRM interrupts Python code that runs too long; faulthandler ends
    the process, printing every thread's stack, if C code never returns."""
    def on_alarm(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds * 3, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def check_memory(spy: _MmapSpy, size: int, what: str):
    """Memory fastpersist took for a file of `size` bytes. tracemalloc sees
    every allocation made through Python's allocators during the call: the
    bytes objects of every read (sized from the file's fields before they
    are checked, if fastpersist had such a bug; os.pread allocates what it
    is asked for), the pickle's objects, torch's Python-side work. The spy
    sees the file image's mapping, which must be the file rounded up to
    2 MiB. Native allocations by torch from sizes in the file are bounded by
    the data-segment limit (guard) and show up as MemoryError."""
    image = -(-size // (2 << 20)) * (2 << 20)
    spy.largest = 0
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    yield
    peak = tracemalloc.get_traced_memory()[1] - before
    assert spy.largest <= image, f"{what}: mapped {spy.largest} bytes for a {size}-byte file"
    # 4 images of the file (its records as bytes, the pickle's objects) and
    # 16 MiB for torch's and the unpickler's fixed costs
    assert peak <= 4 * size + (16 << 20), f"{what}: allocated {peak} bytes for a {size}-byte file"


def attempt(fn, path, spy, size, what, kind=""):
    """Runs fn under the time limit and the memory check; returns its
    exception (None when it succeeded) after checking that it is clean."""
    try:
        with time_limit(HANG_SECONDS), check_memory(spy, size, what):
            fn()
    except Exception as exc:  # noqa: BLE001 - which exceptions are fine is decided below
        problem = acceptable_refusal(exc, path)
        assert not problem, f"{what}: {problem}"
        if kind:
            event(f"{kind}: {outcome_kind(exc, path)}")
        return exc
    if kind:
        event(f"{kind}: loaded")
    return None


def outcome_kind(exc: BaseException, path) -> str:
    """A coarse name for a refusal, for --hypothesis-show-statistics."""
    if isinstance(exc, CheckpointError):
        words = str(exc).replace(str(path), "").lstrip(": ").split()
        return "CheckpointError: " + " ".join(w for w in words[:5] if not any(c.isdigit() for c in w))
    return f"{type(exc).__name__} from torch"


def exercise(path, data: bytes, base: Seed, spy, how: str, verify: bool = False):
    path.write_bytes(data)
    size = len(data)
    attempt(lambda: fastpersist.load(path, weights_only=True, verify=verify), path, spy, size,
            f"load(weights_only=True, verify={verify}) after {how}", "load")
    attempt(lambda: fastpersist.load(path, weights_only=False), path, spy, size,
            f"load(weights_only=False) after {how}")
    target = zeroed(base.state())
    before = snapshot(target)
    refused = attempt(lambda: fastpersist.load_into(target, path), path, spy, size, f"load_into after {how}",
                      "load_into")
    if refused is not None:
        assert same(target, before), f"load_into after {how} refused ({refused!r}) but changed its target"


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "fuzz.pt"


@FUZZ
@maybe_seeded
@given(data=st.data())
def test_damaged_checkpoints(seeds, guard, fuzz_file, data):
    damage = data.draw(damaged(seeds), label="damage")
    verify = data.draw(st.booleans(), label="verify")
    exercise(fuzz_file, damage.data, seeds[damage.name], guard, repr(damage), verify)


@FUZZ
@maybe_seeded
@given(data=st.data())
def test_truncated_checkpoints(seeds, guard, fuzz_file, data):
    """Every length is a file some crash or full disk could leave."""
    name = data.draw(st.sampled_from(sorted(seeds)), label="seed")
    base = seeds[name]
    keep = data.draw(st.integers(0, len(base.data) - 1), label="keep")
    exercise(fuzz_file, base.data[:keep], base, guard, f"truncated to {keep} ({name})")


def dict_leaves(obj, prefix=()):
    """The leaves load_into restores in place: tensors reached through dicts."""
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in dict_leaves(value, prefix + (key,)).items()}
    return {prefix: obj} if isinstance(obj, torch.Tensor) else {}


def test_intact_seeds_load(seeds, guard, fuzz_file):
    """The instruments themselves: intact seeds load, and load_into restores them."""
    for name, base in seeds.items():
        fuzz_file.write_bytes(base.data)
        for weights_only in (True, False):
            assert attempt(lambda: fastpersist.load(fuzz_file, weights_only=weights_only), fuzz_file, guard,
                           len(base.data), name) is None
        target = zeroed(base.state())
        fastpersist.load_into(target, fuzz_file)
        assert same(dict_leaves(target), dict_leaves(base.state()))


def test_load_into_restores_tensors_inside_lists(seeds, fuzz_file):
    fuzz_file.write_bytes(seeds["torch_nested"].data)
    target = zeroed(nested_state())
    fastpersist.load_into(target, fuzz_file)
    assert same(target["nested"]["list"], nested_state()["nested"]["list"])
