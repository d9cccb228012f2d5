"""The engine's C scan (fp_pickle_scan, behind _state_pickle.admits) decides
as the rules written in Python (_state_pickle.admits_here) decide: on real
state dict pickles, on every truncation and on mutations of them, and on
generated opcode sequences."""
import pickle
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpersist import _engine, _state_pickle

from corpus import corpus, torch_pickle


def _state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "params": list(model.parameters()),
            "big": {f"t{i}": torch.ones(1) for i in range(40)}, "lists": [list(range(5))] * 2, "none": None}


PICKLES = {name: torch_pickle(obj) for name, obj in [*corpus().items(), ("state", _state())]}


def agree(data: bytes) -> bool:
    here = _state_pickle.admits_here(data)
    c_scan = _engine.pickle_scan(data, _state_pickle._GLOBALS_TABLE, _state_pickle._BUILD_ORDERED_DICT)
    assert c_scan == here, data
    assert _state_pickle.admits(data) == here  # whichever form it takes
    return here


@pytest.mark.parametrize("name", PICKLES)
def test_real_pickles(name):
    agree(PICKLES[name])


def test_state_dicts_are_admitted():
    assert agree(PICKLES["state"]) and agree(PICKLES["state_dict"]) and agree(PICKLES["optimizer"])
    assert not agree(PICKLES["storage"])  # a bare storage: torch's path


@pytest.mark.parametrize("name", ["state", "state_dict", "nested"])
def test_every_truncation(name):
    data = PICKLES[name]
    for end in range(len(data)):
        assert not agree(data[:end])


@pytest.mark.parametrize("seed", range(4))
def test_mutations(seed):
    rng = random.Random(seed)
    data = PICKLES["state"]
    admitted = 0
    for _ in range(1500):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            what = rng.random()
            at = rng.randrange(len(b))
            if what < 0.5:
                b[at] = rng.randrange(256)
            elif what < 0.75:
                del b[at:at + rng.randint(1, 4)]
            else:
                b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        admitted += agree(bytes(b))
    assert admitted  # some mutations (in a string, a number) keep a state dict's shape


_OPCODES = [pickle.MARK, pickle.STOP, pickle.BININT1 + b"\x05", pickle.BININT2 + b"\x01\x02",
            pickle.BINUNICODE + b"\x01\x00\x00\x00a", pickle.BINPUT + b"\x00", pickle.BINPUT + b"\x01",
            pickle.BINGET + b"\x00", pickle.LONG_BINPUT + b"\x02\x00\x00\x00", pickle.LONG_BINGET + b"\x01\x00\x00\x00",
            pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3, pickle.EMPTY_TUPLE, pickle.EMPTY_DICT,
            pickle.EMPTY_LIST, pickle.SETITEM, pickle.SETITEMS, pickle.APPEND, pickle.APPENDS, pickle.BUILD,
            pickle.REDUCE, pickle.BINPERSID, pickle.NONE, pickle.NEWTRUE, pickle.BINFLOAT + bytes(8),
            pickle.LONG1 + b"\x01\x05", pickle.SHORT_BINSTRING + b"\x01a", pickle.POP, b"\xff",
            b"ccollections\nOrderedDict\n", b"ctorch._utils\n_rebuild_tensor_v2\n", b"ctorch\nFloatStorage\n",
            b"ctorch._utils\n_rebuild_parameter\n", b"cbuiltins\neval\n", b"c\n\n"]


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.sampled_from(_OPCODES), max_size=40), st.booleans())
def test_generated_opcode_sequences(ops, proto):
    agree((b"\x80\x02" if proto else b"") + b"".join(ops))


