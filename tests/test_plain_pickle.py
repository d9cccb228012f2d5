"""plain_pickle writes the pickle torch.save writes, byte for byte, or
declines (None) and torch's own pickling runs: either way the file is torch's."""
import collections
import pickle
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastpersist
from fastpersist import _torch_api, plain_pickle

from corpus import DTYPES, corpus, torch_pickle
from test_format import both, normalized, same_serialization_id  # noqa: F401 (an autouse fixture)


@pytest.fixture(autouse=True, params=["c", "python"])
def implementation(request, monkeypatch):
    """Every test runs with the C writer and with its Python reference."""
    if request.param == "c":
        assert plain_pickle._c is not None, "fastpersist._plain_pickle was not built"
    monkeypatch.setattr(plain_pickle, "IMPLEMENTATION", request.param)
    return request.param


def assert_same_pickle(obj):
    ours = plain_pickle.dump(obj)
    assert ours is not None, "plain data declined"
    assert ours.data == torch_pickle(obj)
    return ours


def model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return model, opt


PLAIN = {
    **{k: v for k, v in corpus().items() if k != "storage"},
    "every_dtype_in_one": [torch.zeros(3, dtype=d) for d in DTYPES],
    "scalars": [None, True, False, 0, 255, 256, 65535, 65536, -1, -2**31, 2**31 - 1, 2**31, -2**31 - 1, 2**64,
                -2**64, 2**2050, 1.5, -0.0, float("inf"), ""],
    "strings": ["x", "ключ", "\ud800", "a" * 300, "cpu", "storage", "latin1", "version"],
    "bytes": [b"", b"abc", bytes(range(256)), "latin1", b"abc"],
    # a one-byte bytes decodes to CPython's cached one-character string: shared with the caller's own
    "one_byte_bytes": ["\x86", b"\x86", b"a", "a", b"\x00", b"\x00"],
    "torch_values": [torch.float32, torch.bfloat16, torch.uint16, torch.device("cpu"), torch.device("cuda", 1),
                     torch.Size([2, 3]), torch.Size([]), torch.float32],
    "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), ((),), ((1, 2),) * 3],
    "batches": {n: list(range(n)) for n in (1, 2, 999, 1000, 1001, 2000, 2001)},
    "dict_batches": [{i: i for i in range(n)} for n in (0, 1, 2, 1000, 1001, 2000)],
    "ordered_batches": [collections.OrderedDict((i, torch.zeros(1)) for i in range(n)) for n in (0, 1, 1000, 1001, 2000)],
    "shared_objects": (lambda x, s: [x, x, s, s, {"k": x}])([1, 2], "a string"),
    "recursive_list": (lambda l: (l.append(l), l)[1])([1]),
    "parameters": [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2), requires_grad=False)],
    "requires_grad": torch.ones(2, requires_grad=True),
    "same_tensor_twice": (lambda t: {"a": t, "b": t, "c": t[1:]})(torch.randn(4)),
    "many_memo_entries": {f"layer.{i}.weight": torch.randn(2) for i in range(300)},
}


@pytest.mark.parametrize("key", PLAIN)
def test_plain_data_pickles_as_torch_does(key):
    assert_same_pickle(PLAIN[key])


def test_model_optimizer_and_trainer_checkpoints():
    model, opt = model_and_optimizer()
    sd = model.state_dict()
    assert getattr(sd, "_metadata", None)  # the OrderedDict attribute is part of the pickle
    assert_same_pickle(sd)
    assert_same_pickle(opt.state_dict())
    assert_same_pickle({"epoch": 3, "global_step": 1200, "state_dict": sd, "optimizer_states": [opt.state_dict()],
                        "lr_schedulers": [{"base_lrs": [1e-3], "last_epoch": 3}], "hparams": {"name": "run"},
                        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None}}})


def test_storage_keys_follow_first_use_and_sharing():
    base = torch.randn(10)
    ours = assert_same_pickle({"a": base[2:], "b": torch.ones(2), "c": base})
    assert list(ours.storages) == ["0", "1"]
    assert ours.storages["0"].data_ptr() == base.untyped_storage().data_ptr()


def test_a_callers_interned_strings_are_shared_as_pickle_shares_them():
    # the interned "cpu" and "storage" are the very objects torch's persistent_id passes
    assert_same_pickle([sys.intern("cpu"), torch.ones(1), sys.intern("storage"), torch.ones(1)])
    assert_same_pickle([torch.ones(1), sys.intern("cpu"), "".join(["c", "pu"])])


class Point:
    def __init__(self, x):
        self.x = x


class Sub(torch.Tensor):
    pass


def _with_attribute():
    t = torch.ones(2)
    t.note = "kept"
    return t


