"""fastpersist's safetensors loads decide as safetensors' own do: the headers
safetensors' parser (serde_json, then safetensors' checks) accepts load
with the same tensors and metadata, the rest are refused with a
SafetensorsFileError naming the problem; devices other than the CPU and
CUDA go to safetensors' own functions. The oracle is the installed
safetensors itself, unpatched: each case, and a differential fuzz over
generated headers (FASTPERSIST_FUZZ_CASES sets how many; a few hundred by
default)."""
import os
import random
import struct
import time

import pytest
import torch

st = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
import safetensors  # noqa: E402

import fastpersist  # noqa: E402
from fastpersist import safetensors as fst  # noqa: E402
from fastpersist.safetensors import SafetensorsFileError  # noqa: E402

# safetensors' own functions, whatever the patch has done to the names (tests start unpatched: conftest)
ORIGINAL_LOAD_FILE = getattr(st, "_fastpersist_original_load_file", st.load_file)
ORIGINAL_SAFE_OPEN = getattr(safetensors, "_fastpersist_original_safe_open", safetensors.safe_open)
ORIGINAL_LOAD = st.load  # never patched: safetensors' Rust deserialize and its torch views


def _file(header, data: bytes = b"") -> bytes:
    """A safetensors file's bytes: the header (text, or bytes as they are)
    after its 8-byte length, then data."""
    if isinstance(header, str):
        header = header.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(header)) + header + data


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _outcome(call):
    """("refused", exception) or ("accepted", {name: (dtype, shape, bytes)}, metadata)."""
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - any refusal; which kind is compared by the callers
        return "refused", exc
    tensors, metadata = result if isinstance(result, tuple) else (result, None)
    return "accepted", {k: (v.dtype, tuple(v.shape), _raw(v)) for k, v in tensors.items()}, metadata


