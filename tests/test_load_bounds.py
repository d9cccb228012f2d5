"""Every storage a load builds tensors over is its record's, fixed in size,
and its own: a view reaching past its record is refused as torch.load
refuses it (never grown over uninitialized process memory), and keys that
name one record's bytes get copies of their own, as torch's reader gives
them. Each case is a file torch's own zip writer lays out around a
hand-written data.pkl, loaded by every fastpersist path and by the real
torch.load."""
import importlib
import pickle
import struct

import pytest
import torch

import fastpersist
from fastpersist.patching import original_load
from test_load_trust import RECORD, program, state, tensor, write_archive

load_module = importlib.import_module("fastpersist.load")  # the module, not the function of its name

# Bytes no record of these files holds: a tensor that shows them was grown past its record
SECRET = b"SECRET=hunter2;" * 64


def _paths(path):
    """Each way a checkpoint reaches fastpersist's loads."""
    return {
        "fastpersist.load": lambda: fastpersist.load(path),
        "weights_only=False": lambda: fastpersist.load(path, weights_only=False),
        "patched torch.load": lambda: torch.load(path),
        "callable map_location": lambda: fastpersist.load(path, map_location=lambda s, loc: s),
        "map_location=cpu": lambda: fastpersist.load(path, map_location="cpu"),
        "verify=True": lambda: fastpersist.load(path, verify=True),
    }


def _outcome(load):
    try:
        return "loaded", load()
    except Exception as exc:  # noqa: BLE001 - whatever either side raises
        return "refused", exc


def _bytes_of(value) -> bytes:
    """Every byte the tensors of a loaded state can show."""
    out = b""
    for t in value.values():
        s = t.untyped_storage()
        out += bytes(torch.empty(0, dtype=torch.uint8).set_(s).numpy().tobytes()) if s.nbytes() else b""
    return out


def _leave_secrets_behind():
    """Freed memory holding SECRET, for a grown storage to pick up."""
    held = [torch.frombuffer(bytearray(SECRET * 4), dtype=torch.uint8).clone() for _ in range(64)]
    del held


def _huge_view() -> bytes:
    """A tensor of 2**28 floats (1 GiB) over a 16-byte record."""
    small_dims = tensor(numel=4, size=(1,), stride=(1,))
    dims = lambda v: pickle.MARK + pickle.BININT + struct.pack("<i", v) + pickle.TUPLE  # noqa: E731
    head = small_dims.index(pickle.MARK + pickle.BININT1 + b"\x01" + pickle.TUPLE)
    rest = small_dims[head:].replace(pickle.MARK + pickle.BININT1 + b"\x01" + pickle.TUPLE, b"", 2)
    return small_dims[:head] + dims(1 << 28) + dims(1) + rest


# (pickle, records): each view reaches past its record, so torch refuses the file
PAST_RECORD = {
    "64 floats over a 16-byte record": (tensor(numel=4, size=(64,)), None),
    "offset past the end": (tensor(numel=4, size=(1,)).replace(b"K\x00", b"K\x04", 1), None),
    "a stride past the end": (tensor(numel=4, size=(2,), stride=(4,)), None),
    "any view over an empty record": (tensor(numel=0, size=(4,)), {"0": b""}),
    "1 GiB over a 16-byte record": (_huge_view(), None),
}


@pytest.mark.parametrize("case", sorted(PAST_RECORD))
@pytest.mark.parametrize("stream", [False, True], ids=["image", "through-buffers"])
def test_a_view_past_its_record_is_refused_as_torch_refuses_it(folder, monkeypatch, case, stream):
    body, records = PAST_RECORD[case]
    path = folder / "past.pt"
    write_archive(path, program(state(w=body)), records)
    theirs, their_error = _outcome(lambda: original_load()(path, weights_only=True))
    assert theirs == "refused" and "not resizable" in str(their_error)
    monkeypatch.setattr(load_module, "STREAM_LOADS", stream)  # the GPU path's restore, taken on the CPU
    for what, load in _paths(path).items():
        _leave_secrets_behind()
        ours, value = _outcome(load)
        assert ours == "refused", f"{what} loaded {value}: {_bytes_of(value)[:64]!r}"
        assert type(value) is type(their_error) and str(value) == str(their_error), what
    with pytest.raises(Exception):
        fastpersist.load_into({"w": torch.zeros(64)}, path)


def test_a_view_past_its_record_is_refused_record_by_record(folder, monkeypatch):
    """A file mostly outside its records is read a record at a time into storages of their own."""
    body, _ = PAST_RECORD["64 floats over a 16-byte record"]
    path = folder / "holes.pt"
    write_archive(path, program(state(w=body)))
    monkeypatch.setattr(load_module._CheckpointImage, "MOST_OUTSIDE_RECORDS", 1)
    assert load_module._CheckpointImage.open(str(path), fastpersist.options.current_options()).mostly_outside_records()
    for what, load in _paths(path).items():
        _leave_secrets_behind()
        ours, value = _outcome(load)
        assert ours == "refused" and "not resizable" in str(value), f"{what}: {value!r}"


