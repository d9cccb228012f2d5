"""weights_only loads of hostile pickles: fastpersist decides as
torch.load(weights_only=True) decides, returns what it returns, and changes
nothing outside the returned objects.

Each file is written by torch's own zip writer around a hand-written
data.pkl, so every CRC-32 is right (CRCs catch damage, not attacks), and is
loaded by the real engine and by the real torch.load."""
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict

import pytest
import torch

import fastpersist
from fastpersist import _state_pickle
from fastpersist.patching import original_load, original_save

# -- a small pickle assembler -------------------------------------------------------


def glob(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def text(s: str) -> bytes:
    raw = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def small(n: int) -> bytes:
    return pickle.BININT1 + bytes([n])


def ints(values) -> bytes:
    return pickle.MARK + b"".join(small(v) for v in values) + pickle.TUPLE


REBUILD = glob("torch._utils", "_rebuild_tensor_v2")
ORDERED_DICT = glob("collections", "OrderedDict")
NEW_ORDERED_DICT = ORDERED_DICT + pickle.EMPTY_TUPLE + pickle.REDUCE


def tensor(key: str = "0", numel: int = 4, size=(4,), stride=(1,), storage: str = "FloatStorage") -> bytes:
    """_rebuild_tensor_v2 over storage record data/<key>, as torch.save writes it."""
    storage_id = pickle.MARK + text("storage") + glob("torch", storage) + text(key) + text("cpu") + small(numel) \
        + pickle.TUPLE + pickle.BINPERSID
    return REBUILD + pickle.MARK + storage_id + small(0) + ints(size) + ints(stride) + pickle.NEWFALSE \
        + NEW_ORDERED_DICT + pickle.TUPLE + pickle.REDUCE


def program(body: bytes) -> bytes:
    return pickle.PROTO + b"\x02" + body + pickle.STOP


def state(**items: bytes) -> bytes:
    """{key: value, ...} as a plain dict."""
    return pickle.EMPTY_DICT + pickle.MARK + b"".join(text(k) + v for k, v in items.items()) + pickle.SETITEMS


RECORD = struct.pack("<4f", 1.0, -2.0, 3.5, 4.25)


def write_archive(path, pickled: bytes, records=None, byteorder: bytes = b"little") -> None:
    """A checkpoint as torch's own zip writer lays it out, CRCs right."""
    records = {"0": RECORD} if records is None else records
    writer = torch._C.PyTorchFileWriter(str(path), True, 64)
    writer.write_record("data.pkl", pickled, len(pickled))
    writer.write_record(".format_version", b"1", 1)
    writer.write_record(".storage_alignment", b"64", 2)
    writer.write_record("byteorder", byteorder, len(byteorder))
    for key, data in records.items():
        writer.write_record(f"data/{key}", data, len(data))
    writer.write_end_of_file()


# -- what must not change -----------------------------------------------------------

_WATCHED = (torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter, torch._utils._rebuild_tensor)


def process_state():
    """What a hostile pickle could change for the whole process."""
    functions = [(f.__defaults__, f.__kwdefaults__, f.__qualname__, f.__name__, dict(f.__dict__), f.__code__)
                 for f in _WATCHED]
    return functions, dict(vars(OrderedDict)), sorted(vars(torch.storage.TypedStorage))


def trusted_load_works(folder) -> None:
    """A checkpoint saved and loaded after the case holds what was saved."""
    saved = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([-1, 2])}
    original_save()(saved, folder / "trusted.pt")
    for loaded in (fastpersist.load(folder / "trusted.pt"), original_load()(folder / "trusted.pt")):
        assert loaded.keys() == saved.keys()
        for k in saved:
            assert torch.equal(loaded[k], saved[k]), k


def outcome(load):
    try:
        return "loaded", load()
    except Exception as exc:  # noqa: BLE001 - either side's refusal, whatever its type
        return "refused", exc


def same_values(a, b, seen=None) -> bool:
    """Equal structure and values; shared and cyclic containers compared once."""
    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and a.is_neg() == b.is_neg() and a.is_conj() == b.is_conj() and a.requires_grad == b.requires_grad
                and torch.equal(a.resolve_neg().resolve_conj(), b.resolve_neg().resolve_conj()))
    if isinstance(a, (dict, list, tuple)):
        seen = set() if seen is None else seen
        if (id(a), id(b)) in seen:
            return True
        seen.add((id(a), id(b)))
        if type(a) is not type(b) or len(a) != len(b):
            return False
        if isinstance(a, dict):
            return (same_values(list(a.items()), list(b.items()), seen)
                    and (not hasattr(a, "__dict__") or same_values(vars(a), vars(b), seen)))
        return all(same_values(x, y, seen) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or a != a and b != b)


