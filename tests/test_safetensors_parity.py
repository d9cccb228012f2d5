"""fastpersist's safetensors loads decide as safetensors' own do: the headers
safetensors' parser (serde_json, then safetensors' checks) accepts load
with the same tensors and metadata, the rest are refused with a
SafetensorsFileError naming the problem; devices other than the CPU and
CUDA go to safetensors' own functions. The oracle is the installed
safetensors itself, unpatched: each case, and a differential fuzz over
generated headers (FASTPERSIST_FUZZ_CASES sets how many; 500 by
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


# ---------------------------------------------------------------------------
# a differential fuzz over generated headers: valid ones, then mutated (structure-aware: duplicate
# keys, numbers in odd forms, surrogate escapes, nesting, whitespace, missing, extra and mistyped
# fields, offsets that overlap or leave holes, metadata of other types, ...), each decided by
# safetensors and by fastpersist

# safetensors 0.8's dtypes, with their bits (F6: parsed by safetensors, not held by torch)
BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
        "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
        "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
COMMON = ["F32", "F16", "BF16", "I64", "U8", "BOOL", "F4", "F8_E4M3", "F8_E8M0", "C64", "U64"]
# tensor names: (JSON text, without quotes); no two the same once decoded
NAMES = ["a", "b", "w.0", "layer-0.weight", "gewicht.\u00fc", "\u540d\u524d", "caf\\u00e9", "q\\\"uote", "s\\/lash",
         "emoji\\ud83d\\ude00", "", "__metadata__x", "t\\t1", "x\\u0000y", "\\u005f_meta"]
# numbers in odd forms, in place of an integer of a shape or of data_offsets
ODD_INTEGERS = ["-0", "0.0", "{v}.0", "{v}e0", "{v}E+0", "0{v}", "-{v}", "+{v}", "{big}", "18446744073709551615",
                "18446744073709551616", "1e400", "NaN", "Infinity", "-Infinity", "{v}.5", "1e-400",
                "9223372036854775808", "0x1", ".5", "{v}.", "-", "{v}e", "-0.0", "00", "{v}0", "true", "null",
                '"{v}"', "[{v}]"]
# numbers for fields safetensors ignores: serde_json still parses them whole
ODD_NUMBERS = ["-0", "1e400", "-1e400", "1.7976931348623157e308", "1.7976931348623158e308", "17976931348623157e292",
               "179769313486231580000e288", "1e308", "10e307", "0.1e310", "1e-400", "0e99999999999", "1e99999999999",
               "1e-99999999999", "18446744073709551616", "-9223372036854775809", "-9223372036854775808", "1" + "0" * 400,
               "1" + "0" * 308, "1" + "0" * 309, "123456789012345678901234567890e280", "NaN", "Infinity",
               "18446744073709551619.5", "0.000001", "-1.5E-3", "1E+2", "01", "1.", "+1", ".1"]
STRINGS = ['"x"', '"\\ud800"', '"\\udc00"', '"\\ud800\\udc00"', '"\\uD83D\\uDE00"', '"\\ud800x"', '"\\ud800\\ud800"',
           '"\\ud800\\u0041"', '"\\\\ud800"', '"\\x"', '"\\U0041"', '"a\tb"', '"\x7f"', '"\\u00e9"', '"\u00e9"',
           '"\\/"', '"\\b\\f\\n\\r\\t"', '"\\u12"', '"unterminated']
HUGE_EMPTY_SHAPES = [[0, 2 ** 40, 2 ** 40], [2 ** 40, 2 ** 40, 0], [2 ** 62, 0], [2 ** 63, 0], [2 ** 64 - 1, 0],
                     [2 ** 32, 2 ** 32, 0], [0, 2 ** 64 - 1], [3, 0, 2 ** 62, 2 ** 62], [2 ** 62, 3, 0], [0, 2 ** 63],
                     [2 ** 61, 7, 0], [0, 0], [5, 0, 2 ** 33]]


def _obj(pairs):
    return ["obj", pairs]


def _arr(items):
    return ["arr", items]


def _lit(text):
    return ["lit", text]


def _emit(node, rng, spacing: float) -> str:
    """JSON text of a node, with whitespace between tokens now and then."""
    def ws():
        return rng.choice([" ", "\t", "\n", "\r", "  "]) if rng.random() < spacing else ""
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "arr":
        return "[" + ws() + ("," + ws()).join(_emit(v, rng, spacing) + ws() for v in node[1]) + "]"
    return "{" + ws() + ("," + ws()).join(f'"{k}"' + ws() + ":" + ws() + _emit(v, rng, spacing) + ws()
                                         for k, v in node[1]) + "}"


def _boundary_number(rng) -> str:
    """A JSON number about the largest float (or past u64, or tiny): where
    serde_json's own float parsing decides what is out of range."""
    digits = rng.choice(["17976931348623157", "1797693134862315", "17976931348623158", "18446744073709551615", "1",
                         "9", ""]) + "".join(rng.choice("0123456789") for _ in range(rng.randint(0, 14)))
    digits = digits.lstrip("0") or "0"
    point = rng.randint(1, len(digits))
    text = digits[:point] + ("." + digits[point:] if point < len(digits) else "")
    if rng.random() < 0.85:
        exponent = rng.choice([308 - point + 1, 308 - point + rng.randint(-3, 3), rng.randint(280, 330),
                               -rng.randint(280, 345), rng.randint(2 ** 31 - 3, 2 ** 31 + 3), -(2 ** 31) - 1])
        text += rng.choice(["e", "E"]) + ("+" if exponent >= 0 and rng.random() < 0.3 else "") + str(exponent)
    return ("-" if rng.random() < 0.3 else "") + text


