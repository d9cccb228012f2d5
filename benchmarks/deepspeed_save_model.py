"""DeepSpeed save_checkpoint through its own TorchCheckpointEngine and its
FastCheckpointEngine (DeepNVMe: libaio, O_DIRECT, pinned double buffers)
against fastpersist's CheckpointEngine (synchronous and asynchronous), on a
GPT-2-shaped model on DeepSpeed's CPU accelerator (gloo, one rank, ZeRO
stage 0: model and AdamW state in one file).

For each engine: the time save_checkpoint blocks training ("blocked") and
the time until the checkpoint is durable ("durable": the torch engine's
files fsynced afterwards, since it fsyncs nothing, and the fast engine's
folders, since it fsyncs its files only; the asynchronous engine's commit,
which DeepSpeed would run at the next step). Engines alternate in shuffled
rounds after one warm-up round; medians and per-round ratios against the
torch engine. A new tag (folder) every save, as step-numbered checkpoints
are.

DeepSpeed's fast engine needs its async_io op built (a compiler and
libaio-dev) and, on the CPU accelerator, two things DeepSpeed 0.19 leaves
out, which this script supplies: its native pinned-memory backend
(DS_PIN_MEMORY_BACKEND=native: the CPU accelerator pins nothing otherwise
and torch refuses to) and its generic utils op (the CPU accelerator's is
not implemented; the fast writer needs its cast_to_byte_tensor). Where it
cannot be built, the table says why and leaves it out.

    python benchmarks/deepspeed_save_model.py --layers 12 --repeats 5
"""
import dataclasses
import os
import socket
import statistics
import tempfile
import time

ENGINES = ("torch", "deepspeed fast", "fastpersist", "fastpersist async")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsync_tree(folder: str) -> None:
    from fastpersist.bench.common import fsync_path

    for root, _, files in os.walk(folder):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def _deepspeed_fast_engine(deepspeed, config: dict):
    """(DeepSpeed's FastCheckpointEngine, None), or (None, why it cannot run here)."""
    from deepspeed.accelerator import get_accelerator

    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime.model_checkpointing.utils import create_data_parallel_writer_config
        from deepspeed.utils import groups

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return None, "DeepSpeed's async_io op cannot be built here (libaio-dev and a compiler)"
        if get_accelerator().device_name() == "cpu":
            import deepspeed.io.fast_file_writer as fast_file_writer
            from deepspeed.ops.op_builder.utils import UtilsBuilder

            fast_file_writer.UtilsBuilder = UtilsBuilder  # the CPU accelerator's raises "not implemented"
        # data_parallel "replica": without it DeepSpeed 0.19.8 asks a rank it does not know (AttributeError dp_rank)
        fast = {**config, "checkpoint": {"writer": {"type": "fast", "data_parallel": "replica"}},
                "aio": {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False, "overlap_events": True}}
        writers = create_data_parallel_writer_config(groups=groups, parallel_unit="REPLICA", zero_stage=0,
                                                     has_moe_layers=False)
        return FastCheckpointEngine(DeepSpeedConfig(fast), writers, optimize_dp_state=True), None
    except Exception as exc:  # noqa: BLE001 - reported in the table instead of the row
        return None, f"{type(exc).__name__}: {exc}"


def main(argv=None) -> None:
    # before fastpersist is imported: DeepSpeed's torch engine calls the torch.save it would otherwise patch
    for key, value in (("DS_ACCELERATOR", "cpu"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("CROSS_SIZE", "1"),
                       ("CROSS_RANK", "0"), ("DS_PIN_MEMORY_BACKEND", "native"), ("FASTPERSIST_AUTOPATCH", "0")):
        os.environ.setdefault(key, value)
    from fastpersist.bench import common

    args = common.model_script_arguments(__doc__, argv, layers=12, repeats=5)
    import deepspeed
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from fastpersist.bench import models
    from fastpersist.integrations.deepspeed import FastPersistCheckpointEngine

    deepspeed.init_distributed(dist_backend="gloo")
    model = models.build(dataclasses.replace(models.CONFIGS["gpt2"], layers=args.layers))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    fast_engine, why_not_fast = _deepspeed_fast_engine(deepspeed, config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    # one step, so that AdamW's state exists and is saved
    engine.backward(sum(p.float().sum() for p in engine.module.parameters()) * 0.0)
    engine.step()
    checkpoint_engines = {"torch": TorchCheckpointEngine(engine._config), "deepspeed fast": fast_engine,
                          "fastpersist": FastPersistCheckpointEngine(),
                          "fastpersist async": FastPersistCheckpointEngine(asynchronous=True)}
    engines = [name for name in ENGINES if checkpoint_engines[name] is not None]
    blocked = {name: [] for name in engines}
    durable = {name: [] for name in engines}
    size = 0
    with tempfile.TemporaryDirectory(prefix=".fastpersist-bench-", dir=args.folder or ".") as folder:
        for r in range(args.repeats + 1):
            for name in common.round_order(engines, r):
                engine.checkpoint_engine = checkpoint_engines[name]
                tag = f"{name.replace(' ', '-')}-{r}"
                start = time.perf_counter()
                engine.save_checkpoint(folder, tag=tag)
                saved = time.perf_counter()
                if name in ("torch", "deepspeed fast"):
                    _fsync_tree(os.path.join(folder, tag))
                elif engine.checkpoint_engine.is_decoupled():
                    engine.checkpoint_engine.cleanup()  # the commit DeepSpeed runs at the next step
                end = time.perf_counter()
                if r:  # round 0 warms up
                    blocked[name].append(saved - start)
                    durable[name].append(end - start)
                for root, _, files in os.walk(os.path.join(folder, tag)):
                    for f in files:
                        size = os.path.getsize(os.path.join(root, f)) if f.startswith("mp_rank_00") else size
                        os.unlink(os.path.join(root, f))
    params = sum(p.numel() for p in model.parameters())
    print(f"DeepSpeed {deepspeed.__version__}, GPT-2 small x {args.layers} layers ({params / 1e6:.0f} M parameters), "
          f"ZeRO 0, checkpoint {size / 1e9:.2f} GB, {args.repeats} rounds")
    print(f"{'engine':<20}{'blocked s':>10}{'durable s':>11}{'GB/s durable':>14}{'x torch blocked':>17}"
          f"{'x torch durable':>17}")
    if why_not_fast:
        print(f"deepspeed fast: not run here: {why_not_fast}")
    for name in engines:
        xb = statistics.median(t / s for t, s in zip(blocked["torch"], blocked[name]))
        xd = statistics.median(t / s for t, s in zip(durable["torch"], durable[name]))
        print(f"{name:<20}{statistics.median(blocked[name]):>10.3f}{statistics.median(durable[name]):>11.3f}"
              f"{size / statistics.median(durable[name]) / 1e9:>14.2f}{xb:>17.2f}{xd:>17.2f}")


if __name__ == "__main__":
    main()