def check_case(folder, pickled: bytes, records=None, *, fastpersist_loads=None, byteorder: bytes = b"little"):
    """fastpersist.load, its verify=True and the layout pass of load_into
    against torch.load(weights_only=True): same decision, same values, the
    process left as it was. Returns torch's decision."""
    path = folder / "case.pt"
    write_archive(path, pickled, records, byteorder)
    before = process_state()
    started = time.monotonic()
    theirs, their_value = outcome(lambda: original_load()(path, weights_only=True))
    assert process_state() == before
    loads = fastpersist_loads or {
        "fastpersist.load": lambda: fastpersist.load(path),
        "fastpersist.load(verify=True)": lambda: fastpersist.load(path, verify=True),
        "fastpersist.load(weights_only=True)": lambda: fastpersist.load(path, weights_only=True),
    }
    for what, load in loads.items():
        ours, our_value = outcome(load)
        assert process_state() == before, f"{what} changed the process"
        assert ours == theirs, f"{what} {ours}, torch.load {theirs}: {our_value!r} / {their_value!r}"
        if ours == "loaded":
            assert same_values(our_value, their_value), what
    if theirs == "refused":
        # load_into's layout pass unpickles with the same rules
        ours, value = outcome(lambda: fastpersist.load_into({"x": torch.zeros(4)}, path, strict=False))
        assert ours == "refused", f"load_into loaded a pickle torch refuses: {value!r}"
        assert process_state() == before, "load_into changed the process"
    assert time.monotonic() - started < 30
    trusted_load_works(folder)
    return theirs


# -- the corpus -----------------------------------------------------------------------

NONE_DEFAULTS = pickle.NONE + state(__defaults__=state(neg=pickle.NEWTRUE) + pickle.TUPLE1) + pickle.TUPLE2