def _random_value(rng, depth: int = 0):
    """A JSON value for a field safetensors ignores."""
    roll = rng.random()
    if depth > 3 or roll < 0.45:
        if rng.random() < 0.3:
            return _lit(_boundary_number(rng))
        return _lit(rng.choice(ODD_NUMBERS + STRINGS + ["true", "false", "null", "0", "7", '"s"', "-3"]))
    if roll < 0.7:
        return _arr([_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))])
    return _obj([(rng.choice(["k", "x", "k", "dtype", "\\ud800", "\\ud800\\udc00"]), _random_value(rng, depth + 1))
                 for _ in range(rng.randint(0, 3))])


def _nested(rng, depth: int):
    """depth arrays or objects, one in another (as text: too deep to emit recursively)."""
    kinds = [rng.random() < 0.5 for _ in range(depth)] if rng.random() < 0.5 else [rng.random() < 0.5] * depth
    inner = rng.choice(["0", "[]", "{}", '"s"', "null"])
    return _lit("".join("[" if a else '{"k":' for a in kinds) + inner + "".join("]" if a else "}" for a in reversed(kinds)))


def _shape_for(rng, dtype: str) -> list:
    """A small shape whose bits are whole bytes for dtype."""
    while True:
        shape = [rng.choice([0, 1, 1, 2, 2, 3, 4]) for _ in range(rng.choice([0, 1, 1, 2, 2, 3]))]
        n = 1
        for d in shape:
            n *= d
        if n * BITS[dtype] % 8 == 0 and (dtype != "F4" or (shape and shape[-1] % 2 == 0) or rng.random() < 0.1):
            return shape


