"""load_into's memory is bounded by the checkpoint's pickle, as torch.load's
is: a pickle spells a string once and refers to it in two bytes, so a key
repeated at every level of a deep tree gives key paths far longer than the
file. load_into kept a tuple of keys for every leaf and joined every
unmatched one into its dotted name: a 0.2 MB pickle took 1.4 GB (strict:
3.9 GB, the error listing them all), where torch.load takes 1 MB.

Each load runs in a fresh process that measures its own peak (VmHWM, reset
just before the load)."""
import os
import pickle
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

import fastpersist
from fastpersist.patching import original_load

MEASURE = textwrap.dedent("""
    import gc, sys
    import torch, fastpersist
    path, target_kind, strict = sys.argv[1], sys.argv[2], sys.argv[3] == "strict"

    def peak():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

    if target_kind == "module":
        target = torch.nn.Linear(2, 2)
    elif target_kind == "mirror":  # the checkpoint's own tree: every key matches
        target = torch.load(path, weights_only=True)
    else:
        target = {}
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak counts from here
    before = peak()
    try:
        fastpersist.load_into(target, path, strict=strict)
        outcome = "loaded"
    except Exception as exc:
        outcome = type(exc).__name__
    print(outcome, peak() - before)
""")


def _text(s: str) -> bytes:
    raw = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _put(i: int) -> bytes:
    return pickle.LONG_BINPUT + struct.pack("<I", i)


def _get(i: int) -> bytes:
    return pickle.BINGET + bytes([i]) if i < 256 else pickle.LONG_BINGET + struct.pack("<I", i)


def deep_tree_pickle(depth: int, leaves: int, key_length: int) -> bytes:
    """{"x0": 1, ..., K: {"x0": 1, ..., K: {...}}} ``depth`` levels deep, K
    one string of key_length characters written once and referred to by its
    memo index at every other level: a leaf at level d has a key path of
    d * key_length characters, in about 4 bytes of pickle."""
    names = [f"x{i}" for i in range(leaves)]
    out = [pickle.PROTO + b"\x02", pickle.EMPTY_DICT]
    for level in range(depth):
        out.append(pickle.MARK)
        for i, name in enumerate(names):
            out.append(_text(name) + _put(i) if level == 0 else _get(i))
            out.append(pickle.BININT1 + b"\x01")
        out.append(pickle.SETITEMS)
        out.append(_text("k" * key_length) + _put(leaves) if level == 0 else _get(leaves))
        out.append(pickle.EMPTY_DICT)
    out.append(pickle.SETITEM * depth + pickle.STOP)
    return b"".join(out)


def tuple_key_pickle(length: int, repeats: int) -> bytes:
    """{T: 1, "n": {T: 2}} with T a tuple of one string of ``length``
    characters ``repeats`` times: str(T) is length * repeats characters."""
    t = _text("s" * length) + _put(0)
    t = pickle.MARK + t + _get(0) * (repeats - 1) + pickle.TUPLE + _put(1)
    return (pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + t + pickle.BININT1 + b"\x01" + pickle.SETITEM
            + _text("n") + pickle.EMPTY_DICT + _get(1) + pickle.BININT1 + b"\x02" + pickle.SETITEM + pickle.SETITEM
            + pickle.STOP)


def write_checkpoint(path, pickled: bytes) -> None:
    """A checkpoint with this data.pkl, laid out by torch's own zip writer."""
    writer = torch._C.PyTorchFileWriter(str(path), True, 64)
    writer.write_record("data.pkl", pickled, len(pickled))
    writer.write_record(".format_version", b"1", 1)
    writer.write_record(".storage_alignment", b"64", 2)
    writer.write_record("byteorder", b"little", 6)
    writer.write_end_of_file()


def peak_of_load_into(path, target: str, strict: bool) -> tuple:
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak")
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path), target, "strict" if strict else "loose"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    outcome, extra = out.stdout.split()[-2:]
    return outcome, int(extra)


# (what the load ends in, target, strict, bound): for a pickle of 0.16 MB, names reported within
# 16 MiB + 16 characters a pickle byte (a strict error holds copies of them); before, in order:
# 0.9 GB, 2.5 GB, 0.9 GB and 138 MB
CASES = {
    "unexpected, returned": ("CheckpointError", "dict", False, 64 << 20),  # the names would take 0.8 GB: refused
    "unexpected, in the error": ("RuntimeError", "dict", True, 128 << 20),  # listed as far as they fit
    "a module's unexpected": ("CheckpointError", "module", False, 64 << 20),
    "all matched": ("loaded", "mirror", True, 64 << 20),  # no name made (a tuple of keys per leaf, before)
}


