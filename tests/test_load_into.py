"""fastpersist.load_into: tensors restored in place, checked first, nothing
modified on a mismatch."""
import pytest
import torch

import fastpersist
from fastpersist import read_pipeline
from fastpersist.patching import original_load, original_save

from conftest import SMALL, torch_save_setting
from corpus import DTYPES, every_dtype_tensor, rewrite_big_endian


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8),
                               torch.nn.BatchNorm1d(8))


def snapshot(target):
    sd = target.state_dict() if isinstance(target, torch.nn.Module) else target
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def test_module_restored_in_place(folder, engine):
    source = model()
    source(torch.randn(4, 16))  # moves BatchNorm's running stats
    original_save()(source.state_dict(), folder / "m.pt")
    torch.manual_seed(1)
    target = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8),
                                 torch.nn.BatchNorm1d(8))
    pointers = {k: v.data_ptr() for k, v in target.state_dict().items()}
    result = fastpersist.load_into(target, folder / "m.pt", engine=engine, **SMALL)
    assert result == fastpersist.IncompatibleKeys([], [])
    for k, v in target.state_dict().items():
        assert torch.equal(v, source.state_dict()[k]), k
        assert v.data_ptr() == pointers[k], f"{k} was replaced, not filled"


def test_every_dtype_and_layouts(folder, engine):
    base = torch.randn(10, 12)
    stored = {str(d): every_dtype_tensor(d) for d in DTYPES}
    stored.update(view=base[3:, 2:7], transposed=base.t(), row=base[4], zero_dim=torch.tensor(2.5),
                  empty=torch.zeros(0, 3), big=torch.randn(300_000))
    fastpersist.save(stored, folder / "d.pt")
    target = {k: torch.zeros_like(v) for k, v in stored.items()}
    target["transposed"] = torch.zeros(10, 12).t()  # a non-contiguous destination
    fastpersist.load_into(target, folder / "d.pt", engine=engine, **SMALL)
    expected = original_load()(folder / "d.pt")

    def raw_bytes(t):  # compares every dtype, float8 and bool included, bit for bit
        return t.contiguous().reshape(-1).view(torch.uint8)

    for k, v in expected.items():
        assert target[k].shape == v.shape and torch.equal(raw_bytes(target[k]), raw_bytes(v)), k


def test_tied_weights_share_file_bytes(folder):
    shared = torch.randn(50, 8)
    original_save()({"embed": shared, "head": shared, "head_t": shared.t()}, folder / "t.pt")
    target = {"embed": torch.zeros(50, 8), "head": torch.zeros(50, 8), "head_t": torch.zeros(8, 50)}
    fastpersist.load_into(target, folder / "t.pt")
    assert torch.equal(target["embed"], shared) and torch.equal(target["head"], shared)
    assert torch.equal(target["head_t"], shared.t())