def _with_hook():
    t = torch.ones(2, requires_grad=True)
    t.register_hook(lambda g: g)
    return t


DECLINED = {
    "custom_class": {"p": Point(1)},
    "tensor_subclass": torch.ones(2).as_subclass(Sub),
    "tensor_attribute": _with_attribute(),
    "conj": torch.ones(2, dtype=torch.complex64).conj(),
    "sparse": torch.eye(3).to_sparse(),
    "meta": torch.empty(3, device="meta"),
    "quantized": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
    "storage": torch.arange(3).untyped_storage(),
    "set": {1, 2},
    "defaultdict": collections.defaultdict(list, a=[1]),
    "recursive_tuple": (lambda l: (l.append((l,)), l[0])[1])([]),  # a tuple reached again through its own items
    "function": torch.zeros,
}


@pytest.mark.parametrize("key", DECLINED)
def test_anything_else_is_declined_and_saved_by_torchs_pickling(folder, key):
    obj = DECLINED[key]
    assert plain_pickle.dump(obj) is None
    ref, ours = both(obj, folder)
    assert normalized(ref) == normalized(ours)


def test_a_tensor_with_hooks_warns_as_torch_does(folder):
    t = _with_hook()
    assert plain_pickle.dump(t) is None
    with pytest.warns(UserWarning, match="hook"):
        fastpersist.save(t, folder / "h.pt")


def test_other_protocols_and_pickle_modules_keep_torchs_pickling(folder):
    assert not plain_pickle.applies(__import__("pickle"), 4)
    assert not plain_pickle.applies(__import__("copyreg"), 2)
    obj = {"a": torch.ones(3)}
    ref, ours = both(obj, folder, pickle_protocol=4)
    assert normalized(ref) == normalized(ours)


def test_two_dtypes_over_one_memory_is_torchs_error(folder):
    t = torch.zeros(4)
    obj = [t, t.view(torch.int32)]
    assert plain_pickle.dump(obj) is None
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        fastpersist.save(obj, folder / "x.pt")


@pytest.mark.parametrize("key", ["state_dict", "optimizer", "shared", "dtypes"])
def test_whole_files_equal_torch_saves(folder, key):
    ref, ours = both(corpus()[key], folder)
    assert normalized(ref) == normalized(ours)


def test_the_writer_is_the_one_saving(folder, monkeypatch):
    """A save of plain data goes through plain_pickle (not torch's pickling, which would give the same bytes)."""
    monkeypatch.setattr(_torch_api, "pickle_into", lambda *a, **k: pytest.fail("torch's pickling ran"))
    fastpersist.save({"a": torch.ones(3), "step": 4}, folder / "x.pt")
    assert torch.equal(torch.load(folder / "x.pt")["a"], torch.ones(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_pickle_as_torch_does_and_their_storages_stay_on_the_device(folder):
    device = torch.device("cuda")
    base = torch.randn(10, device=device)
    obj = {"a": base, "b": base[2:], "c": torch.ones(3, dtype=torch.bfloat16, device=device),
           "u": torch.zeros(2, dtype=torch.uint16, device=device), "p": torch.nn.Parameter(torch.ones(2, device=device)),
           "cpu": torch.ones(2), "where": torch.device("cuda", 0)}
    ours = assert_same_pickle(obj)  # locations "cuda:0", a fresh string per storage, as torch writes them
    assert [s.device.type for s in ours.storages.values()] == ["cuda", "cuda", "cuda", "cuda", "cpu"]
    ref, saved = both(obj, folder)
    assert normalized(ref) == normalized(saved)


# -- generated structures ------------------------------------------------------

_leaf_tensors = st.builds(
    lambda dtype, shape, view: (lambda t: t[1:] if view == 1 and t.dim() and t.shape[0] > 1
                                else t.t() if view == 2 and t.dim() == 2 else t)(torch.zeros(shape, dtype=dtype)),
    st.sampled_from(DTYPES), st.lists(st.integers(0, 3), max_size=3).map(tuple), st.integers(0, 2))
_atoms = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                   st.text(max_size=8), st.binary(max_size=8), st.sampled_from([torch.float16, torch.device("cpu"),
                                                                               "cpu", "storage", "version"]),
                   _leaf_tensors)


def _containers(children):
    keys = st.one_of(st.text(max_size=6), st.integers(-5, 300))
    return st.one_of(st.lists(children, max_size=5), st.lists(children, max_size=4).map(tuple),
                     st.dictionaries(keys, children, max_size=5),
                     st.dictionaries(keys, children, max_size=5).map(collections.OrderedDict))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(_atoms, _containers, max_leaves=25))