HOSTILE = {
    # BUILD on a function: the C unpickler sets its attributes for the whole process
    "BUILD sets _rebuild_tensor_v2.__defaults__": program(REBUILD + NONE_DEFAULTS + pickle.BUILD),
    "BUILD sets _rebuild_tensor_v2.__qualname__": program(
        REBUILD + pickle.NONE + state(__qualname__=text("x")) + pickle.TUPLE2 + pickle.BUILD),
    "BUILD fills _rebuild_tensor_v2.__dict__": program(REBUILD + state(__defaults__=pickle.NONE) + pickle.BUILD),
    "BUILD on the OrderedDict class": program(ORDERED_DICT + pickle.NONE + state(x=small(1)) + pickle.TUPLE2
                                              + pickle.BUILD),
    "BUILD on a storage class": program(glob("torch", "FloatStorage") + state(x=small(1)) + pickle.BUILD),
    "BUILD then a valid state dict": program(state(w=tensor(), f=REBUILD + NONE_DEFAULTS + pickle.BUILD)),
    # object operations torch's unpickler refuses
    "SETITEM on a tensor": program(tensor() + small(0) + pickle.BINFLOAT + struct.pack(">d", 9.0) + pickle.SETITEM),
    "SETITEMS on a tensor": program(tensor() + pickle.MARK + small(1) + small(7) + pickle.SETITEMS),
    "SETITEM on a list": program(pickle.EMPTY_LIST + pickle.NONE + pickle.APPEND + small(0) + small(5)
                                 + pickle.SETITEM),
    "APPEND to a dict": program(pickle.EMPTY_DICT + small(1) + pickle.APPEND),
    "ADDITEMS on a tensor": program(tensor() + pickle.MARK + tensor() + tensor() + pickle.ADDITEMS),
    "BUILD on an OrderedDict with slot state": program(NEW_ORDERED_DICT + pickle.NONE + state(x=small(1))
                                                        + pickle.TUPLE2 + pickle.BUILD),
    "BUILD on a tensor, 3-tuple state": program(tensor() + pickle.NEWTRUE + pickle.NONE + NEW_ORDERED_DICT
                                                + pickle.TUPLE3 + pickle.BUILD),
    "BUILD on a tensor, 5-tuple state": program(
        tensor() + pickle.MARK + tensor(size=(2,), stride=(2,)) + pickle.NEWFALSE + pickle.NONE + pickle.NEWFALSE
        + NEW_ORDERED_DICT + pickle.TUPLE + pickle.BUILD),
    "BUILD on a tensor, 4-tuple state": program(
        tensor() + pickle.MARK + pickle.MARK + text("storage") + glob("torch", "FloatStorage") + text("0")
        + text("cpu") + small(4) + pickle.TUPLE + pickle.BINPERSID + small(0) + ints([2]) + ints([1]) + pickle.TUPLE
        + pickle.BUILD),
    "REDUCE of a tensor": program(tensor() + pickle.EMPTY_TUPLE + pickle.REDUCE),
    "REDUCE of OrderedDict over a tensor": program(ORDERED_DICT + tensor(size=(2, 2), stride=(2, 1))
                                                   + pickle.TUPLE1 + pickle.REDUCE),
    "a tensor whose size holds a tensor": program(
        REBUILD + pickle.MARK + pickle.MARK + text("storage") + glob("torch", "FloatStorage") + text("0")
        + text("cpu") + small(4) + pickle.TUPLE + pickle.BINPERSID + small(0) + tensor(key="0", numel=4)
        + pickle.TUPLE1 + ints([1]) + pickle.NEWFALSE + NEW_ORDERED_DICT + pickle.TUPLE + pickle.REDUCE),
    "a tensor as a dict key": program(state(a=pickle.EMPTY_DICT + tensor() + small(1) + pickle.SETITEM)),
    "rebuild with neg metadata": program(state(w=REBUILD + pickle.MARK + pickle.MARK + text("storage")
                                               + glob("torch", "FloatStorage") + text("0") + text("cpu") + small(4)
                                               + pickle.TUPLE + pickle.BINPERSID + small(0) + ints([4]) + ints([1])
                                               + pickle.NEWFALSE + NEW_ORDERED_DICT + state(neg=pickle.NEWTRUE)
                                               + pickle.TUPLE + pickle.REDUCE)),
    "a memo index far ahead": program(pickle.NONE + pickle.LONG_BINPUT + struct.pack("<I", 1 << 20)),
    "a memo index never put": program(pickle.BINGET + b"\x05"),
    "PROTO 4": pickle.PROTO + b"\x04" + state(w=tensor()) + pickle.STOP,
    "PROTO twice": program(pickle.PROTO + b"\x02" + state(w=tensor())),
    "STOP inside a MARK": program(pickle.MARK + state(w=tensor())),
    "TUPLE below its MARK": program(pickle.NONE + pickle.MARK + pickle.TUPLE2),
    "typed storage global": program(
        REBUILD + pickle.MARK + pickle.MARK + text("storage") + glob("torch.storage", "UntypedStorage") + text("0")
        + text("cpu") + small(16) + pickle.TUPLE + pickle.BINPERSID + small(0) + ints([16]) + ints([1])
        + pickle.NEWFALSE + NEW_ORDERED_DICT + pickle.TUPLE + pickle.REDUCE),
    "an int persistent id": program(small(0) + pickle.BINPERSID),
}

