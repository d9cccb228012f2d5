"""Lightning checkpoints through fastpersist: a real Trainer fits a small
model on CPU with the plugins, its checkpoints are standard torch files
(vanilla torch.load reads them), training resumes from them, and the
asynchronous plugin's files hold the state of the moment they were taken
although training went on changing it."""
import os

import pytest
import torch

lightning = pytest.importorskip("lightning", reason="lightning is not installed (pip install 'fastpersist[lightning]')")

import fastpersist  # noqa: E402
from fastpersist.integrations.lightning import AsyncFastPersistCheckpointIO, FastPersistCheckpointIO  # noqa: E402
from fastpersist.patching import original_load  # noqa: E402

L = lightning.pytorch


def regression_class(pl):
    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
            self.seen_at_epoch_end = {}

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_train_epoch_end(self):
            # what a checkpoint taken at this epoch's end must hold
            self.seen_at_epoch_end[self.current_epoch] = {k: v.detach().clone()
                                                          for k, v in self.state_dict().items()}

    return Regression


Regression = regression_class(L)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)


def trainer(folder, plugin, epochs, pl=L, **kwargs):
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=folder, filename="epoch{epoch}", every_n_epochs=1,
                                               save_top_k=-1, save_last=True, auto_insert_metric_name=False)
    return pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, plugins=[plugin], callbacks=[checkpoints],
                      logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def package(name: str) -> tuple:
    """(the Lightning package's trainer module, fastpersist's plugins for it)."""
    if name == "lightning":
        return L, (FastPersistCheckpointIO, AsyncFastPersistCheckpointIO)
    pl = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")
    from fastpersist.integrations import pytorch_lightning as plugins
    return pl, (plugins.FastPersistCheckpointIO, plugins.AsyncFastPersistCheckpointIO)