def test_generated_structures_pickle_as_torch_does(obj):
    assert_same_pickle(obj)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["cpu", "storage", "latin1", "x"]), max_size=6), st.integers(0, 3))
def test_generated_sharing_pickles_as_torch_does(names, n_tensors):
    t = torch.randn(5)
    obj = [sys.intern(n) for n in names] + [t[i:] for i in range(n_tensors)] + [b"q"] + names
    assert_same_pickle(obj)


# -- recursion: where torch's pickling would run out of levels, it runs itself ---------

def _levels_torch_needs(obj) -> int:
    """The fewest recursion levels free at the call with which torch's own
    pickling of obj (torch.serialization._save, as torch.save calls it) returns."""
    limit = sys.getrecursionlimit()
    in_use = limit - plain_pickle._c.headroom(limit)

    def pickles(levels: int) -> bool:
        sys.setrecursionlimit(in_use + 1 + levels)  # 1: this frame
        try:
            torch.serialization._save(obj, plain_pickle._Records(), pickle, 2, True)
            return True
        except RecursionError:
            return False
        finally:
            sys.setrecursionlimit(limit)

    low, high = 1, 20000
    while low < high:
        middle = (low + high) // 2
        if pickles(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _writers_depth(obj) -> int:
    if plain_pickle.IMPLEMENTATION == "c":
        return plain_pickle._c.dump(obj, plain_pickle._c_context())[2]
    writer = plain_pickle._Writer()
    writer.dump(obj)
    return writer.max_depth


def _deep(make, depth, leaf):
    for _ in range(depth):
        leaf = make(leaf)
    return leaf


_LEAVES = {"a tensor": torch.ones(2), "a Parameter": torch.nn.Parameter(torch.ones(2)), "a device": torch.device("cpu"),
           "a size": torch.Size([2]), "bytes": b"ab", "a dtype": torch.float16, "a string": "s", "an int": 1}
DEPTHS = {
    **{f"corpus {k}": PLAIN[k] for k in ("state_dict", "optimizer", "nested", "torch_values", "parameters")},
    **{f"{n} {kind}s of {leaf}": _deep(make, n, value)
       for n in (1, 40) for leaf, value in _LEAVES.items()
       for kind, make in [("dict", lambda x: {"k": x}), ("list", lambda x: [x, 1]), ("tuple", lambda x: (x,)),
                          ("OrderedDict", lambda x: collections.OrderedDict(k=x))]},
}


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="from Python 3.12 on, C calls have a recursion limit of "
                    "their own that sys.setrecursionlimit does not move, so torch's needs cannot be measured by moving "
                    "it; the writer probes both limits there (_has_headroom), and "
                    "test_deep_plain_data_pickles_as_torch_does_or_raises_its_recursion_error checks the outcome")
@pytest.mark.parametrize("key", DEPTHS)
def test_the_margin_covers_torchs_pickling(key):
    """torch's pickling takes at most two levels a container and the margin
    beyond them; measured: a leaf's reduction takes up to ~10."""
    obj = DEPTHS[key]
    depth = _writers_depth(obj)
    needs = _levels_torch_needs(obj)
    assert depth <= needs <= 2 * depth + plain_pickle.HEADROOM_MARGIN // 4, (depth, needs)


def test_plain_data_with_room_to_spare_is_the_writers(monkeypatch):
    monkeypatch.setattr(plain_pickle, "_pickled_by_torch", lambda obj: pytest.fail("torch's pickling ran"))
    for key in ("state_dict", "optimizer", "nested", "batches", "many_memo_entries"):
        assert_same_pickle(PLAIN[key])
    assert_same_pickle(_deep(lambda x: {"k": x}, 100, torch.ones(1)))


@pytest.mark.parametrize("kind", ["dict", "list", "tuple"])
def test_deep_plain_data_pickles_as_torch_does_or_raises_its_recursion_error(kind):
    """An object too deep for torch.save: its RecursionError, where the
    writer (counting one level a container, in C) would have pickled it."""
    make = {"dict": lambda x: {"k": x}, "list": lambda x: [x], "tuple": lambda x: (x,)}[kind]
    limit = sys.getrecursionlimit()
    in_use = limit - plain_pickle._c.headroom(limit)
    deep = _deep(make, (limit - in_use) * 3 // 4, torch.ones(1))
    if kind == "tuple":  # one level a tuple: torch pickles it, the margin sends it to torch's pickling
        assert assert_same_pickle(deep).storages["0"].nbytes() == 4
        return
    with pytest.raises(RecursionError, match="maximum recursion depth exceeded"):
        torch_pickle(deep)
    with pytest.raises(RecursionError, match="maximum recursion depth exceeded"):
        plain_pickle.dump(deep)
