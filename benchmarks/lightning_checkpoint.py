"""Lightning's Trainer.save_checkpoint through its own CheckpointIO plugins
against fastpersist's, on a GPT-2-shaped model with AdamW state trained for
one step on CPU.

Mechanisms, swapped on the same Trainer (``trainer.strategy.checkpoint_io``):
Lightning's TorchCheckpointIO, Lightning's AsyncCheckpointIO around it,
fastpersist's FastPersistCheckpointIO and AsyncFastPersistCheckpointIO. For
each, the time save_checkpoint blocks training ("blocked", which includes
Lightning gathering the state) and the time until the file is durable
("durable": Lightning's files fsynced afterwards, since they are not; the
asynchronous plugins waited for). Beside them, two references in the same
rounds: one copy_ of every tensor of the checkpoint into memory already
touched (the floor of any snapshot), and the raw engine writing as many
bytes to a new file (the disk's ceiling). A new step-numbered file every
save. Shuffled rounds after one warm-up round; medians and per-round ratios.

    python benchmarks/lightning_checkpoint.py --layers 12 --repeats 5
"""
import dataclasses
import os
import statistics
import tempfile
import time

MECHANISMS = ("TorchCheckpointIO", "AsyncCheckpointIO", "FastPersistCheckpointIO", "AsyncFastPersistCheckpointIO")
REFERENCES = ("copy_ of the state", "raw engine write")


def main(argv=None) -> None:
    # before fastpersist is imported: Lightning's plugins write as they do without it
    os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")
    from fastpersist.bench import common

    args = common.model_script_arguments(__doc__, argv, layers=12, repeats=5)

    import lightning
    import torch
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from fastpersist import FastFileWriter
    from fastpersist.bench import models
    from fastpersist.integrations.lightning import AsyncFastPersistCheckpointIO, FastPersistCheckpointIO

    config = dataclasses.replace(models.CONFIGS["gpt2"], layers=args.layers)

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = models.build(config)

        def training_step(self, batch, _):
            return self.model(batch).float().square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    ids = torch.randint(0, config.vocab, (2, 16))
    trainer = lightning.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(ids, batch_size=2))  # AdamW's state exists after a step
    plugins = {"TorchCheckpointIO": TorchCheckpointIO(), "AsyncCheckpointIO": AsyncCheckpointIO(TorchCheckpointIO()),
               "FastPersistCheckpointIO": FastPersistCheckpointIO(),
               "AsyncFastPersistCheckpointIO": AsyncFastPersistCheckpointIO()}
    state = trainer._checkpoint_connector.dump_checkpoint()
    tensors = list({t.untyped_storage().data_ptr(): t for t in common.tensors_in(state)}.values())
    destinations = [torch.empty_like(t).copy_(t) for t in tensors]  # touched once, like a snapshot in use
    blocked = {name: [] for name in MECHANISMS + REFERENCES}
    durable = {name: [] for name in MECHANISMS + REFERENCES}
    size = 0
    with tempfile.TemporaryDirectory(prefix=".fastpersist-bench-", dir=args.folder or ".") as folder:
        for r in range(args.repeats + 1):
            for name in common.round_order(MECHANISMS + REFERENCES, r):
                path = os.path.join(folder, f"{name}-step{r}.ckpt")
                start = time.perf_counter()
                if name == "copy_ of the state":
                    with torch.no_grad():
                        for d, s in zip(destinations, tensors):
                            d.copy_(s)
                    saved = end = time.perf_counter()
                elif name == "raw engine write":
                    with FastFileWriter(path, exclusive=True, sole_writer=True, expected_size=size) as w:
                        for t in tensors:
                            w.write_address(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                        saved = time.perf_counter()
                    end = time.perf_counter()
                else:
                    trainer.strategy.checkpoint_io = plugins[name]
                    trainer.save_checkpoint(path)
                    saved = time.perf_counter()
                    plugins[name].teardown()  # the asynchronous plugins' wait for their saves
                    if name in ("TorchCheckpointIO", "AsyncCheckpointIO"):
                        common.fsync_path(path)
                        common.fsync_path(folder)
                    end = time.perf_counter()
                if r:  # round 0 warms up
                    blocked[name].append(saved - start)
                    durable[name].append(end - start)
                if name == "TorchCheckpointIO":
                    size = os.path.getsize(path)
                if os.path.exists(path):
                    os.unlink(path)
    state_bytes = sum(t.untyped_storage().nbytes() for t in tensors)
    print(f"lightning {lightning.__version__}, torch {torch.__version__}; GPT-2 small x {args.layers} layers, "
          f"AdamW: {len(tensors)} tensors, {state_bytes / 1e9:.2f} GB of state, {size / 1e9:.2f} GB file; "
          f"{args.repeats} rounds")
    print(f"{'mechanism':<30}{'blocked s':>10}{'durable s':>11}{'x Torch blocked':>17}{'x Torch durable':>17}"
          f"{'blocked / copy_':>17}")
    for name in MECHANISMS + REFERENCES:
        xb = statistics.median(t / s for t, s in zip(blocked["TorchCheckpointIO"], blocked[name]))
        xd = statistics.median(t / s for t, s in zip(durable["TorchCheckpointIO"], durable[name]))
        xc = statistics.median(s / c for s, c in zip(blocked[name], blocked["copy_ of the state"]))
        print(f"{name:<30}{statistics.median(blocked[name]):>10.3f}{statistics.median(durable[name]):>11.3f}"
              f"{xb:>17.2f}{xd:>17.2f}{xc:>17.2f}")


if __name__ == "__main__":
    main()