# opcodes CPython's unpickler runs and torch's does not implement, each in a pickle the C unpickler loads
UNIMPLEMENTED = {
    "STACK_GLOBAL": text("collections") + text("OrderedDict") + pickle.STACK_GLOBAL + pickle.EMPTY_TUPLE + pickle.REDUCE,
    "MEMOIZE": pickle.NONE + pickle.MEMOIZE,
    "FRAME": pickle.FRAME + struct.pack("<Q", 1) + pickle.NONE,
    "INT": pickle.INT + b"7\n",
    "LONG": pickle.LONG + b"7L\n",
    "FLOAT": pickle.FLOAT + b"1.5\n",
    "STRING": pickle.STRING + b"'a'\n",
    "UNICODE": pickle.UNICODE + b"a\n",
    "BINSTRING": pickle.BINSTRING + struct.pack("<i", 1) + b"a",
    "SHORT_BINUNICODE": pickle.SHORT_BINUNICODE + b"\x01a",
    "BINUNICODE8": pickle.BINUNICODE8 + struct.pack("<Q", 1) + b"a",
    "BINBYTES": pickle.BINBYTES + struct.pack("<I", 1) + b"a",
    "SHORT_BINBYTES": pickle.SHORT_BINBYTES + b"\x01a",
    "BINBYTES8": pickle.BINBYTES8 + struct.pack("<Q", 1) + b"a",
    "BYTEARRAY8": pickle.BYTEARRAY8 + struct.pack("<Q", 1) + b"a",
    "LONG4": pickle.LONG4 + struct.pack("<i", 1) + b"\x07",
    "GET/PUT": pickle.MARK + pickle.NONE + pickle.PUT + b"0\n" + pickle.GET + b"0\n" + pickle.TUPLE,
    "DUP": pickle.NONE + pickle.DUP + pickle.TUPLE2,
    "POP": pickle.NONE + pickle.NONE + pickle.POP,
    "POP_MARK": pickle.NONE + pickle.MARK + pickle.NONE + pickle.POP_MARK,
    "LIST": pickle.MARK + pickle.NONE + pickle.LIST,
    "DICT": pickle.MARK + small(1) + small(2) + pickle.DICT,
    "INST": pickle.MARK + pickle.INST + b"collections\nOrderedDict\n",
    "OBJ": pickle.MARK + ORDERED_DICT + pickle.OBJ,
    "NEWOBJ_EX": ORDERED_DICT + pickle.EMPTY_TUPLE + pickle.EMPTY_DICT + pickle.NEWOBJ_EX,
    "ADDITEMS": pickle.EMPTY_SET + pickle.MARK + small(1) + pickle.ADDITEMS,
    "FROZENSET": pickle.MARK + small(1) + pickle.FROZENSET,
    "APPENDS without a list": pickle.EMPTY_DICT + pickle.MARK + pickle.APPENDS,
}

# what torch accepts: the fast path must take these as torch does (and the scan admit the plain ones)
ACCEPTED = {
    "a state dict": program(NEW_ORDERED_DICT + pickle.MARK + text("w") + tensor() + text("v")
                            + tensor(size=(2, 2), stride=(1, 2)) + pickle.SETITEMS
                            + state(_metadata=NEW_ORDERED_DICT + text("") + state(version=small(1)) + pickle.SETITEM)
                            + pickle.BUILD),
    "a parameter": program(state(p=glob("torch._utils", "_rebuild_parameter") + pickle.MARK + tensor()
                                 + pickle.NEWTRUE + NEW_ORDERED_DICT + pickle.TUPLE + pickle.REDUCE)),
    "lists and shared tensors": program(state(l=pickle.EMPTY_LIST + pickle.MARK + tensor() + pickle.BINPUT + b"\x00"
                                              + pickle.BINGET + b"\x00" + small(3) + pickle.APPENDS)),
    "a 0-d tensor": program(state(s=tensor(size=(), stride=()))),
    "EMPTY_SET (torch implements it)": program(state(s=pickle.EMPTY_SET)),
    "BUILD on a tensor, set_ state (torch calls set_)": program(
        tensor() + tensor(size=(2,), stride=(2,)) + pickle.TUPLE1 + pickle.BUILD),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_pickles(folder, name):
    check_case(folder, HOSTILE[name])


@pytest.mark.parametrize("name", list(UNIMPLEMENTED))
def test_opcodes_torch_does_not_implement(folder, name):
    assert check_case(folder, program(UNIMPLEMENTED[name])) == "refused"


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_pickles_torch_accepts(folder, name):
    check_case(folder, ACCEPTED[name])


def test_the_poisoning_build_changes_nothing_through_any_path(folder):
    """The issue's first finding: BUILD sets _rebuild_tensor_v2's defaults, and
    every later tensor came back negated (also through vanilla torch.load)."""
    path = folder / "poison.pt"
    write_archive(path, program(state(w=tensor(), f=REBUILD + NONE_DEFAULTS + pickle.BUILD)))
    defaults = torch._utils._rebuild_tensor_v2.__defaults__
    for load in (lambda: fastpersist.load(path), lambda: fastpersist.load(path, verify=True),
                 lambda: fastpersist.load_into({"w": torch.zeros(4)}, path, strict=False)):
        with pytest.raises(Exception):
            load()
        assert torch._utils._rebuild_tensor_v2.__defaults__ == defaults
    trusted_load_works(folder)


def test_the_scan_admits_what_torch_save_writes(folder):
    """The fast path still runs for state dicts as torch.save writes them:
    a module's (with _metadata), Parameters, an optimizer's."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    for obj in (model.state_dict(), model.state_dict(keep_vars=True), opt.state_dict(),
                {"model": model.state_dict(), "epoch": 3, "lr": [0.1, 0.2]}):
        original_save()(obj, folder / "c.pt")
        import zipfile

        with zipfile.ZipFile(folder / "c.pt") as z:
            pickled = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
        assert _state_pickle.admits(pickled)


# -- bounded memory and time ----------------------------------------------------------

MEMO_CHILD = textwrap.dedent("""
    import resource, sys
    import fastpersist
    from fastpersist.patching import original_load
    path, limit = sys.argv[1], int(sys.argv[2])
    vm = next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + limit, vm + limit))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    theirs = original_load()(path, weights_only=True)
    ours = fastpersist.load(path)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    assert ours == theirs == {"x": None}, (ours, theirs)
    print(grew)
