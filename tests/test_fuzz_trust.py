"""A mutation fuzzer over data.pkl: fastpersist.load against
torch.load(weights_only=True), archives rewritten by torch's own zip writer
so every CRC-32 is right.

Seeds are state-dict pickles as torch.save writes them and the hostile
corpus of test_load_trust; hypothesis splices in opcodes (the ones torch
implements and the ones it does not), overwrites, deletes and duplicates
bytes. Required of every example: the same decision (loaded or refused),
the same values where both load, the process unchanged.

CI runs FASTPERSIST_TRUST_FUZZ_EXAMPLES examples (300 by default, about
10 s); a long run:

    FASTPERSIST_TRUST_FUZZ_EXAMPLES=10000 python3 -m pytest -q tests/test_fuzz_trust.py -p no:cacheprovider
"""
import os
import pickle
import zipfile
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastpersist
from fastpersist.patching import original_load, original_save

from test_load_trust import (ACCEPTED, HOSTILE, UNIMPLEMENTED, outcome, process_state, program, same_values,
                             small, tensor, text, write_archive)

EXAMPLES = int(os.environ.get("FASTPERSIST_TRUST_FUZZ_EXAMPLES", "300"))


def torch_saved_pickles(folder) -> list:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    pickles = []
    for obj in (model.state_dict(), model.state_dict(keep_vars=True), {"a": [1, 2.5, "s"], "b": {"c": None}}):
        original_save()(obj, folder / "seed.pt")
        with zipfile.ZipFile(folder / "seed.pt") as z:
            pickles.append((z.read(next(n for n in z.namelist() if n.endswith("/data.pkl"))),
                            {n.split("/data/")[-1]: z.read(n) for n in z.namelist() if "/data/" in n}))
    return pickles


SNIPPETS = [bytes([op]) for op in b"(tu}]Rbsea.)N\x88\x89\x85\x86\x87QhqjrKMJG\x8a"] + [
    text("storage"), text("w"), small(0), small(4), tensor(), pickle.EMPTY_SET, pickle.NEWOBJ,
    pickle.GLOBAL + b"collections\nOrderedDict\n", pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n",
    pickle.GLOBAL + b"torch._utils\n_rebuild_parameter\n", pickle.GLOBAL + b"torch\nFloatStorage\n",
    pickle.BINPUT + b"\x00", pickle.BINGET + b"\x00", pickle.BINGET + b"\x01", pickle.LONG_BINPUT + b"\xff\xff\x00\x00",
] + [program_body for program_body in UNIMPLEMENTED.values()]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trust_seeds")
    found = torch_saved_pickles(folder)
    records = {"0": b"\x00" * 64}
    found += [(p, records) for p in list(HOSTILE.values()) + list(ACCEPTED.values())]
    found += [(program(body), records) for body in UNIMPLEMENTED.values()]
    return found


@st.composite
def mutated(draw, seeds):
    pickled, records = draw(st.sampled_from(seeds))
    data = bytearray(pickled)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        how = draw(st.sampled_from(["insert", "overwrite", "delete", "duplicate", "byte"]))
        if how == "insert":
            data[at:at] = draw(st.sampled_from(SNIPPETS))
        elif how == "overwrite":
            snippet = draw(st.sampled_from(SNIPPETS))
            data[at:at + len(snippet)] = snippet
        elif how == "delete":
            del data[at:at + draw(st.integers(1, 16))]
        elif how == "duplicate":
            data[at:at] = data[at:at + draw(st.integers(1, 64))]
        elif at < len(data):
            data[at] = draw(st.integers(0, 255))
    return bytes(data), records


@pytest.mark.filterwarnings("ignore")
@settings(max_examples=EXAMPLES, deadline=timedelta(seconds=20), database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fastpersist_decides_as_torch_on_mutated_pickles(seeds, tmp_path_factory, data):
    pickled, records = data.draw(mutated(seeds))
    path = tmp_path_factory.getbasetemp() / "trust_fuzz.pt"
    write_archive(path, pickled, records)
    before = process_state()
    theirs, their_value = outcome(lambda: original_load()(path, weights_only=True))
    ours, our_value = outcome(lambda: fastpersist.load(path))
    assert process_state() == before
    assert ours == theirs, f"fastpersist {ours}, torch {theirs}: {our_value!r} / {their_value!r}\n{pickled!r}"
    if ours == "loaded":
        assert same_values(our_value, their_value), pickled
