"""`fastpersist bench`, `bench sweep` and `bench restart` on tiny sizes: they
finish, write valid CSV, JSON and PNG files, and fail cleanly on bad input.

The three full runs go through `python -m fastpersist` (exit codes as a user
sees them); error cases call cli.main in this process. --cache-drop file
keeps these runs from dropping the whole machine's page cache."""
import csv
import json
import os
import subprocess
import sys

import pytest

from fastpersist import cli, filesystems
from fastpersist.bench import common, default, restart, sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")


def run_bench(*argv, timeout=120):
    out = subprocess.run([sys.executable, "-m", "fastpersist", "bench", *argv], cwd=REPO, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def only_outputs_left(folder, names):
    """The benchmark's own folder inside --folder is gone; only what was asked for is left."""
    assert sorted(os.listdir(folder)) == sorted(names)


def test_small_bench_runs_the_default_rows_at_each_size_and_plots_them(tmp_path):
    plot, table = tmp_path / "s.png", tmp_path / "s.csv"
    out = run_bench("small", "--sizes", "0.001,0.003", "--repeats", "1", "--cache-drop", "file",
                    "--folder", str(tmp_path), "--plot", str(plot), "--csv", str(table))
    assert "x vanilla" in out.stdout and "x ceiling" in out.stdout and "tiny GPT-2" in out.stdout
    assert plot.read_bytes().startswith(PNG_SIGNATURE)
    rows = read_csv(table)
    assert sorted({r["size_gb"] for r in rows if r["contents"] == "model"}) == ["0.001", "0.003"]
    adam = [r for r in rows if r["contents"] == "optimizer"]  # Adam's state of a ~500-parameter model
    assert {(r["operation"], r["mechanism"]) for r in adam} >= {("save, new file", "fastpersist.save"),
                                                                ("load, fresh process", "fastpersist.load")}
    assert "optimizer: Adam state of a tiny GPT-2" in out.stdout and "1452 tensors" in out.stdout
    for size in ("0.001", "0.003"):
        mechanisms = {(r["operation"], r["mechanism"]) for r in rows if r["size_gb"] == size}
        assert ("load, fresh process", "fastpersist.load") in mechanisms
        assert ("save, new file", "raw engine write (ceiling)") in mechanisms
    assert all(float(r["x_vanilla"]) > 0 for r in rows if r["x_vanilla"])
    assert 0.5e6 < min(int(r["file_bytes"]) for r in rows) < 1.5e6  # 1 MB is reachable
    only_outputs_left(tmp_path, ["s.png", "s.csv"])


def test_gpu_bench_runs_its_mechanisms_and_says_when_no_gpu_was_measured(tmp_path):
    """On the CPU (--device cpu) the benchmark runs every mechanism and says
    its numbers are not a GPU's; without --device cpu and without CUDA it
    refuses in one line."""
    import json

    import torch

    result = tmp_path / "g.json"
    out = run_bench("gpu", "--device", "cpu", "--size", "0.005", "--repeats", "1", "--cache-drop", "file",
                    "--folder", str(tmp_path), "--json", str(result))
    assert "NOT a GPU measurement" in out.stdout
    assert "GPUDirect Storage rows: not measured (no CUDA device)" in out.stdout
    report = json.loads(result.read_text())
    assert report["gds"] == {"mode": None, "why_not": "no CUDA device", "stats": None}
    rows = report["results"]
    assert {r["mechanism"] for r in rows} >= {"fastpersist.save", "fastpersist.load(map_location=device)",
                                              "fastpersist.save_async", "one device-to-host copy_ of the state",
                                              "raw engine read to host memory (ceiling)"}
    assert all(r["median_s"] > 0 and r["device"] == "cpu" for r in rows)
    # loads from each source: the disk, the page cache and tmpfs, each with its ceiling and the safetensors rows
    for regime in ("cold", "warm", "tmpfs"):
        mechanisms = {r["mechanism"] for r in rows if r["operation"].startswith(f"load to the device, {regime}")}
        assert {"torch.load(map_location=device)", "fastpersist.load_into (model on the device)",
                "safetensors load_file(device=...)", "fastpersist.safetensors load_file(device=...)"} <= mechanisms
        assert ("raw engine read to host memory (ceiling)" if regime == "cold" else
                "parallel pread into page-locked memory (ceiling)") in mechanisms, regime
    assert set(report["not_measured"]) >= {"fastsafetensors (nogds)", "InstantTensor"}  # peers: CUDA only
    if os.path.isdir("/dev/shm"):  # the tmpfs copies went with the run
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(".fastpersist-bench-")]
    only_outputs_left(tmp_path, ["g.json"])
    refused = subprocess.run([sys.executable, "-m", "fastpersist", "bench", "gpu", "--regimes", "cold,hot"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "expected a comma-separated list of cold, warm, tmpfs" in refused.stderr
    if not torch.cuda.is_available():
        refused = subprocess.run([sys.executable, "-m", "fastpersist", "bench", "gpu", "--folder", str(tmp_path)],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "no CUDA device" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1


def test_safetensors_bench_runs_every_mechanism_and_leaves_nothing(tmp_path):
    import json

    pytest.importorskip("safetensors")
    result = tmp_path / "s.json"
    out = run_bench("safetensors", "--size", "0.01", "--small-mb", "1", "--repeats", "1", "--cache-drop", "file",
                    "--folder", str(tmp_path), "--json", str(result), timeout=300)
    assert "x ref" in out.stdout and "x ceiling" in out.stdout
    rows = json.loads(result.read_text())["results"]
    pairs = {(r["operation"].split(":")[0], r["mechanism"]) for r in rows}
    for operation in ("save", "cold load, fresh process", "warm load"):
        assert (operation, "fastpersist load_file" if "load" in operation else "fastpersist save_file") in pairs
    assert ("cold load, fresh process", "raw engine read") in pairs
    assert ("save", "safetensors save_file + fsync") in pairs
    for mechanism in ("safetensors safe_open (mmap), 4 threads", "fastpersist safe_open, 4 threads"):
        assert ("cold load, fresh process, as transformers reads", mechanism) in pairs
    import importlib.util

    line = next((x for x in out.stderr.splitlines() if x.startswith("not measured (not installed): ")), "")
    missing = set(line.split(": ", 1)[1].split(", ")) if line else set()
    for mechanism, module in (("fastsafetensors (nogds, CPU)", "fastsafetensors"),
                              ("runai-model-streamer", "runai_model_streamer")):
        installed = importlib.util.find_spec(module) is not None
        assert (("cold load, fresh process", mechanism) in pairs) == installed  # a peer where it is installed
        assert (module in missing) != installed  # and a missing one named
    assert all(r["median_s"] > 0 for r in rows)
    only_outputs_left(tmp_path, ["s.json"])


def test_default_bench(tmp_path):
    out = run_bench("--size", "0.01", "--repeats", "1", "--cache-drop", "file", "--folder", str(tmp_path),
                    "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"))
    for text in ("x vanilla", "x ceiling", "page cache:", "machine:", "folder:", "engines:",
                 "where the time went"):
        assert text in out.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert {"machine", "settings", "model", "page_cache", "method", "results", "wall_s"} <= set(doc)
    assert doc["machine"]["filesystem"]["type"] and "options" in doc["machine"]["filesystem"]
    assert doc["page_cache"]["fadvise"] and not doc["page_cache"]["drop_caches"]
    results = doc["results"]
    assert {r["operation"] for r in results} == {"save, new file", "save, over existing", "save, fresh process",
                                                 "load, fresh process", "load, fresh process, file in the page cache",
                                                 "load, same process"}
    mechanisms = {(r["operation"], r["mechanism"]) for r in results}
    for expected in [("save, new file", "raw engine write (ceiling)"), ("load, fresh process", "torch.load(mmap=True)"),
                     ("save, fresh process", "fastpersist.save"),
                     ("save, fresh process", "raw engine write, from scratch (ceiling)"),
                     ("load, same process", "fastpersist.load_into (existing model)"),
                     ("load, fresh process", "raw engine read, from scratch (ceiling)"),
                     ("load, fresh process", "raw engine read, memory and engine set up"),
                     ("load, fresh process, file in the page cache", "fastpersist.load"),
                     ("load, fresh process, file in the page cache",
                      "parallel page-cache read, from scratch (ceiling)")]:
        assert expected in mechanisms
    warm = next(r for r in results if r["operation"] == "load, fresh process, file in the page cache"
                and r["mechanism"] == "fastpersist.load")
    assert warm["x_ceiling"] is not None  # against the parallel read of the bare bytes
    for r in results:
        assert r["median_s"] > 0 and r["gb_per_s"] > 0 and r["rounds"] == 1
        assert abs(r["gib_per_s"] * 2**30 - r["gb_per_s"] * 1e9) < 1e-6 * r["gb_per_s"] * 1e9
        assert r["bytes"] == doc["model"]["file_bytes"]
        assert r["x_ceiling_low"] is None  # one round: no interval
    save = next(r for r in results if r["mechanism"] == "fastpersist.save" and r["operation"] == "save, new file")
    assert {"plan", "write", "fsync", "rename"} <= set(save["phases_s"])
    rows = read_csv(tmp_path / "r.csv")
    assert list(rows[0]) == default.CSV_COLUMNS and len(rows) == len(results)
    only_outputs_left(tmp_path, ["r.json", "r.csv"])


def test_sweep(tmp_path):
    out = run_bench("sweep", "--size", "0.01", "--buffer-sizes", "1", "--num-buffers", "2", "--queue-depths", "4",
                    "--engines", "auto", "--repeats", "1", "--cache-drop", "file", "--folder", str(tmp_path),
                    "--plot", str(tmp_path / "s.png"), "--csv", str(tmp_path / "s.csv"),
                    "--json", str(tmp_path / "s.json"))
    assert "the defaults" in out.stdout
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_SIGNATURE
    rows = read_csv(tmp_path / "s.csv")
    assert list(rows[0]) == sweep.CSV_COLUMNS
    # the grid asked for plus the defaults, each written and read
    assert len(rows) == 4 and {r["operation"] for r in rows} == {"write", "read"}
    assert {r["is_default"] for r in rows} == {"True", "False"}
    assert {r["buffer_size"] for r in rows} == {str(1 << 20), str(16 << 20)}
    doc = json.loads((tmp_path / "s.json").read_text())
    assert {v["operation"] for v in doc["verdicts"]} == {"write", "read"}
    only_outputs_left(tmp_path, ["s.png", "s.csv", "s.json"])


def test_restart(tmp_path):
    out = run_bench("restart", "--models", "tiny", "--repeats", "1", "--shard-size", "0.002", "--cache-drop", "file",
                    "--folder", str(tmp_path), "--plot", str(tmp_path / "r.png"), "--csv", str(tmp_path / "r.csv"),
                    "--json", str(tmp_path / "r.json"))
    assert "NOT the full models" in out.stdout
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_SIGNATURE
    rows = read_csv(tmp_path / "r.csv")
    assert list(rows[0]) == restart.CSV_COLUMNS
    assert [(r["phase"], r["mechanism"]) for r in rows] == (
        [("checkpoint", m) for m in restart.CHECKPOINT] + [("restart", m) for m in restart.RESTART])
    # 3.7 MB: the 2.1 MB embedding (with the head tied to it) alone, the rest in a second file
    assert {r["files"] for r in rows} == {"2"}
    doc = json.loads((tmp_path / "r.json").read_text())
    for r in doc["results"]:
        if r["phase"] == "restart":
            assert set(r["phases_s"]) == {"build", "restore", "first step"}
    only_outputs_left(tmp_path, ["r.png", "r.csv", "r.json"])


@pytest.mark.parametrize("argv", [
    ["bench", "--size", "0"], ["bench", "--size", "many"], ["bench", "--repeats", "0"],
    ["bench", "--engines", "posixx"], ["bench", "--dtype", "int8"], ["bench", "--no-such-option"],
    ["bench", "sweep", "--buffer-sizes", "0.001"], ["bench", "sweep", "--num-buffers", "1"],
    ["bench", "sweep", "--queue-depths", "x"], ["bench", "restart", "--layers", "0"],
    ["bench", "restart", "--engine", "all"], ["bench", "nonsense"],
])
def test_wrong_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def _one_line_error(argv, capsys) -> str:
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastpersist bench: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_missing_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    missing = tmp_path / "file" / "sub"  # fails for root too
    assert "does not exist" in _one_line_error(["bench", "--size", "0.01", "--folder", str(missing)], capsys)
    assert "does not exist" in _one_line_error(["bench", "restart", "--models", "tiny", "--folder", str(missing),
                                                "--plot", str(tmp_path / "p.png")], capsys)


def test_unwritable_folder_is_one_line(capsys, tmp_path):
    if not os.path.isdir("/sys") or _mkdir_works("/sys"):
        pytest.skip("no folder here that refuses new files to everyone")
    line = _one_line_error(["bench", "sweep", "--size", "0.01", "--folder", "/sys",
                            "--plot", str(tmp_path / "p.png"), "--csv", str(tmp_path / "c.csv")], capsys)
    assert "cannot write in folder /sys" in line


def _mkdir_works(folder):
    try:
        os.rmdir(__import__("tempfile").mkdtemp(dir=folder))
        return True
    except OSError:
        return False


def test_output_in_missing_folder_is_one_line(tmp_path, capsys):
    line = _one_line_error(["bench", "--size", "0.01", "--folder", str(tmp_path),
                            "--json", str(tmp_path / "nowhere" / "r.json")], capsys)
    assert "nowhere" in line
    assert os.listdir(tmp_path) == []


def test_missing_package_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now fails
    line = _one_line_error(["bench", "--size", "0.01", "--folder", str(tmp_path)], capsys)
    assert "pip install 'fastpersist[bench]'" in line


# -- pieces ---------------------------------------------------------------------


def test_round_order_changes_neighbours_and_repeats():
    items = list("abcdef")
    orders = [common.round_order(items, r) for r in range(7)]
    assert orders[0] == items
    assert all(sorted(o) == items for o in orders)
    assert orders == [common.round_order(items, r) for r in range(7)]  # seeded: a run can be repeated
    before_c = {o[o.index("c") - 1] if o.index("c") else None for o in orders}
    assert len(before_c) >= 3  # not the same neighbour round after round


def test_sharding_keeps_tied_tensors_together():
    entries = [("embed", 6, 1), ("layer", 3, 2), ("norm", 1, 3), ("head", 6, 1), ("big", 20, 4)]
    assert restart.shard(entries, 8) == [["embed", "head"], ["layer", "norm"], ["big"]]


def test_default_model_comes_close_to_the_size():
    import torch

    from fastpersist.bench import models

    for gb in (0.01, 0.2, 2.0):
        config, _, _ = default.sized_model(int(gb * 1e9), torch.float32)
        assert abs(models.param_bytes(config, torch.float32) / 1e9 - gb) < max(0.1 * gb, 0.01)


def test_cache_dropper_checks_with_mincore(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    fraction = common.cached_fraction(str(path))
    assert fraction is None or fraction > 0.5  # just written: cached
    dropper = common.CacheDropper("file")
    dropper.drop(str(path))
    assert dropper.works and "posix_fadvise" in dropper.describe()
    assert dropper.most_cached is None or dropper.most_cached < 0.01


def test_filesystem_of_reports_mount_options(tmp_path):
    fs = filesystems.filesystem_of(str(tmp_path))
    assert fs is not None and fs["options"].startswith(("rw", "ro"))


def test_ceiling_touches_the_loads_pieces():
    # the raw read's touch goes over the same pieces a load returns, in order, within the memory read
    import mmap

    import torch

    memory = mmap.mmap(-1, 100)
    memory[:] = bytes(range(100))
    pieces = common.pieces_of(memory, [40, 8, 40, 40], torch.float32)
    assert [p.numel() * 4 for p in pieces] == [40, 8, 40, 12]
    assert [p.data_ptr() - pieces[0].data_ptr() for p in pieces] == [0, 40, 48, 88]
    assert bytes(pieces[1].numpy().tobytes()) == bytes(range(40, 48))


def test_ratios_pair_the_rounds():
    # each round's two times are compared with each other: the third round
    # was slow for both and cancels, where a ratio of medians mixes rounds
    reference = common.Series("load", "ceiling", times=[1.0, 1.0, 3.0])
    series = common.Series("load", "mine", times=[1.25, 3.0, 3.75])
    assert common.ratio(reference, series) == 0.8  # median of 0.8, 1/3, 0.8
    assert abs(reference.median / series.median - 1 / 3) < 1e-9
    unpaired = common.Series("load", "mine", times=[2.0, 2.0])
    assert common.ratio(reference, unpaired) == 0.5  # rounds that do not pair up: medians
    assert common.ratio(None, series) is None and common.ratio(reference, common.Series("load", "none")) is None


def test_touch_all_reads_a_tied_tensor_once(monkeypatch):
    import torch

    weight = torch.ones(8)
    summed = []
    real_sum = torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum", lambda self, *a, **k: summed.append(self.numel()) or real_sum(self))
    common.touch_all({"embed": weight, "head": weight, "half": weight[:4], "list": [weight.view(2, 4)]})
    assert summed == [8, 4, 8]  # the head is the embedding; a part or a reshaped view is not


def test_ratio_interval_from_order_statistics():
    ceiling = common.Series("load", "ceiling", times=[1.0] * 15)
    mine = common.Series("load", "mine", times=[1.0 + i / 10 for i in range(15)])  # ratios 1/1.0 ... 1/2.4
    ratios = sorted(1 / (1.0 + i / 10) for i in range(15))
    low, high, coverage = common.ratio_interval(ceiling, mine)
    # 4th smallest to 4th largest of 15: 1 - 2 P(Bin(15, 1/2) <= 3) = 0.965; the 5th would give 0.882 < 0.9
    assert (low, high) == (ratios[3], ratios[11]) and abs(coverage - 0.96484375) < 1e-12
    assert low <= common.ratio(ceiling, mine) <= high
    seven = common.ratio_interval(common.Series("l", "c", times=[1.0] * 7),
                                  common.Series("l", "m", times=[1.0 + i / 10 for i in range(7)]))
    assert seven[0] == 1 / 1.6 and seven[1] == 1.0 and abs(seven[2] - 0.984375) < 1e-12  # all 7: the widest
    few = common.ratio_interval(common.Series("l", "c", times=[1.0, 1.0, 1.0]),
                                common.Series("l", "m", times=[1.0, 2.0, 4.0]))
    assert few == (0.25, 1.0, 0.75)  # 3 rounds cannot reach 90%: the coverage says so
    assert common.ratio_interval(ceiling, common.Series("load", "one", times=[1.0])) is None


@pytest.mark.parametrize("script", ["torch_save_tensor.py", "torch_load_tensor.py"])
def test_micro_benchmark_scripts_run_on_the_one_harness(script, tmp_path):
    """benchmarks/ scripts are thin users of fastpersist.bench.micro: one
    round of a small tensor prints the FastPersist line for each mechanism."""
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", script), "--size", "0.004",
                          "--repeats", "1", "--engines", "psync", "--folder", str(tmp_path)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "FASTPERSIST_AUTOPATCH": "0"})
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if " -- " in line]
    names = [line.split(" -- ")[0] for line in lines]
    expected = (["test_save", "fastpersist_save[psync]", "raw_engine_write[psync]"] if "save" in script else
                ["torch_load", "torch_load_mmap", "fastpersist_load[psync]", "fastpersist_load_into[psync]",
                 "raw_engine_read[psync]"])
    assert names == expected, out.stdout
    for line in lines:
        assert re.match(r"\S+ -- 0\.00 GB, \d+\.\d\d secs, \d+\.\d\d GB/s", line), line