""")


def test_a_huge_memo_index_costs_no_memory(folder):
    """LONG_BINPUT 2**25: CPython's unpickler grows its memo to that many
    entries (512 MiB here; 4.3 GB at 2**28); torch's keeps a dict. Loaded in
    a child under an address-space limit."""
    path = folder / "memo.pt"
    write_archive(path, program(state(x=pickle.NONE + pickle.LONG_BINPUT + struct.pack("<I", 1 << 25))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", MEMO_CHILD, str(path), str(1 << 30)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) < 64 << 20


def test_many_additems_on_a_broadcast_tensor_are_refused_quickly(folder):
    """ADDITEMS on a tensor called Tensor.add once per item (a 1.8 KB file
    took 6 s and 1.25 GB)."""
    big = tensor(size=(200, 200), stride=(0, 0), numel=4)
    pickled = program(big + pickle.MARK + big * 50 + pickle.ADDITEMS)
    started = time.monotonic()
    assert check_case(folder, pickled) == "refused"
    assert time.monotonic() - started < 10


# -- load_into -------------------------------------------------------------------------


def test_load_into_applies_neg_and_conj_bits_as_load_state_dict_does(folder):
    """torch.save records a neg or conj view's bits, not resolved data:
    load_into copied the raw bytes (x for -x, z for conj(z))."""
    x = torch.arange(1.0, 7.0).reshape(2, 3)
    z = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j])
    saved = {"neg": x._neg_view(), "conj": z.conj(), "neg_conj": z.conj()._neg_view(), "plain": x}
    original_save()(saved, folder / "bits.pt")

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k, v in saved.items():
                self.register_buffer(k, torch.zeros_like(v.resolve_conj().resolve_neg()))

    expected = Holder()
    expected.load_state_dict(original_load()(folder / "bits.pt"))
    for target in (Holder(), {k: torch.zeros_like(v) for k, v in expected.state_dict().items()}):
        fastpersist.load_into(target, folder / "bits.pt")
        got = target.state_dict() if isinstance(target, torch.nn.Module) else target
        for k, v in expected.state_dict().items():
            assert torch.equal(got[k], v), k
    assert torch.equal(expected.neg, -x) and torch.equal(expected.conj, z.conj().resolve_conj())


def nested_shared(depth: int, leaf):
    node = leaf
    for _ in range(depth):
        node = {"a": node, "b": node}
    return node


def test_load_into_refuses_shared_containers_that_expand_past_the_file(folder):
    """{"a": D, "b": D} nested 40 deep: 2**40 key paths (torch.load reads it
    in milliseconds); load_into walked every one until memory ran out."""
    original_save()({"x": torch.zeros(4), "d": nested_shared(40, {"t": torch.ones(2)})}, folder / "dag.pt")
    assert original_load()(folder / "dag.pt")["x"].shape == (4,)
    target = {"x": torch.zeros(4)}
    started = time.monotonic()
    with pytest.raises(fastpersist.CheckpointError, match="shared containers expand"):
        fastpersist.load_into(target, folder / "dag.pt", strict=False)
    assert time.monotonic() - started < 10
    assert torch.equal(target["x"], torch.zeros(4))


def test_load_into_fills_every_key_of_a_shared_container(folder):
    """Sharing within bounds keeps its meaning: each key path gets its leaf."""
    sd = {"w": torch.arange(3.0), "b": torch.tensor([5.0])}
    original_save()({"model": sd, "ema": sd, "deep": nested_shared(3, sd)}, folder / "shared.pt")
    target = {"model": {"w": torch.zeros(3), "b": torch.zeros(1)}, "ema": {"w": torch.zeros(3), "b": torch.zeros(1)},
              "deep": nested_shared(3, {"w": torch.zeros(3), "b": torch.zeros(1)})}
    fastpersist.load_into(target, folder / "shared.pt")
    assert torch.equal(target["ema"]["w"], sd["w"]) and torch.equal(target["deep"]["a"]["b"]["a"]["b"], sd["b"])


def test_load_into_looks_at_shared_tuples_once(folder):
    """(v, v) nested 100 deep: _holds_tensors walked all 2**100 paths to
    find no tensor. Looked at once each, the value is restored as it is."""
    value = 1
    for _ in range(100):
        value = (value, value)
    original_save()({"x": torch.zeros(4), "pair": value}, folder / "pairs.pt")
    target = {"x": torch.zeros(4), "pair": None}
    started = time.monotonic()
    fastpersist.load_into(target, folder / "pairs.pt")
    assert time.monotonic() - started < 10
    got = target["pair"]
    for _ in range(100):  # (== would compare all 2**100 paths)
        assert type(got) is tuple and got[0] is got[1]
        got = got[0]
    assert got == 1


def test_load_into_refuses_a_container_holding_itself(folder):
    pickled = program(pickle.EMPTY_DICT + pickle.BINPUT + b"\x00" + text("self") + pickle.BINGET + b"\x00"
                      + pickle.SETITEM)
    write_archive(folder / "cycle.pt", pickled)
    assert check_case(folder, pickled) == "loaded"
    with pytest.raises(fastpersist.CheckpointError, match="holds itself"):
        fastpersist.load_into({"self": {}}, folder / "cycle.pt")


# -- records read more than once ---------------------------------------------------------


def test_a_big_endian_record_read_under_two_keys_is_swapped_once_for_each(folder):
    """miniz finds records whatever their ASCII case, so keys "ab", "AB" and
    "Ab" all read record data/ab. torch.load reads each key into memory of
    its own and swaps it there; fastpersist handed out slices of one image,
    swapped in place once per key (so twice, as torch.load(mmap=True) does),
    and load_into swapped the record once, by the first key's dtype."""
    values = [1.0, -2.0, 3.5, 4.25]
    records = {"ab": struct.pack(">4f", *values)}  # a big-endian file: its storages are big-endian
    pickled = program(state(a=tensor("ab"), b=tensor("AB"),
                            c=tensor("Ab", numel=8, size=(8,), stride=(1,), storage="ShortStorage")))
    path = folder / "case.pt"
    assert check_case(folder, pickled, records, byteorder=b"big", fastpersist_loads={
        "fastpersist.load": lambda: fastpersist.load(path),
        "fastpersist.load(verify=True)": lambda: fastpersist.load(path, verify=True),
        "fastpersist.load(weights_only=False)": lambda: fastpersist.load(path, weights_only=False),
    }) == "loaded"
    expected = original_load()(path)
    assert expected["a"].tolist() == values and expected["b"].tolist() == values
    assert expected["c"].tolist() == list(struct.unpack(">8h", records["ab"]))
    target = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(8, dtype=torch.int16)}
    fastpersist.load_into(target, path)
    assert same_values(target, expected)