def test_a_tensor_built_by_hand_is_admitted_and_a_stray_build_is_not():
    tensor = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00((X\x07\x00\x00\x00storageq\x01ctorch\nFloatStorage\n"
              b"q\x02X\x01\x00\x00\x000q\x03X\x03\x00\x00\x00cpuq\x04K\x01tq\x05QK\x00K\x01\x85q\x06K\x01\x85q\x07"
              b"\x89ccollections\nOrderedDict\nq\x08)Rq\x09tq\x0aRq\x0b.")
    assert agree(tensor)
    # BUILD on the rebuild function (it would set attributes on it for the whole process)
    assert not agree(tensor[:-1] + b"h\x00}b.")
    assert not agree(b"\x80\x02ccollections\nOrderedDict\n}b.")


# -- BUILD: once, on a new OrderedDict ---------------------------------------------------
# CPython's BUILD looks __setstate__ up on the instance and calls it; torch's
# updates the OrderedDict's __dict__. A first BUILD can set __setstate__
# (to a global the pickle may name), and a second BUILD on the same object
# then runs it in the C unpickler where torch would set attributes.

def _build_cases():
    from test_load_trust import NEW_ORDERED_DICT, ORDERED_DICT, REBUILD, glob, program, small, state, tensor, text

    metadata = state(_metadata=NEW_ORDERED_DICT + text("") + state(version=small(1)) + pickle.SETITEM)
    items = pickle.MARK + text("w") + tensor() + pickle.SETITEMS
    sets = {"the OrderedDict class": ORDERED_DICT, "_rebuild_tensor_v2": REBUILD,
            "a storage class": glob("torch", "FloatStorage")}
    twice = {f"BUILD twice, the first setting __setstate__ to {name}":
             program(NEW_ORDERED_DICT + pickle.BINPUT + b"\x00" + items + state(__setstate__=value) + pickle.BUILD
                     + metadata + pickle.BUILD)
             for name, value in sets.items()}
    twice["BUILD again through the memo"] = program(state(
        a=NEW_ORDERED_DICT + pickle.BINPUT + b"\x00" + items + state(__setstate__=ORDERED_DICT) + pickle.BUILD,
        b=pickle.BINGET + b"\x00" + metadata + pickle.BUILD))
    twice["BUILD on a memo's reference to a new OrderedDict"] = program(state(
        a=NEW_ORDERED_DICT + pickle.BINPUT + b"\x00", b=pickle.BINGET + b"\x00" + metadata + pickle.BUILD))
    once = {
        "a state dict as torch.save writes it": program(NEW_ORDERED_DICT + pickle.BINPUT + b"\x00" + items
                                                        + metadata + pickle.BUILD),
        "one BUILD whose state holds __setstate__": program(NEW_ORDERED_DICT + items + state(__setstate__=ORDERED_DICT)
                                                            + pickle.BUILD),
        "one BUILD whose state has keys that are not strings": program(
            NEW_ORDERED_DICT + pickle.EMPTY_DICT + pickle.MARK + small(1) + small(2) + pickle.NONE + small(3)
            + pickle.SETITEMS + pickle.BUILD),
        "one BUILD setting __dict__ and __class__": program(NEW_ORDERED_DICT + state(__dict__=state(x=small(1)),
                                                                                    __class__=ORDERED_DICT)
                                                            + pickle.BUILD),
        "a None state": program(NEW_ORDERED_DICT + pickle.NONE + pickle.BUILD),
    }
    return twice, once


BUILD_TWICE, BUILD_ONCE = _build_cases()


@pytest.mark.parametrize("name", list(BUILD_TWICE))
def test_a_second_build_on_one_ordered_dict_goes_to_torch(folder, name):
    from test_load_trust import check_case

    check_case(folder, BUILD_TWICE[name])
    assert not agree(BUILD_TWICE[name])


@pytest.mark.parametrize("name", list(BUILD_ONCE))
def test_one_build_on_a_new_ordered_dict_loads_as_torch_loads_it(folder, name):
    from test_load_trust import check_case

    agree(BUILD_ONCE[name])
    check_case(folder, BUILD_ONCE[name])


def test_torch_saves_state_dicts_are_still_admitted_after_the_build_rule(folder):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.LayerNorm(2)))
    for obj in [model.state_dict(), {"a": model.state_dict(), "b": model.state_dict()},
                [model.state_dict()] * 2]:
        assert agree(torch_pickle(obj))