@pytest.mark.parametrize("case", list(CASES))
def test_load_into_of_long_key_paths_takes_memory_bounded_by_the_pickle(tmp_path, case):
    want, target, strict, bound = CASES[case]
    pickled = deep_tree_pickle(depth=400, leaves=100, key_length=100)
    assert len(pickled) < 200_000
    write_checkpoint(tmp_path / "deep.pt", pickled)
    outcome, extra = peak_of_load_into(tmp_path / "deep.pt", target, strict)
    assert extra < bound, f"{extra / 1e6:.0f} MB for a {len(pickled) / 1e6:.2f} MB pickle"
    assert outcome == want


@pytest.mark.parametrize("target", ["dict", "module"])
def test_a_tuple_key_whose_name_is_far_longer_than_the_file_is_never_spelled(tmp_path, target):
    """str() of a tuple of one 100 KB string 1000 times is 100 MB, from 104 KB of pickle."""
    pickled = tuple_key_pickle(100_000, 1000)
    write_checkpoint(tmp_path / "tuple.pt", pickled)
    for strict in (True, False):
        outcome, extra = peak_of_load_into(tmp_path / "tuple.pt", target, strict)
        assert extra < 32 << 20, f"{extra / 1e6:.0f} MB"  # 0.6-0.8 GB before
        assert outcome == ("RuntimeError" if strict else "CheckpointError")


def test_the_error_lists_the_names_that_fit_and_counts_the_rest(tmp_path):
    pickled = deep_tree_pickle(depth=400, leaves=100, key_length=100)
    write_checkpoint(tmp_path / "deep.pt", pickled)
    with pytest.raises(RuntimeError) as error:
        fastpersist.load_into({}, tmp_path / "deep.pt")
    message = str(error.value)
    assert message.count("\n") == 1 and message.split("\n\t")[1].startswith('Unexpected key(s) in state_dict: "x0", "x1"')
    listed = message.count('", "') + 1
    assert 1000 < listed < 40_000 and f"and {40_000 - listed:,} more, whose names would take more than" in message
    with pytest.raises(fastpersist.CheckpointError, match="40,000 unexpected keys take more than"):
        fastpersist.load_into({}, tmp_path / "deep.pt", strict=False)


def test_a_tree_deeper_than_the_interpreters_recursion_is_matched(tmp_path):
    """2000 levels: the walk recursed, and raised RecursionError."""
    pickled = deep_tree_pickle(depth=2000, leaves=1, key_length=1)
    write_checkpoint(tmp_path / "deeper.pt", pickled)
    result = fastpersist.load_into({}, tmp_path / "deeper.pt", strict=False)
    assert result.missing_keys == []
    assert result.unexpected_keys == [".".join(["k"] * level + ["x0"]) for level in range(2000)]
    target = original_load()(tmp_path / "deeper.pt")
    node = target
    for _ in range(2000):
        node["x0"] = 0
        node = node["k"]
    result = fastpersist.load_into(target, tmp_path / "deeper.pt")
    assert result == ([], []) and target["k"]["k"]["x0"] == 1
    # a module's names, matched part by part through the tree
    module = torch.nn.Module()
    module.register_buffer("k", torch.zeros(()))
    result = fastpersist.load_into(module, tmp_path / "deeper.pt", strict=False)
    assert result.missing_keys == ["k"] and len(result.unexpected_keys) == 2000


def test_a_module_matches_nested_and_dotted_keys_as_their_joined_names(tmp_path):
    """{"0": {"weight": w}} and {"0.weight": w} both name 0.weight; a key
    with dots inside a nested dict ("1": {"0.bias": b}) too; where two
    spell one name, the last one's tensor is restored (as a flat dict of
    the joined names would hold it), named once."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(3, 1)))
    w0, b0 = torch.randn(3, 2), torch.randn(3)
    w1, b1, other = torch.randn(1, 3), torch.randn(1), torch.randn(1)
    stored = {"0": {"weight": w0, "bias": torch.zeros(3)}, "0.bias": b0, "1": {"0": {"weight": w1}, "0.bias": other},
              "1.0.bias": b1, "extra": {"2": [torch.ones(1)]}}
    fastpersist.save(stored, tmp_path / "nested.pt")
    result = fastpersist.load_into(model, tmp_path / "nested.pt", strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["extra.2.0"]
    assert torch.equal(model[0].weight, w0) and torch.equal(model[0].bias, b0)
    assert torch.equal(model[1][0].weight, w1) and torch.equal(model[1][0].bias, b1)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra.2.0"\.'):
        fastpersist.load_into(model, tmp_path / "nested.pt")