def test_an_empty_record_read_as_two_dtypes_gives_each_its_own(folder):
    """An empty storage has no data pointer, so torch.load shares it with no
    other reference: each takes the dtype it is read as. An empty slice of
    fastpersist's image pointed into it and was shared (the first's dtype)."""
    pickled = program(state(f=tensor("0", numel=0, size=(0,)),
                            i=tensor("0", numel=0, size=(0,), storage="LongStorage")))
    assert check_case(folder, pickled, {"0": b""}) == "loaded"
    assert fastpersist.load(folder / "case.pt")["i"].dtype == torch.int64
    assert fastpersist.load(folder / "case.pt", weights_only=False)["i"].dtype == torch.int64


SIXTEEN = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)


@pytest.mark.parametrize("stored", [
    pytest.param(state(s=tensor(numel=1, size=(), stride=())), id="a 0-d tensor over 16 bytes"),
    pytest.param(state(s=tensor(numel=0, size=(0,))), id="an empty tensor over 16 bytes"),
    pytest.param(state(s=tensor(numel=1, size=(), stride=()) + pickle.TUPLE1), id="in a tuple"),
    pytest.param(NEW_ORDERED_DICT + text("s") + tensor(numel=1, size=(), stride=()) + pickle.SETITEM,
                 id="in an OrderedDict"),
])
def test_load_into_checks_the_records_of_tensors_it_does_not_restore(folder, stored):
    """torch.load reads every storage's record and refuses one whose size is
    not the pickle's; load_into checked only those of the tensors it
    restores, so with strict=False it loaded what torch refuses."""
    pickled = program(stored)
    assert check_case(folder, pickled, {"0": SIXTEEN}) == "refused"
    target = {"x": torch.zeros(4)}
    with pytest.raises(fastpersist.CheckpointError, match="holds 16 bytes"):
        fastpersist.load_into(target, folder / "case.pt", strict=False)
    assert torch.equal(target["x"], torch.zeros(4))