def test_training_checkpoint_with_optimizer_state(folder):
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(4, 16)).sum().backward()
    opt.step()
    original_save()({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, folder / "ckpt.pt")

    net2 = model()
    with torch.no_grad():
        for p in net2.parameters():
            p.add_(1)
    opt2 = torch.optim.Adam(net2.parameters(), lr=5e-2)
    net2(torch.randn(4, 16)).sum().backward()
    opt2.step()
    state = {"model": net2.state_dict(), "optimizer": opt2.state_dict(), "epoch": 0}
    exp_avg = opt2.state_dict()["state"][0]["exp_avg"]
    fastpersist.load_into(state, folder / "ckpt.pt")
    for k, v in net.state_dict().items():
        assert torch.equal(net2.state_dict()[k], v), k
    assert torch.equal(exp_avg, opt.state_dict()["state"][0]["exp_avg"])  # the live optimizer tensor
    assert state["epoch"] == 3 and state["optimizer"]["param_groups"][0]["lr"] == 1e-3
    opt2.load_state_dict(state["optimizer"])  # hyperparameters; keeps the tensors just filled
    assert opt2.param_groups[0]["lr"] == 1e-3
    assert opt2.state[next(net2.parameters())]["exp_avg"].data_ptr() == exp_avg.data_ptr()


def test_mismatches_reported_together_and_nothing_modified(folder):
    original_save()({"a": torch.ones(4), "b": torch.ones(2, 3), "c": torch.ones(3, dtype=torch.float64),
                     "extra": torch.ones(1)}, folder / "x.pt")
    target = {"a": torch.zeros(4), "b": torch.zeros(3, 2), "c": torch.zeros(3), "missing": torch.zeros(2)}
    before = snapshot(target)
    with pytest.raises(RuntimeError) as info:
        fastpersist.load_into(target, folder / "x.pt")
    message = str(info.value)
    for part in ('Missing key(s) in state_dict: "missing"', 'Unexpected key(s) in state_dict: "extra"',
                 "size mismatch for b", "dtype mismatch for c", "x.pt"):
        assert part in message
    for k, v in before.items():
        assert torch.equal(target[k], v), f"{k} was modified"
    # Not strict: keys may differ, but shapes and dtypes must still match.
    del target["b"], target["c"]
    result = fastpersist.load_into(target, folder / "x.pt", strict=False)
    assert result.missing_keys == ["missing"] and sorted(result.unexpected_keys) == ["b", "c", "extra"]
    assert torch.equal(target["a"], torch.ones(4)) and torch.equal(target["missing"], torch.zeros(2))


def test_autograd_sees_the_in_place_write(folder):
    """As with load_state_dict's copy_, a graph that saved the old values
    refuses to backpropagate instead of silently using the new ones."""
    lin = torch.nn.Linear(3, 2)
    original_save()({"weight": torch.ones(2, 3), "bias": torch.ones(2)}, folder / "w.pt")
    y = (lin.weight * lin.weight).sum()  # saves the weight for backward
    fastpersist.load_into(lin, folder / "w.pt")
    assert torch.equal(lin.weight.detach(), torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_bad_targets(folder):
    original_save()({"w": torch.ones(3)}, folder / "w.pt")
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        fastpersist.load_into([torch.zeros(3)], folder / "w.pt")
    with pytest.raises(TypeError, match="reads from a path"):
        with open(folder / "w.pt", "rb") as f:
            fastpersist.load_into({"w": torch.zeros(3)}, f)
    original_save()(torch.ones(3), folder / "bare.pt")
    with pytest.raises(TypeError, match="not a state dict"):
        fastpersist.load_into({"w": torch.zeros(3)}, folder / "bare.pt")
    original_save()({"w": torch.ones(3)}, folder / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(fastpersist.CheckpointError, match="legacy"):
        fastpersist.load_into({"w": torch.zeros(3)}, folder / "legacy.pt")


def test_big_endian_file(folder):
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    original_save()({"x": values, "t": values.t()}, folder / "little.pt")
    rewrite_big_endian(folder / "little.pt", folder / "big.pt", lambda data: 4)
    target = {"x": torch.zeros(3, 4), "t": torch.zeros(4, 3)}
    fastpersist.load_into(target, folder / "big.pt")
    assert torch.equal(target["x"], values) and torch.equal(target["t"], values.t())


def test_tensors_in_lists_are_restored_and_other_containers_refused(folder):
    state = {"list": [torch.arange(3), {"x": torch.ones(2)}, 7], "tuple": (1, 2), "empty": []}
    fastpersist.save(state, folder / "l.pt")
    target = {"list": [torch.zeros(3, dtype=torch.int64), {"x": torch.zeros(2)}, 0], "tuple": (0, 0), "empty": []}
    kept = target["list"][0]
    fastpersist.load_into(target, folder / "l.pt")
    assert target["list"][0] is kept and torch.equal(kept, torch.arange(3))
    assert torch.equal(target["list"][1]["x"], torch.ones(2)) and target["list"][2] == 7
    assert target["tuple"] == (1, 2) and target["empty"] == []

    fastpersist.save({"pair": (torch.ones(2), torch.ones(3))}, folder / "t.pt")
    target = {"pair": (torch.zeros(2), torch.zeros(3))}
    with pytest.raises(RuntimeError, match=r'"pair" is a tuple holding tensors'):
        fastpersist.load_into(target, folder / "t.pt")
    assert torch.equal(target["pair"][0], torch.zeros(2))


def test_verify_on_a_path_that_is_not_a_zip_checkpoint_names_it(folder):
    path = folder / "legacy.pt"
    torch.save({"a": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(fastpersist.CheckpointError, match="legacy.pt: verify=True checks zip checkpoints"):
        fastpersist.load(path, verify=True)


def test_a_foreign_file_whose_small_records_share_a_guessed_place_is_laid_out_again(folder, monkeypatch):
    """In a file without torch's padding, the data places guessed for small
    adjacent records can round up to the same one: the plan made from the
    guesses must not refuse the file as corrupt before the local headers
    say the guesses were wrong (it is laid out again from them)."""
    import importlib
    import zipfile

    load_module = importlib.import_module("fastpersist.load")
    state = {"big": torch.randn(20_000)}
    for i in range(8):
        state[f"s{i}"] = torch.tensor(float(i))
        state[f"v{i}"] = torch.arange(16.0) + i
    original_save()(state, folder / "torch.pt")
    with zipfile.ZipFile(folder / "torch.pt") as src, zipfile.ZipFile(folder / "foreign.pt", "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    monkeypatch.setattr(read_pipeline, "SMALL_FILE_BYTES", 0)  # as with a large file: the engine reads ahead
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    fastpersist.load_into(target, folder / "foreign.pt")
    for k, v in state.items():
        assert torch.equal(target[k], v), k


def test_the_read_begins_before_the_layout_and_a_wrong_guess_writes_nothing(folder, engine, monkeypatch):
    # With an engine idle (or a big file), the tensors' bytes are read while the pickle is still being
    # unpickled. The places guessed for them are checked against the local headers before any tensor is
    # written; a file whose data lies elsewhere (Python's zipfile writes no padding) is laid out again from
    # its headers, and a file whose local header is damaged is refused with its target untouched.
    import importlib
    import zipfile

    from fastpersist import device_io

    load_module = importlib.import_module("fastpersist.load")
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(3000 + 7 * i) for i in range(12)}  # 12-24 KB each, through 64 KB buffers
    original_save()(state, folder / "torch.pt")
    with zipfile.ZipFile(folder / "torch.pt") as src, zipfile.ZipFile(folder / "foreign.pt", "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    data = bytearray((folder / "torch.pt").read_bytes())
    with zipfile.ZipFile(folder / "torch.pt") as src:
        at = src.getinfo("torch/data/7").header_offset
    data[at] ^= 0x01  # its local header's signature
    (folder / "damaged.pt").write_bytes(bytes(data))
    events = []
    real_begin, real_unpickle = device_io.PullRead.__init__, load_module._torch_api.unpickle_plain_state

    def begin(self, *args):
        events.append("read begun")
        real_begin(self, *args)

    def unpickle(*args, **kwargs):
        events.append("unpickle")
        return real_unpickle(*args, **kwargs)

    monkeypatch.setattr(device_io.PullRead, "__init__", begin)
    monkeypatch.setattr(load_module._torch_api, "unpickle_plain_state", unpickle)
    monkeypatch.setattr(read_pipeline, "SMALL_FILE_BYTES", 0)  # as with an engine idle
    for name, passes in (("torch.pt", ["read begun", "unpickle"]),
                         ("foreign.pt", ["read begun", "unpickle", "unpickle"])):
        for verify in (False, True):
            events.clear()
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            fastpersist.load_into(target, folder / name, verify=verify, engine=engine, **SMALL)
            for k, v in state.items():
                assert torch.equal(target[k], v), (name, k)
            assert events == passes
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(fastpersist.CheckpointError, match="'data/7': no local header"):
        fastpersist.load_into(target, folder / "damaged.pt", engine=engine, **SMALL)
    assert all(not v.any() for v in target.values()), "a refused load_into wrote into its target"
    # a mismatch found while the engine is reading ahead: refused, nothing written, the engine usable after
    events.clear()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    target["w3"] = torch.zeros(5)
    with pytest.raises(RuntimeError, match="size mismatch for w3"):
        fastpersist.load_into(target, folder / "torch.pt", engine=engine, **SMALL)
    assert events == ["read begun", "unpickle"]
    assert all(not v.any() for v in target.values()), "a refused load_into wrote into its target"
    del target["w3"]
    fastpersist.load_into(target, folder / "torch.pt", strict=False, engine=engine, **SMALL)
    assert all(torch.equal(target[k], state[k]) for k in target)


def _rich_state():
    base = torch.randn(6, 8)
    complex_base = torch.randn(5, dtype=torch.complex64)
    return {
        "view": base[2:, 1:5], "transposed": base.t(), "row": base[3], "whole": base,
        "zero_dim": torch.tensor(1.5), "empty": torch.zeros(0, 4), "ints": torch.arange(7),
        "conj": complex_base.conj(), "neg": torch.randn(4).neg().view(2, 2),
        "param": torch.nn.Parameter(torch.randn(3)), "nested": [torch.ones(2), {"x": torch.arange(3.0)}, 5],
        "meta": {"step": 10, "name": "run"},
    }


def test_the_plain_layout_plans_as_torchs_layout_does(folder, monkeypatch):
    # load_into reads a plain state dict's layout without building meta tensors; torch's own
    # layout (taken for anything else) must fill the same targets with the same bytes
    import importlib

    from fastpersist import _torch_api

    load_module = importlib.import_module("fastpersist.load")
    state = _rich_state()
    fastpersist.save(state, folder / "r.pt")
    expected = original_load()(folder / "r.pt")

    def target():
        t = {k: torch.zeros_like(v) for k, v in expected.items() if isinstance(v, torch.Tensor)}
        t["transposed"] = torch.zeros(6, 8).t()  # a non-contiguous destination
        t["nested"], t["meta"] = [torch.zeros(2), {"x": torch.zeros(3)}, 0], {"step": 0, "name": ""}
        return t

    def filled(t):
        return {k: (v.resolve_conj().resolve_neg().clone() if isinstance(v, torch.Tensor) else v) for k, v in t.items()}

    plain_layouts = []
    real = _torch_api.unpickle_plain_state

    def counting(*args, **kwargs):
        plain_layouts.append(kwargs.get("layout"))
        return real(*args, **kwargs)

    monkeypatch.setattr(_torch_api, "unpickle_plain_state", counting)
    ours = target()
    fastpersist.load_into(ours, folder / "r.pt")
    assert plain_layouts == [True]

    def refuse(*args, **kwargs):
        raise _torch_api.NotPlainState("this test takes torch's layout")

    monkeypatch.setattr(_torch_api, "unpickle_plain_state", refuse)
    theirs = target()
    fastpersist.load_into(theirs, folder / "r.pt")
    assert load_module._torch_api.unpickle_plain_state is refuse
    for key, value in filled(theirs).items():
        other = filled(ours)[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(other, value) and torch.equal(value, expected[key].resolve_conj().resolve_neg()), key
        elif key != "nested":
            assert other == value == expected[key], key
    for filled_in in (ours, theirs):
        first, inner, last = filled_in["nested"]
        assert torch.equal(first, torch.ones(2)) and torch.equal(inner["x"], torch.arange(3.0)) and last == 5


def test_a_storage_in_the_checkpoint_is_refused_not_stored(folder):
    # a layout's storage holds no data: storing it in the target would lose the checkpoint's bytes
    original_save()({"w": torch.ones(3), "raw": torch.arange(4.0).untyped_storage()}, folder / "s.pt")
    target = {"w": torch.zeros(3), "raw": None}
    with pytest.raises(RuntimeError, match=r'"raw" is a storage; load_into restores tensors'):
        fastpersist.load_into(target, folder / "s.pt")
    assert torch.equal(target["w"], torch.zeros(3)) and target["raw"] is None
    target = {"w": torch.zeros(3), "raw": torch.zeros(4)}
    with pytest.raises(RuntimeError, match=r'"raw" is a tensor in the target but a \w*Storage in the checkpoint'):
        fastpersist.load_into(target, folder / "s.pt")


def test_small_records_are_read_once_whole_and_checked(folder, engine, monkeypatch):
    # an optimizer's state: records small beside their local headers, whose fetch reads most of the file;
    # the whole file is read once into memory and the tensors copied from there, guesses checked as ever
    import importlib
    import struct
    import zipfile

    from fastpersist import device_io

    load_module = importlib.import_module("fastpersist.load")
    opt_model = model()
    optimizer = torch.optim.Adam(opt_model.parameters())
    opt_model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    original_save()(state, folder / "opt.pt")
    with zipfile.ZipFile(folder / "opt.pt") as src, zipfile.ZipFile(folder / "foreign.pt", "w") as dst:
        for info in src.infolist():  # no padding: every guessed data place is wrong
            dst.writestr(info.filename, src.read(info))
    events = []
    real_start = load_module._CheckpointImage.start_reading

    def start_reading(self):
        events.append("whole file")
        real_start(self)

    def pull_read(self, *args):
        raise AssertionError("the engine read ahead a file whose small records were read whole")

    real_pull_read = device_io.PullRead.__init__
    monkeypatch.setattr(load_module._CheckpointImage, "start_reading", start_reading)
    monkeypatch.setattr(device_io.PullRead, "__init__", pull_read)
    fastpersist.release_load_memory()
    for name in ("opt.pt", "foreign.pt"):
        for verify in (False, True):
            events.clear()
            target = optimizer.state_dict()
            for per_param in target["state"].values():
                for v in per_param.values():
                    v.zero_()
            fastpersist.load_into(target, folder / name, verify=verify, engine=engine)
            assert events == ["whole file"], name
            for i, per_param in state["state"].items():
                for k, v in per_param.items():
                    assert torch.equal(target["state"][i][k], v), (name, i, k)
    # destinations the engine's buffers fill (a GPU's; STREAM_LOADS stands in here): no whole-file read too
    monkeypatch.setattr(load_module, "STREAM_LOADS", True)
    monkeypatch.setattr(device_io.PullRead, "__init__", real_pull_read)
    events.clear()
    target = optimizer.state_dict()
    fastpersist.load_into(target, folder / "opt.pt", engine=engine)
    assert events == [] and torch.equal(target["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    monkeypatch.setattr(load_module, "STREAM_LOADS", False)
    data = bytearray((folder / "opt.pt").read_bytes())
    with zipfile.ZipFile(folder / "opt.pt") as src:
        info = src.getinfo("opt/data/3")
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)  # the local header's own
    data[info.header_offset + 30 + name_len + extra_len] ^= 0x01  # a data byte of record 3
    (folder / "flipped.pt").write_bytes(bytes(data))
    target = optimizer.state_dict()
    with pytest.raises(fastpersist.CheckpointError, match="data/3"):
        fastpersist.load_into(target, folder / "flipped.pt", verify=True, engine=engine)


def test_verify_on_a_file_without_checksums_is_refused_before_anything_is_written(folder):
    with torch_save_setting("compute_crc32", False):
        original_save()({"w": torch.ones(3)}, folder / "nocrc.pt")
    target = {"w": torch.zeros(3)}
    with pytest.raises(fastpersist.CheckpointError, match="without CRC-32 checksums"):
        fastpersist.load_into(target, folder / "nocrc.pt", verify=True)
    assert not target["w"].any(), "refused, yet written"