def test_small_save_script_reports_every_mechanism_and_leaves_nothing(tmp_path):
    """benchmarks/small_save.py at one round of one save: a row per mechanism,
    torch.save + fsync at 1.000, and no checkpoint left behind."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "small_save.py"), "--repeats", "1",
                          "--saves", "1", "--folder", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {line[:28].strip(): line[28:].split() for line in out.stdout.splitlines()[2:]}
    assert set(rows) == {"torch.save + fsync", "fastpersist.save", "atomic=False", "atomic=False, fsync=False"}
    assert rows["torch.save + fsync"][1] == "1.000"
    assert os.listdir(tmp_path) == []


def test_per_tensor_script_reports_every_mechanism_and_leaves_nothing(tmp_path):
    """benchmarks/per_tensor.py at one round of 200 tensors: a row per
    mechanism with its cost a tensor, the saves' beyond the raw write."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "per_tensor.py"), "--tensors", "200",
                          "--repeats", "1", "--folder", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {line[:42].strip(): line[42:].split() for line in out.stdout.splitlines()[2:]}
    assert set(rows) == {"torch.save + fsync", "fastpersist.save", "fastpersist.save (Python pickle writer)",
                         "raw engine write (same bytes)", "torch.load", "fastpersist.load"}
    assert all(float(v[1]) > 0 for v in rows.values())
    assert rows["fastpersist.save"][2] != "-" and rows["torch.load"][2] == "-"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("script", ["torch_save_model.py", "torch_load_model.py"])
def test_model_benchmark_scripts_run_and_refuse_a_missing_gpu(script, tmp_path):
    import torch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, os.path.join(root, "benchmarks", script), "--model", "llama-tiny", "--repeats", "1",
               "--engines", "psync", "--folder", str(tmp_path)]
    env = {**os.environ, "FASTPERSIST_AUTOPATCH": "0"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    names = [line.split(" -- ")[0] for line in out.stdout.splitlines() if " -- " in line]
    assert "fastpersist_save[psync]" in names if "save" in script else "fastpersist_load_into[psync]" in names
    if not torch.cuda.is_available():
        refused = subprocess.run(command + ["--gpu"], capture_output=True, text=True, timeout=300, env=env)
        assert refused.returncode != 0 and "--gpu: no CUDA device is available here" in refused.stderr