def _opened(opener, path):
    with opener(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _decisions(path: str, data: bytes) -> dict:
    """Each loader's outcome for one file: safetensors' load_file, load and
    safe_open, and fastpersist's."""
    assert not fastpersist.patching.safetensors_patched()
    return {
        "theirs load_file": _outcome(lambda: ORIGINAL_LOAD_FILE(path)),
        "theirs safe_open": _outcome(lambda: _opened(ORIGINAL_SAFE_OPEN, path)),
        "theirs load": _outcome(lambda: ORIGINAL_LOAD(data)),
        "ours load_file": _outcome(lambda: fst.load_file(path)),
        "ours safe_open": _outcome(lambda: _opened(fst.safe_open, path)),
        "ours load": _outcome(lambda: fst.load(data)),
    }


def _known_gap_of_their_load(decisions: dict) -> bool:
    """Where safetensors' own load(bytes) refuses what its load_file loads,
    for reasons of its own Python side (not its parser): its dtype table
    lacks F4 and F8_E8M0 (KeyError), and it makes an empty tensor with
    torch.empty, whose contiguous strides can overflow where load_file's view
    does not. fastpersist's load decides as load_file does."""
    theirs = decisions["theirs load"]
    if theirs[0] != "refused" or decisions["theirs load_file"][0] != "accepted":
        return False
    exc = theirs[1]
    return (isinstance(exc, KeyError) and exc.args[0] in ("F4", "F8_E8M0")) or \
        (isinstance(exc, RuntimeError) and "Stride calculation overflowed" in str(exc))


def _same_decisions(decisions: dict) -> list:
    """The ways fastpersist's loads differ from safetensors' load_file (and
    its safe_open for the metadata): [] where they agree."""
    reference = decisions["theirs load_file"]
    problems = []
    if decisions["theirs load"][0] != reference[0] and not _known_gap_of_their_load(decisions):
        problems.append(f"safetensors disagrees with itself: load {decisions['theirs load']!r}, "
                        f"load_file {reference!r}")
    for name in ("ours load_file", "ours safe_open", "ours load"):
        ours = decisions[name]
        if ours[0] != reference[0]:
            problems.append(f"{name}: {ours!r}, safetensors: {reference!r}")
        elif ours[0] == "refused" and not isinstance(ours[1], SafetensorsFileError):
            problems.append(f"{name} refused with {type(ours[1]).__name__}: {ours[1]}, not a SafetensorsFileError")
        elif ours[0] == "accepted" and ours[1] != reference[1]:
            problems.append(f"{name}: tensors {ours[1]!r}, safetensors': {reference[1]!r}")
    theirs_open, ours_open = decisions["theirs safe_open"], decisions["ours safe_open"]
    if reference[0] == "accepted" and theirs_open[0] == ours_open[0] == "accepted" and theirs_open[2] != ours_open[2]:
        problems.append(f"metadata {ours_open[2]!r}, safetensors': {theirs_open[2]!r}")
    return problems


# ---------------------------------------------------------------------------
# the headers of the issue: each decided as safetensors decides, refusals named

T = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
ONE = b"\x00\x00\x80\x3f"  # 1.0f


def with_field(extra: str) -> str:
    """Tensor "a" (one F32) with an extra field of its object."""
    return '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],' + extra + '}}'


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (id, header, data, what a refusal says: a regex, or None where safetensors accepts)
CASES = [
    ("NaN", with_field('"x":NaN'), ONE, "NaN"),
    ("Infinity", with_field('"x":Infinity'), ONE, "Infinity"),
    ("-Infinity", with_field('"x":-Infinity'), ONE, "Infinity"),
    ("1e400", with_field('"x":1e400'), ONE, "out of range"),
    ("a float serde_json overflows", with_field('"x":1.7976931348623158e308'), ONE, "out of range"),
    ("the largest float", with_field('"x":1.7976931348623157e308'), ONE, None),
    ("an integer of 400 digits", with_field('"x":1' + "0" * 400), ONE, "out of range"),
    ("an integer past 64 bits, a float to serde_json", with_field('"x":18446744073709551616'), ONE, None),
    ("lone surrogate in a name", '{"\\ud800":' + T + '}', ONE, "surrogate"),
    ("lone low surrogate in a name", '{"a\\udc00":' + T + '}', ONE, "surrogate"),
    ("lone surrogate in metadata", '{"__metadata__":{"k":"\\udbff"},"a":' + T + '}', ONE, "surrogate"),
    ("lone surrogate in a metadata key", '{"__metadata__":{"\\ud800":"v"},"a":' + T + '}', ONE, "surrogate"),
    ("lone surrogate in an extra field", with_field('"x":"\\ud800x"'), ONE, "surrogate"),
    ("two high surrogates", '{"\\ud800\\ud800":' + T + '}', ONE, "surrogate"),
    ("a surrogate pair", '{"\\ud83d\\ude00":' + T + '}', ONE, None),
    ("duplicate dtype", '{"a":{"dtype":"I32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', ONE,
     "duplicate field 'dtype'"),
    ("duplicate shape", '{"a":{"dtype":"F32","shape":[1],"shape":[1],"data_offsets":[0,4]}}', ONE,
     "duplicate field 'shape'"),
    ("duplicate data_offsets", '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"data_offsets":[0,4]}}', ONE,
     "duplicate field 'data_offsets'"),
    ("two __metadata__", '{"__metadata__":{"a":"1"},"__metadata__":{"a":"1"},"a":' + T + '}', ONE,
     "__metadata__.*twice"),
    ("two __metadata__, both null", '{"__metadata__":null,"__metadata__":null,"a":' + T + '}', ONE,
     "__metadata__.*twice"),
    ("duplicate extra field", with_field('"x":1,"x":2'), ONE, None),
    ("duplicate tensor name: the last one", '{"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},"a":' + T + '}',
     ONE, None),
    ("duplicate metadata key: the last one", '{"__metadata__":{"k":"1","k":"2"},"a":' + T + '}', ONE, None),
    ("-0 in a shape", '{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}', b"", "shape"),
    ("-0 in data_offsets", '{"a":{"dtype":"F32","shape":[0],"data_offsets":[-0,0]}}', b"", "data_offsets"),
    ("1.0 in a shape", '{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', ONE, "shape"),
    ("1e0 in data_offsets", '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4e0]}}', ONE, "data_offsets"),
    ("-0 in an extra field", with_field('"x":-0'), ONE, None),
    ("nesting of 127", with_field('"x":' + nested(125)), ONE, None),
    ("nesting of 128", with_field('"x":' + nested(126)), ONE, "nest"),
    ("nesting of 128 objects", with_field('"x":' + '{"k":' * 126 + "0" + "}" * 126), ONE, "nest"),
    ("nesting of 5000", with_field('"x":' + nested(4998)), ONE, "nest"),
    ("dtype a list", '{"a":{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}}', ONE, "dtype"),
    ("dtype an object", '{"a":{"dtype":{"F32":1},"shape":[1],"data_offsets":[0,4]}}', ONE, "dtype"),
    ("dtype an object of null: serde's form of the variant", '{"a":{"dtype":{"F32":null},"shape":[1],'
     '"data_offsets":[0,4]}}', ONE, None),
    ("dtype an object of two", '{"a":{"dtype":{"F32":null,"I32":null},"shape":[1],"data_offsets":[0,4]}}', ONE,
     "dtype"),
    ("tensor fields as an array", '{"a":["F32",[1],[0,4]]}', ONE, None),
    ("tensor fields as an array of 4", '{"a":["F32",[1],[0,4],0]}', ONE, "3"),
    ("tensor a list of pairs", '{"a":[["dtype","F32"]]}', ONE, "a"),
    ("data_offsets of 3", '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,4]}}', ONE, "data_offsets"),
    ("missing shape", '{"a":{"dtype":"F32","data_offsets":[0,4]}}', ONE, "missing field 'shape'"),
    ("metadata not strings", '{"__metadata__":{"k":1},"a":' + T + '}', ONE, "__metadata__"),
    ("metadata a list", '{"__metadata__":["k"],"a":' + T + '}', ONE, "__metadata__"),
    ("metadata null", '{"__metadata__":null,"a":' + T + '}', ONE, None),
    ("metadata empty", '{"__metadata__":{},"a":' + T + '}', ONE, None),
    ("header a list", "[]", b"", "not a JSON object"),
    ("whitespace before {", ' \t\r\n{"a":' + T + '}', ONE, None),
    ("whitespace alone before {}", "\n{}", b"", None),
    ("form feed before {", "\x0c{}", b"", "JSON"),
    ("a byte-order mark", "\ufeff{}", b"", "JSON"),
    ("trailing spaces", '{"a":' + T + '}    ', ONE, None),
    ("trailing NUL", '{"a":' + T + '}\x00', ONE, "JSON"),
    ("dims overflow before a 0", '{"a":{"dtype":"F32","shape":[1099511627776,1099511627776,0],"data_offsets":[0,0]}}',
     b"", "overflow"),
    ("dims overflow after a 0: a view", '{"a":{"dtype":"F32","shape":[0,1099511627776,1099511627776],'
     '"data_offsets":[0,0]}}', b"", None),
    ("a dimension of 2**62, empty", '{"a":{"dtype":"U8","shape":[4611686018427387904,0],"data_offsets":[0,0]}}',
     b"", None),
    ("a dimension of 2**63, empty", '{"a":{"dtype":"U8","shape":[9223372036854775808,0],"data_offsets":[0,0]}}',
     b"", "2\\*\\*63"),
    ("F4, bytes of odd last dimension", '{"a":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}}', b"\x11" * 3,
     "divisible by 2|multiple of 2"),
    ("an overflowing shape overwritten by a later duplicate", '{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],'
     '"data_offsets":[0,0]},"a":' + T + '}', ONE, None),
    ("F4 of a dimension 2**63: 2**62 in torch", '{"a":{"dtype":"F4","shape":[0,9223372036854775808],'
     '"data_offsets":[0,0]}}', b"", None),
    ("strides past 64 bits", '{"a":{"dtype":"I8","shape":[3,0,4611686018427387902,4611686018427387904],'
     '"data_offsets":[0,0]}}', b"", "torch cannot make"),
    ("F6: a dtype torch cannot hold", '{"a":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[0,3]}}', b"\x11" * 3,
     "F6_E2M3"),
    ("F6 overwritten by a later duplicate", '{"a":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[0,3]},"a":' + T + '}',
     ONE, None),
]


@pytest.mark.parametrize("header,data,refusal", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_headers_are_decided_as_safetensors_decides(tmp_path, header, data, refusal):
    content = _file(header, data)
    path = str(tmp_path / "case.safetensors")
    with open(path, "wb") as f:
        f.write(content)
    decisions = _decisions(path, content)
    assert decisions["theirs load_file"][0] == ("accepted" if refusal is None else "refused"), decisions
    assert _same_decisions(decisions) == []
    if refusal is not None:  # named: the file, and the problem
        for name in ("ours load_file", "ours safe_open", "ours load"):
            message = str(decisions[name][1])
            assert ("case.safetensors" in message or "<bytes>" in message), message
            assert __import__("re").search(refusal, message), (refusal, message)


def test_a_duplicate_field_is_not_the_last_one_read():
    """The issue's own example: dtype I32 then F32 is no F32 tensor."""
    content = _file('{"a":{"dtype":"I32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', ONE)
    with pytest.raises(SafetensorsFileError, match="duplicate field 'dtype'"):
        fst.load(content)


# ---------------------------------------------------------------------------
# other devices: safetensors' own


def _a_file(tmp_path) -> str:
    path = str(tmp_path / "d.safetensors")
    st.save_file({"a": torch.arange(6.0)}, path)
    return path


def _failure(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)
    return None


def _get_all(opener, path, device):
    with opener(path, framework="pt", device=device) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("device", ["mps", "xpu", "npu", "meta", "hpu"])
def test_other_devices_load_as_safetensors_loads_them(tmp_path, device):
    """This machine has none of these: safetensors' own errors (or tensors)
    come back, not fastpersist's refusal of the device."""
    path = _a_file(tmp_path)
    theirs = _failure(lambda: ORIGINAL_LOAD_FILE(path, device=device))
    assert _failure(lambda: fst.load_file(path, device=device)) == theirs
    assert _failure(lambda: _get_all(fst.safe_open, path, device)) == \
        _failure(lambda: _get_all(ORIGINAL_SAFE_OPEN, path, device))
    was = fastpersist.is_patched()
    fastpersist.patch()
    try:  # through the patched names, as transformers calls them
        assert _failure(lambda: st.load_file(path, device=device)) == theirs
        assert _failure(lambda: _get_all(safetensors.safe_open, path, device)) == \
            _failure(lambda: _get_all(ORIGINAL_SAFE_OPEN, path, device))
    finally:
        fastpersist.patch() if was else fastpersist.unpatch()


def test_other_devices_are_handed_to_safetensors_with_what_was_passed(tmp_path, monkeypatch):
    path = _a_file(tmp_path)
    calls = []

    def their_safe_open(filename, framework="pt", device="cpu", **kwargs):
        calls.append(("safe_open", filename, framework, device, kwargs))
        return "theirs"

    def their_load_file(filename, device="cpu", **kwargs):
        calls.append(("load_file", filename, device, kwargs))
        return {"a": torch.zeros(1)}

    monkeypatch.setattr(safetensors, "_fastpersist_original_safe_open", their_safe_open, raising=False)
    monkeypatch.setattr(st, "_fastpersist_original_load_file", their_load_file, raising=False)
    assert fst.safe_open(path, framework="pt", device="xpu:1", backend="pread") == "theirs"
    assert fst.safe_open(path, device=torch.device("mps")) == "theirs"
    assert list(fst.load_file(path, device="npu:0")) == ["a"]
    assert fst.load_file(path, device="mps", backend="pread")["a"].shape == (1,)
    assert calls == [("safe_open", path, "pt", "xpu:1", {"backend": "pread"}),
                     ("safe_open", path, "pt", torch.device("mps"), {}),
                     ("load_file", path, "npu:0", {}),
                     ("load_file", path, "mps", {"backend": "pread"})]
    # the CPU and CUDA stay fastpersist's
    assert torch.equal(fst.load_file(path)["a"], torch.arange(6.0)) and len(calls) == 4


def test_what_the_safe_open_docstring_says_of_a_name_asked_for_twice(tmp_path):
    """safetensors' safe_open (its mapping) hands out one memory for a name
    asked for twice, and a copy with backend="pread"; fastpersist's, a copy."""
    path = _a_file(tmp_path)
    with ORIGINAL_SAFE_OPEN(path, framework="pt") as f:
        assert f.get_tensor("a").data_ptr() == f.get_tensor("a").data_ptr()
    with ORIGINAL_SAFE_OPEN(path, framework="pt", backend="pread") as f:
        assert f.get_tensor("a").data_ptr() != f.get_tensor("a").data_ptr()
    with fst.safe_open(path, framework="pt") as f:
        first, again = f.get_tensor("a"), f.get_tensor("a")
        assert first.untyped_storage().data_ptr() != again.untyped_storage().data_ptr()
    assert "one memory" in fst.safe_open.__doc__ and "share no memory" not in fst.safe_open.__doc__


def test_what_safetensors_loads_to_another_device_is_verified(tmp_path, monkeypatch):
    path = str(tmp_path / "v.safetensors")
    fst.save_file({"a": torch.arange(6.0), "b": torch.ones(3)}, path, checksums=True)
    loaded = {}
    monkeypatch.setattr(st, "_fastpersist_original_load_file", lambda filename, device="cpu", **kw: loaded,
                        raising=False)
    loaded.update(ORIGINAL_LOAD_FILE(path))
    assert torch.equal(fst.load_file(path, device="xpu", verify=True)["b"], torch.ones(3))
    loaded["b"] = torch.zeros(3)  # as if a byte had flipped on the way
    with pytest.raises(SafetensorsFileError, match="tensor 'b' fails its CRC-32 check"):
        fst.load_file(path, device="xpu", verify=True)