def test_views_within_their_records_load_with_the_records_bytes(folder):
    """The mend refuses only what torch refuses: views up to the record's last byte load."""
    records = {"0": RECORD, "1": b""}
    pickled = program(state(edge=tensor(numel=4, size=(2, 2), stride=(2, 1)),
                            strided=tensor(numel=4, size=(2,), stride=(3,)),
                            none=tensor(key="1", numel=0, size=(0,))))
    path = folder / "edge.pt"
    write_archive(path, pickled, records)
    theirs = original_load()(path, weights_only=True)
    for what, load in _paths(path).items():
        ours = load()
        for k in theirs:
            assert torch.equal(ours[k], theirs[k]) and ours[k].stride() == theirs[k].stride(), (what, k)
            assert not ours[k].untyped_storage().resizable(), (what, k)


# -- keys naming one record's bytes ----------------------------------------------------------

def _two_keys(first: str, second: str) -> bytes:
    return program(state(a=tensor(key=first), b=tensor(key=second)))


@pytest.mark.parametrize("keys", [("a", "A"), ("0", "0\x00z")], ids=["ascii-case", "c-string"])
def test_two_keys_naming_one_record_get_storages_of_their_own(folder, keys):
    path = folder / "alias.pt"
    write_archive(path, _two_keys(*keys), {keys[0]: RECORD})
    theirs = original_load()(path, weights_only=True)
    assert theirs["a"].data_ptr() != theirs["b"].data_ptr()  # torch's reader: a copy for each key
    for what, load in _paths(path).items():
        ours = load()
        assert torch.equal(ours["a"], theirs["a"]) and torch.equal(ours["b"], theirs["b"]), what
        assert ours["a"].untyped_storage().data_ptr() != ours["b"].untyped_storage().data_ptr(), what
        ours["a"].add_(1)  # one key's tensor written: the other's stays the file's
        assert torch.equal(ours["b"], theirs["b"]), what


def _second_directory_entry(path, name: str, as_name: str) -> None:
    """Adds a central-directory entry as_name that points at name's local
    header (after the last entry; the zip64 end records, which torch's
    writer adds, and the end record counted and moved to match)."""
    raw = bytearray(path.read_bytes())
    eocd = raw.rindex(b"PK\x05\x06")
    zip64 = raw.rfind(b"PK\x06\x06", 0, eocd)
    if zip64 >= 0:
        n_total, cd_size, cd_offset = struct.unpack_from("<QQQ", raw, zip64 + 32)
    else:
        n_total, cd_size, cd_offset = struct.unpack_from("<xxHII", raw, eocd + 8)
    at, entry = cd_offset, None
    while at < cd_offset + cd_size:
        n, extra, comment = struct.unpack_from("<HHH", raw, at + 28)
        if raw[at + 46:at + 46 + n].decode() == name:
            entry = bytes(raw[at:at + 46 + n + extra + comment])
        at += 46 + n + extra + comment
    assert entry is not None and len(as_name) == len(name)
    n = struct.unpack_from("<H", entry, 28)[0]
    added = entry[:46] + as_name.encode() + entry[46 + n:]
    cd_end = cd_offset + cd_size
    if zip64 >= 0:
        struct.pack_into("<QQQ", raw, zip64 + 24, n_total + 1, n_total + 1, cd_size + len(added))
        locator = raw.rindex(b"PK\x06\x07", 0, eocd)
        struct.pack_into("<Q", raw, locator + 8, zip64 + len(added))
    counts = struct.unpack_from("<HH", raw, eocd + 8)
    if counts[1] != 0xFFFF:
        struct.pack_into("<HH", raw, eocd + 8, counts[0] + 1, counts[1] + 1)
    if struct.unpack_from("<I", raw, eocd + 12)[0] != 0xFFFFFFFF:
        struct.pack_into("<I", raw, eocd + 12, cd_size + len(added))
    path.write_bytes(bytes(raw[:cd_end]) + added + bytes(raw[cd_end:]))


def test_two_directory_entries_on_one_local_header_get_storages_of_their_own(folder):
    path = folder / "twice.pt"
    write_archive(path, _two_keys("0", "1"), {"0": RECORD})
    _second_directory_entry(path, "twice/data/0", "twice/data/1")
    theirs, their_value = _outcome(lambda: original_load()(path, weights_only=True))
    for what, load in _paths(path).items():
        ours, value = _outcome(load)
        assert ours == theirs, f"{what}: {value!r} / {their_value!r}"
        if ours == "loaded":
            assert torch.equal(value["a"], their_value["a"]) and torch.equal(value["b"], their_value["b"]), what
            assert value["a"].untyped_storage().data_ptr() != value["b"].untyped_storage().data_ptr(), what


def test_one_key_shared_by_tensors_still_shares_its_storage(folder):
    """Tensors of one key share one storage in torch's result, and in fastpersist's (no copy made)."""
    path = folder / "shared.pt"
    write_archive(path, program(state(a=tensor(key="0"), b=tensor(key="0", size=(2,)))))
    for what, load in _paths(path).items():
        ours = load()
        assert ours["a"].untyped_storage().data_ptr() == ours["b"].untyped_storage().data_ptr(), what