@pytest.mark.parametrize("which", ["lightning", "pytorch_lightning"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_fit_checkpoint_and_resume(tmp_path, which, asynchronous, monkeypatch):
    pl, plugins = package(which)
    plugin, Model = plugins[asynchronous], regression_class(pl)
    torch.manual_seed(0)
    saved = []
    real_save = fastpersist.async_save.save_async if asynchronous else fastpersist.save_api.save
    module = fastpersist.integrations._checkpoint_io
    name = "save_async" if asynchronous else "save"
    monkeypatch.setattr(module, name, lambda obj, path, **kw: (saved.append(path), real_save(obj, path, **kw))[1])

    model = Model()
    trainer(tmp_path, plugin(), epochs=3, pl=pl).fit(model, data())
    fastpersist.wait_for_releases()  # last.ckpt was replaced: its old copy is freed in the background
    files = sorted(os.listdir(tmp_path))
    assert files == ["epoch0.ckpt", "epoch1.ckpt", "epoch2.ckpt", "last.ckpt"], files
    assert sorted({os.path.basename(p) for p in saved}) == ["epoch0.ckpt", "epoch1.ckpt", "epoch2.ckpt", "last.ckpt"]
    for epoch in range(3):
        ckpt = original_load()(tmp_path / f"epoch{epoch}.ckpt", weights_only=False)  # vanilla torch reads it
        assert ckpt["epoch"] == epoch
        # the weights of that epoch's end, although training went on changing them
        for key, value in model.seen_at_epoch_end[epoch].items():
            assert torch.equal(ckpt["state_dict"][key], value), (epoch, key)
        assert ckpt["optimizer_states"][0]["state"], "optimizer state saved"

    torch.manual_seed(1)  # other initial weights: the checkpoint must bring them back
    resumed = Model()
    t = trainer(tmp_path / "resumed", plugin(), epochs=4, pl=pl)
    t.fit(resumed, data(), ckpt_path=str(tmp_path / "last.ckpt"), weights_only=False)
    assert t.current_epoch == 4 and sorted(resumed.seen_at_epoch_end) == [3]  # only the epoch it had left

    torch.manual_seed(0)
    uninterrupted = Model()
    trainer(tmp_path / "uninterrupted", plugin(), epochs=4, pl=pl).fit(uninterrupted, data())
    for key, value in uninterrupted.state_dict().items():  # step for step the same training
        assert torch.equal(resumed.state_dict()[key], value), key


def test_a_failed_background_save_is_raised_by_the_plugin(tmp_path, monkeypatch):
    """A background write that fails (ENOSPC here) comes out of the plugin's
    next call and out of teardown, never silently; other saves land."""
    import errno
    import sys

    single = sys.modules["fastpersist.save"]
    real = single.write_plan_to_path

    def failing(plan, path, *args, **kwargs):
        if path.endswith("bad.ckpt"):
            raise OSError(errno.ENOSPC, "No space left on device (simulated)", path)
        return real(plan, path, *args, **kwargs)

    monkeypatch.setattr(single, "write_plan_to_path", failing)
    plugin = AsyncFastPersistCheckpointIO()
    plugin.save_checkpoint({"w": torch.ones(3)}, tmp_path / "ok.ckpt")
    plugin.save_checkpoint({"w": torch.ones(3)}, tmp_path / "bad.ckpt")
    fastpersist.wait_for_saves()
    with pytest.raises(OSError, match="No space left"):
        plugin.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "next.ckpt")  # the failure surfaces here
    plugin.teardown()  # nothing pending or failed left
    assert torch.equal(original_load()(tmp_path / "ok.ckpt")["w"], torch.ones(3))
    assert not (tmp_path / "bad.ckpt").exists()
    plugin.save_checkpoint({"w": torch.ones(3)}, tmp_path / "bad.ckpt")
    with pytest.raises(OSError, match="No space left"):
        plugin.teardown()


def test_remove_waits_for_the_save_and_remote_paths_go_to_lightning(tmp_path, monkeypatch):
    plugin = AsyncFastPersistCheckpointIO()
    plugin.save_checkpoint({"w": torch.arange(1_000_000)}, tmp_path / "a.ckpt")
    plugin.remove_checkpoint(tmp_path / "a.ckpt")  # waits for the write, then removes: nothing left
    fastpersist.wait_for_saves()
    assert sorted(os.listdir(tmp_path)) == []
    calls = []
    monkeypatch.setattr(plugin._remote, "save_checkpoint", lambda c, p: calls.append(p))
    plugin.save_checkpoint({"w": torch.ones(1)}, "memory://bucket/x.ckpt")
    assert calls == ["memory://bucket/x.ckpt"]
    with pytest.raises(TypeError, match="storage_options"):
        plugin.save_checkpoint({}, tmp_path / "b.ckpt", storage_options={"x": 1})
    with pytest.raises(ValueError, match="engine"):
        FastPersistCheckpointIO(engine="bogus")


def test_file_urls_are_local_paths(tmp_path):
    plugin = FastPersistCheckpointIO()
    url = f"file://{tmp_path}/sub/x.ckpt"
    plugin.save_checkpoint({"w": torch.arange(10)}, url)
    assert torch.equal(original_load()(tmp_path / "sub" / "x.ckpt")["w"], torch.arange(10))
    assert torch.equal(plugin.load_checkpoint(url)["w"], torch.arange(10))
    plugin.remove_checkpoint(url)
    assert not (tmp_path / "sub" / "x.ckpt").exists()
    with pytest.raises(FileNotFoundError, match="x.ckpt"):
        plugin.load_checkpoint(url)


def test_the_checkpoint_benchmark_runs(tmp_path):
    # benchmarks/lightning_checkpoint.py at its smallest: every plugin and reference measured and reported
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "lightning_checkpoint.py")
    out = subprocess.run([sys.executable, script, "--layers", "1", "--repeats", "1", "--folder", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split("  ")[0] for line in out.stdout.splitlines()}
    assert {"TorchCheckpointIO", "AsyncCheckpointIO", "FastPersistCheckpointIO", "AsyncFastPersistCheckpointIO",
            "copy_ of the state", "raw engine write"} <= rows
    assert os.listdir(tmp_path) == []  # its checkpoints removed