def _generated_case(rng) -> bytes:
    """One safetensors file: a valid one, mutated a few times (or not)."""
    count = rng.choice([0, 1, 1, 2, 3, 3, 4, 6])
    names = rng.sample(NAMES, count)
    tensors = []
    for name in names:
        dtype = rng.choice(COMMON) if rng.random() < 0.85 else rng.choice(list(BITS))
        if rng.random() < 0.08:
            shape = list(rng.choice(HUGE_EMPTY_SHAPES))
        else:
            shape = _shape_for(rng, dtype)
        n = 1
        for d in shape:
            n *= d
        tensors.append([name, dtype, shape, n * BITS[dtype] // 8 if n * BITS[dtype] < 2 ** 64 else 0])
    offsets, at = {}, 0
    for t in rng.sample(tensors, len(tensors)):  # data in an order of its own
        offsets[t[0]] = [at, at + t[3]]
        at += t[3]
    data = bytearray(rng.randbytes(at))
    members = []
    for name, dtype, shape, _ in tensors:
        dtype_node = _lit(f'"{dtype}"') if rng.random() < 0.95 else _obj([(dtype, _lit("null"))])
        fields = [("dtype", dtype_node), ("shape", _arr([_lit(str(d)) for d in shape])),
                  ("data_offsets", _arr([_lit(str(o)) for o in offsets[name]]))]
        if rng.random() < 0.15:
            rng.shuffle(fields)
        if rng.random() < 0.1:
            fields.insert(rng.randint(0, len(fields)), (rng.choice(["x", "extra", "Dtype"]), _random_value(rng)))
        members.append([name, _arr([v for _, v in fields]) if rng.random() < 0.05 and len(fields) == 3
                        and fields[0][0] == "dtype" else _obj(fields)])
    if rng.random() < 0.6:
        metadata = rng.choice([_lit("null"), _obj([]), _obj([("format", _lit('"pt"'))]),
                               _obj([("format", _lit('"pt"')), ("note", _lit('"\\u00e9 \\"q\\" \\n"'))])])
        members.insert(rng.randint(0, len(members)), ["__metadata__", metadata])
    for _ in range(rng.choice([0, 0, 1, 1, 1, 2, 3])):
        data = _mutate(rng, members, data)
    text = "{" + ",".join(f'"{k}":' + _emit(v, rng, 0.02) for k, v in members) + "}"
    if rng.random() < 0.1:
        text = _emit(_obj(members), rng, 0.3)
    return _mutate_text(rng, text, bytes(data))


def _tensor_objects(members) -> list:
    return [v for k, v in members if k != "__metadata__" and v[0] == "obj"]


def _integers(members) -> list:
    """The integer nodes of shapes and data_offsets."""
    found = []
    for node in _tensor_objects(members):
        for key, value in node[1]:
            if key in ("shape", "data_offsets") and value[0] == "arr":
                found.extend(v for v in value[1] if v[0] == "lit")
    return found


def _mutate(rng, members: list, data: bytearray) -> bytearray:
    what = rng.randrange(17)
    objects = _tensor_objects(members)
    if what == 0 and objects:  # a field twice
        node = rng.choice(objects)
        if node[1]:
            key, value = rng.choice(node[1])
            other = value if rng.random() < 0.5 else _lit(rng.choice(['"I32"', '"F32"', "[1]", "[0,4]", "[]"]))
            node[1].insert(rng.randint(0, len(node[1])), (key, other))
    elif what == 1 and members:  # a tensor name twice
        key, value = rng.choice(members)
        copy = value if rng.random() < 0.5 else rng.choice(members)[1]
        members.insert(rng.randint(0, len(members)), [key if key != "__metadata__" or rng.random() < 0.5 else "a",
                                                      copy])
    elif what == 2:  # __metadata__ (again)
        members.insert(rng.randint(0, len(members)), ["__metadata__", rng.choice(
            [_lit("null"), _obj([]), _obj([("a", _lit('"1"'))])])])
    elif what == 3:  # a number of a shape or data_offsets in another form
        numbers = _integers(members)
        if numbers:
            node = rng.choice(numbers)
            v = node[1]
            node[1] = rng.choice(ODD_INTEGERS).format(v=v, big=str(int(v) + 2 ** 64) if v.isdigit() else "1" * 25)
    elif what == 4 and objects:  # a field safetensors ignores
        node = rng.choice(objects)
        node[1].insert(rng.randint(0, len(node[1])), (rng.choice(["x", "y", "x"]), _random_value(rng)))
    elif what == 5:  # nesting about serde_json's limit, or far past it
        depth = rng.choice([124, 125, 126, 127, 200, 1500, 4000])
        where = [("field", rng.choice(objects))] if objects else []
        where.append(("member", None))
        kind, node = rng.choice(where)
        if kind == "field":
            node[1].append(("deep", _nested(rng, depth)))
        else:
            members.insert(rng.randint(0, len(members)), [rng.choice(["deep", "__metadata__"]), _nested(rng, depth)])
    elif what == 6:  # names, metadata keys and values with escapes
        escape = rng.choice(STRINGS)[1:-1] if rng.random() < 0.7 else rng.choice(["\\ud800", "\\udfff", "\\ud800\\udc00"])
        if members and rng.random() < 0.5:
            member = rng.choice(members)
            member[0] = member[0] + escape if member[0] != "__metadata__" else member[0]
        else:
            members.insert(rng.randint(0, len(members)), ["__metadata__", _obj([(
                rng.choice(["k", escape]), _lit(rng.choice(['"v"', f'"{escape}"'])))])])
    elif what == 7 and objects:  # a field missing
        node = rng.choice(objects)
        if node[1]:
            node[1].pop(rng.randrange(len(node[1])))
    elif what == 8 and objects:  # a field of another type
        node = rng.choice(objects)
        if node[1]:
            i = rng.randrange(len(node[1]))
            wrong = rng.choice(['"f32"', '"F33"', '"F6_E3M2"', '{"F32":null}', '{"F32":[]}', '{"F32":{}}', "{}",
                                '{"F32":null,"I32":null}', '["F32"]', "null", "1", "true", '"1"', "[[1]]", '["1"]',
                                "[1,2,3]", "[0]", "{}", '{"0":0,"1":4}', "[]", "[0,0]", '"F32"', '{"BF16":null}'])
            node[1][i] = (node[1][i][0], _lit(wrong))
    elif what == 9 and objects:  # offsets: overlapping, a hole, reversed, past the data, all the same
        numbers = [n for n in _integers(members) if n[1].isdigit()]
        if numbers:
            node = rng.choice(numbers)
            node[1] = str(max(0, int(node[1]) + rng.choice([-4, -2, -1, 1, 2, 4, 8, 1000, 2 ** 32])))
    elif what == 10:  # the data longer or shorter
        if data and rng.random() < 0.5:
            del data[rng.randrange(len(data)):]
        else:
            data += rng.randbytes(rng.choice([1, 2, 4, 8]))
    elif what == 11:  # metadata of other types
        value = rng.choice([_obj([("k", _lit(rng.choice(["1", "null", "[]", "{}", "true", '"v"', "1.5", "-0"])))]),
                            _obj([("k", _lit('"1"')), ("k", _lit('"2"'))]), _lit("[]"), _lit('"pt"'), _lit("0"),
                            _arr([_lit('"k"')]), _obj([("format", _obj([]))])])
        found = [m for m in members if m[0] == "__metadata__"]
        if found:
            rng.choice(found)[1] = value
        else:
            members.insert(rng.randint(0, len(members)), ["__metadata__", value])
    elif what == 12 and members:  # a tensor of another type
        member = rng.choice(members)
        if member[0] != "__metadata__":
            member[1] = _lit(rng.choice(["null", "1", '"F32"', "[]", '["F32",[0],[0,0]]', '["F32",[0]]',
                                         '["F32",[0],[0,0],0]', '[{"F32":null},[0],[0,0]]', "{}", "true"]))
    elif what == 13:  # a tensor of no bytes at any offset (the order of equal offsets)
        at = rng.choice([0, len(data), rng.randint(0, len(data))])
        members.insert(rng.randint(0, len(members)), [rng.choice(["z", "zz", "a"]), _obj([
            ("dtype", _lit('"F32"')), ("shape", _arr([_lit(str(rng.choice([0, 1, 3]))), _lit("0")])),
            ("data_offsets", _arr([_lit(str(at)), _lit(str(at))]))])])
    elif what == 14 and objects:  # a shape of no elements with huge dimensions
        node = rng.choice(objects)
        for i, (key, value) in enumerate(node[1]):
            if key == "shape":
                node[1][i] = (key, _arr([_lit(str(d)) for d in rng.choice(HUGE_EMPTY_SHAPES)]))
    elif what == 15 and objects:  # a number out of range in a field safetensors ignores
        rng.choice(objects)[1].append(("n", _lit(rng.choice(ODD_NUMBERS) if rng.random() < 0.4
                                                 else _boundary_number(rng))))
    elif what == 16 and objects:  # a tensor's fields as an array
        node = rng.choice(objects)
        node[:] = _arr([v for _, v in node[1]])
    return data


def _mutate_text(rng, text: str, data: bytes) -> bytes:
    """Mutations of the header's text and bytes, and of its length."""
    roll = rng.random()
    if roll < 0.06:  # whitespace, allowed or not, before and after
        text = rng.choice([" ", "\n", "\t\r ", "\x0c", "\xa0", "\ufeff", "\u2028", "\x0b", ""]) + text + \
            rng.choice([" " * rng.randint(1, 7), "\n", "\x00", "\x0c", "", "x", ",", "}", "\u3000"])
    elif roll < 0.1:  # syntax: a trailing comma, a missing one, a cut
        cut = rng.randint(0, len(text))
        text = rng.choice([text[:-1] + ",}", text.replace(",", " ", 1), text.replace(":", "", 1), text[:cut],
                           text + "//c", text[:cut] + text[cut + 1:]])
    elif roll < 0.12:  # not an object at all
        text = rng.choice(["[]", '"s"', "1", "null", "", " ", "[{}]", "true"])
    raw = text.encode("utf-8", "surrogatepass")
    roll = rng.random()
    if roll < 0.03 and raw:  # bytes that are not UTF-8, or one byte changed
        at = rng.randrange(len(raw))
        raw = raw[:at] + rng.choice([b"\xff", b"\xed\xa0\x80", b"\xc0\xaf", b"\xe9", bytes([rng.randrange(256)])]) + \
            raw[at + 1:]
    if rng.random() < 0.5:  # padded to 8 bytes with spaces, as safetensors writes
        raw += b" " * (-(8 + len(raw)) % 8)
    length = len(raw)
    roll = rng.random()
    if roll < 0.02:
        length = rng.choice([0, length - 1, length + 1, len(raw) + len(data) + 1, 100_000_001, 2 ** 63])
    return struct.pack("<Q", length % 2 ** 64) + raw + data


def test_differential_fuzz_of_generated_headers(tmp_path):
    """FASTPERSIST_FUZZ_CASES cases (500 by default), from FASTPERSIST_FUZZ_SEED:
    each generated file decided by safetensors' load_file (and load, and
    safe_open's metadata) and by fastpersist's load_file, load and safe_open;
    both accept with the same tensors and metadata, or both refuse (a
    SafetensorsFileError)."""
    cases = int(os.environ.get("FASTPERSIST_FUZZ_CASES", "500"))
    seed = int(os.environ.get("FASTPERSIST_FUZZ_SEED", "20261127"))
    rng = random.Random(seed)
    path = str(tmp_path / "fuzz.safetensors")
    divergent, accepted, started = [], 0, time.monotonic()
    for i in range(cases):
        content = _generated_case(rng)
        with open(path, "wb") as f:
            f.write(content)
        decisions = _decisions(path, content)
        accepted += decisions["theirs load_file"][0] == "accepted"
        problems = _same_decisions(decisions)
        if problems:
            divergent.append((i, content[:300], problems))
    elapsed = time.monotonic() - started
    print(f"\n{cases} generated cases (seed {seed}): {accepted} accepted by safetensors, {len(divergent)} divergent, "
          f"{elapsed:.1f} s")
    assert not divergent, "\n".join(f"case {i}: {content!r}\n  " + "\n  ".join(p) for i, content, p in divergent[:5])
    assert cases < 50 or 0.1 * cases < accepted < 0.9 * cases  # both kinds, in numbers