def test_load_into_reads_a_key_as_torch_does_at_its_first_reference(folder):
    """torch.load reads a key's record once, at its first reference; later
    ones share that storage and its dtype, whatever size or dtype they name."""
    pickled = program(state(a=tensor(), b=tensor(numel=1, size=(), stride=()), c=tensor(storage="IntStorage")))
    assert check_case(folder, pickled, {"0": SIXTEEN}) == "loaded"
    expected = original_load()(folder / "case.pt")
    assert expected["c"].dtype == torch.float32
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    fastpersist.load_into(target, folder / "case.pt")
    assert same_values(target, expected)
    with pytest.raises(RuntimeError, match="dtype mismatch for c"):  # not the float bytes read as int32
        fastpersist.load_into({"c": torch.zeros(4, dtype=torch.int32)}, folder / "case.pt", strict=False)


def _tensor_args(offset: bytes, requires_grad: bytes, storage: str = "FloatStorage", numel: int = 4) -> bytes:
    storage_id = pickle.MARK + text("storage") + glob("torch", storage) + text("0") + text("cpu") + small(numel) \
        + pickle.TUPLE + pickle.BINPERSID
    size = ints((numel,)) if numel else ints((0,))
    return REBUILD + pickle.MARK + storage_id + offset + size + ints((1,)) + requires_grad \
        + NEW_ORDERED_DICT + pickle.TUPLE + pickle.REDUCE


@pytest.mark.parametrize("case", ["int_requires_grad", "int_parameter_requires_grad", "offset_past_int64"])
def test_load_into_refuses_what_torch_refuses_in_a_tensors_arguments(folder, case):
    """load_into's layout reads a tensor's arguments without building it; what
    torch's rebuild refuses (an integer tensor requiring grad, an offset past
    int64) must be refused there too, the target untouched."""
    if case == "int_requires_grad":
        value, target = _tensor_args(small(0), pickle.NEWTRUE, "LongStorage", 2), torch.zeros(2, dtype=torch.int64)
        records = {"0": struct.pack("<2q", 5, 6)}
    elif case == "int_parameter_requires_grad":
        value = glob("torch._utils", "_rebuild_parameter") + pickle.MARK \
            + _tensor_args(small(0), pickle.NEWFALSE, "LongStorage", 2) + pickle.NEWTRUE + NEW_ORDERED_DICT \
            + pickle.TUPLE + pickle.REDUCE
        target, records = torch.zeros(2, dtype=torch.int64), {"0": struct.pack("<2q", 5, 6)}
    else:
        value, target = _tensor_args(pickle.dumps(2**64, 2)[2:-1], pickle.NEWFALSE, numel=0), torch.zeros(0)
        records = {"0": b""}
    write_archive(folder / "c.pt", program(state(w=value)), records)
    with pytest.raises(Exception) as theirs:
        original_load()(folder / "c.pt", weights_only=True)
    holder = {"w": target}
    with pytest.raises(Exception) as ours:
        fastpersist.load_into(holder, folder / "c.pt")
    assert type(ours.value) is type(theirs.value) or isinstance(ours.value, fastpersist.CheckpointError), \
        (ours.value, theirs.value)
    assert not holder["w"].any()
