"""DeepSpeed checkpoints through FastPersistCheckpointEngine: a real
DeepSpeedEngine (DeepSpeed's CPU accelerator, gloo) trains, saves with
save_checkpoint, and a new engine resumed with load_checkpoint ends where
uninterrupted training ends; the asynchronous engine's file holds the state
of the moment it was saved although training went on. Run in a child
process: DeepSpeed picks its accelerator from the environment at import
and initialises torch.distributed."""
import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install 'fastpersist[deepspeed]')", allow_module_level=True)

@pytest.fixture(autouse=True)
def no_shared_memory_left():
    """DeepSpeed's CPU accelerator leaves a 64 MiB allreduce buffer in
    /dev/shm per process; the runs here remove theirs (the machine's RAM)."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    yield
    if os.path.isdir("/dev/shm"):
        for name in set(os.listdir("/dev/shm")) - before:
            if name.startswith("deepspeed_"):
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass


SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch, deepspeed
    import fastpersist
    from fastpersist.integrations import deepspeed as integration
    from fastpersist.patching import original_load

    folder, asynchronous = sys.argv[1], sys.argv[2] == "async"
    written = []
    for name in ("save", "save_async"):
        real = getattr(integration, name)
        setattr(integration, name, lambda obj, path, _real=real, **kw: (written.append(os.path.basename(path)),
                                                                          _real(obj, path, **kw))[1])
    deepspeed.init_distributed(dist_backend="gloo")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 8, generator=g) for _ in range(6)]
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}

    def engine(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        e, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        e.checkpoint_engine = integration.FastPersistCheckpointEngine(asynchronous=asynchronous)
        return e

    def step(e, x):
        e.backward(e(x).pow(2).sum())
        e.step()

    def weights(e):
        return {k: v.detach().clone() for k, v in e.module.state_dict().items()}

    straight = engine(0)
    for x in batches[:3]:
        step(straight, x)
    at_save = weights(straight)
    straight.save_checkpoint(folder, tag="s3")
    for x in batches[3:]:  # training goes on changing the weights while the file may be written
        step(straight, x)
    straight.checkpoint_engine.cleanup()
    saved = original_load()(os.path.join(folder, "s3", "mp_rank_00_model_states.pt"), weights_only=False)
    file_holds_save_time = all(torch.equal(saved["module"][k], v) for k, v in at_save.items())

    resumed = engine(1)
    resumed.load_checkpoint(folder, tag="s3")
    for x in batches[3:]:
        step(resumed, x)
    end, resumed_end = weights(straight), weights(resumed)
    print(json.dumps({"written": written, "file_holds_save_time": file_holds_save_time,
                      "latest": open(os.path.join(folder, "latest")).read(),
                      "resume_equal": all(torch.equal(end[k], resumed_end[k]) for k in end)}))
''')


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_checkpoint_and_resume(tmp_path, mode):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", FASTPERSIST_AUTOPATCH="0")
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), mode], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert "mp_rank_00_model_states.pt" in result["written"]
    assert result["latest"] == "s3"
    assert result["file_holds_save_time"]
    assert result["resume_equal"]


def test_the_benchmark_runs_at_its_smallest(tmp_path):
    """benchmarks/deepspeed_save_model.py at one layer and one round: every
    engine measured and reported, DeepSpeed's own fast engine (DeepNVMe)
    included, and its checkpoints removed."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "deepspeed_save_model.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    out = subprocess.run([sys.executable, script, "--layers", "1", "--repeats", "1", "--folder", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "not run here" not in out.stdout, out.stdout
    rows = {line[:20].strip() for line in out.stdout.splitlines()}
    assert {"torch", "deepspeed fast", "fastpersist", "fastpersist async"} <= rows, out.stdout
    assert os.listdir(tmp_path) == []
