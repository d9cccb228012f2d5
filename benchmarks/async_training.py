"""A small CPU training loop that checkpoints every K steps: how much does
checkpointing slow training down, with no checkpoint, vanilla torch.save
(+ fsync of the file), fastpersist.save and fastpersist.save_async?

The model is GPT-2-shaped with random weights (benchmarks/models.py, or the
two built here: ``gpt2-6l``, GPT-2 small's width with 6 of its 12 layers, the
default, chosen so that one step takes a few tenths of a second on 2 cores;
``tiny``, for checking the benchmark itself). Each step is a batch of random
token ids, forward, cross-entropy, backward, AdamW (fused), so each
checkpoint, ``{"model": model.state_dict(), "optimizer": opt.state_dict(),
"step": i}``, holds the weights and both Adam moments (about 12 bytes per
parameter in float32).

Per round, every mode runs the same N-step loop on the same model (it keeps
training; the checkpoint's size does not change), in a fresh folder, writing
``ckpt_{step}.pt`` (or overwriting ``latest.pt`` with ``--latest``); the
files are deleted and the file system synced after the loop, outside the
timing (deleting costs about 1 s per GB on a disk with online discard).
save_async waits for the previous save only if it is still pending at the
next checkpoint (counted as blocked time), and for the last one at the end,
inside the loop's time. Per mode the report gives steps/s of the whole loop,
its ratio to ``none`` (median of the per-round ratios), and the time the
training thread spent blocked per checkpoint: inside the save call plus any
wait (median and max over every checkpoint of every round). The first
save_async of the process also touches fresh snapshot memory; its blocked
time is shown apart. "step alone" is the median time of one training step
without its checkpoint: where it grows over ``none``'s, the background
writer competes with training for the cores.

The reference ``memcpy`` is one in-memory copy of the state: every distinct
storage of the checkpoint copied with ``copy_`` into a preallocated uint8
buffer of the same total size that was touched before (an anonymous mapping
with MADV_HUGEPAGE, like save_async's snapshot memory), timed ``--copies``
times per round. The last lines compare save_async's median blocked time
with it (target <= 1.2x) and save_async's throughput with ``none`` (target:
within 10%).

The measurement (about 5-8 minutes on the 2-core VM: 3 rounds x 4 loops of
60 steps of ~0.4 s, plus 18 vanilla torch.save of ~1 GB at 0.3-1 GB/s and
~18 GB of untimed deletes; run it when the machine is otherwise idle):

    python benchmarks/async_training.py

    python benchmarks/async_training.py --model gpt2 --steps 60 --every 10 --rounds 3
    python benchmarks/async_training.py --model tiny --steps 6 --every 3 --rounds 1 --check
"""
from __future__ import annotations

import argparse
import dataclasses
import mmap
import os
import shutil
import statistics
import sys
import time

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fastpersist.bench import common, micro  # noqa: E402
import models  # noqa: E402

import fastpersist  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = ["none", "torch.save", "fastpersist.save", "save_async"]

# Models built here in addition to benchmarks/models.py's registry.
LOCAL_MODELS = {
    "gpt2-6l": dataclasses.replace(models.CONFIGS["gpt2"], layers=6,
                                   note="GPT-2 small width, 6 of its 12 layers, 82M"),
    "tiny": models.ModelConfig("gpt2", 128, 2, 4, 1024, 512, max_positions=128, tie_embeddings=True,
                               note="tiny GPT-2 layout for checking this benchmark, 0.55M"),
}
ARCHITECTURES = {"gpt2": models.GPT2LMHeadModel, "llama": models.LlamaForCausalLM,
                 "phi3": models.Phi3ForCausalLM}


def config_of(name: str) -> models.ModelConfig:
    return LOCAL_MODELS[name] if name in LOCAL_MODELS else models.get_config(name)


def build_model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    config = config_of(name)
    torch.manual_seed(0)
    model = ARCHITECTURES[config.arch](config, dtype=dtype)
    models.init_weights(model)
    return model


class Trainer:
    """One model and its AdamW optimizer, trained on random token ids."""

    def __init__(self, model: torch.nn.Module, batch: int, seq: int):
        self.model, self.batch, self.seq = model, batch, seq
        self.vocab = model.config.vocab
        try:
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            self.optimizer_kind = "AdamW (fused)"
        except (RuntimeError, TypeError):
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            self.optimizer_kind = "AdamW"
        self.generator = torch.Generator().manual_seed(0)

    def step(self) -> None:
        ids = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.generator)
        logits = self.model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, self.vocab).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def checkpoint(self, step: int) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": step}




# ---------------------------------------------------------------------------
# the reference: one in-memory copy of the state


class MemcpyReference:
    def __init__(self, checkpoint: dict):
        self.sources = [torch.empty(0, dtype=torch.uint8).set_(s) for s in common.distinct_storages(checkpoint)
                        if s.nbytes()]
        self.nbytes = sum(s.numel() for s in self.sources)
        self.memory = mmap.mmap(-1, max(self.nbytes, 1))
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.memory.madvise(mmap.MADV_HUGEPAGE)
        self.buffer = torch.frombuffer(self.memory, dtype=torch.uint8)
        self.buffer.fill_(1)  # touched before, like save_async's reused snapshot memory
        self.times: list[float] = []

    def run(self, copies: int) -> None:
        for _ in range(copies):
            start = time.perf_counter()
            offset = 0
            for source in self.sources:
                n = source.numel()
                self.buffer[offset:offset + n].copy_(source)
                offset += n
            self.times.append(time.perf_counter() - start)


# ---------------------------------------------------------------------------
# one training loop


@dataclasses.dataclass
class Run:
    seconds: float
    blocked: list  # per checkpoint: seconds inside the save call plus any wait before it
    final_wait: float = 0.0
    waited: int = 0  # checkpoints at which the previous save_async was still pending
    nbytes: int = 0  # size of one checkpoint file
    step_times: list = dataclasses.field(default_factory=list)  # each training step alone


def train(trainer: Trainer, mode: str, steps: int, every: int, folder: str, latest: bool,
          engine: str) -> Run:
    vanilla = fastpersist.patching.original_save()
    blocked, waited, final_wait, handle, nbytes, step_times = [], 0, 0.0, None, 0, []
    start = time.perf_counter()
    for i in range(1, steps + 1):
        began = time.perf_counter()
        trainer.step()
        step_times.append(time.perf_counter() - began)
        if mode == "none" or i % every:
            continue
        path = os.path.join(folder, "latest.pt" if latest else f"ckpt_{i}.pt")
        checkpoint = trainer.checkpoint(i)
        began = time.perf_counter()
        if mode == "torch.save":
            vanilla(checkpoint, path)
            fd = os.open(path, os.O_RDONLY)  # as benchmarks/micro.vanilla_save: fsync to be comparable
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        elif mode == "fastpersist.save":
            fastpersist.save(checkpoint, path, engine=engine)
        else:
            if handle is not None:
                if not handle.done():
                    waited += 1
                nbytes = handle.result()  # waits only if still pending; raises what the write raised
            handle = fastpersist.save_async(checkpoint, path, engine=engine)
        blocked.append(time.perf_counter() - began)
        del checkpoint
    if handle is not None:
        began = time.perf_counter()
        nbytes = handle.result()
        final_wait = time.perf_counter() - began
    seconds = time.perf_counter() - start
    if mode in ("torch.save", "fastpersist.save") and blocked:
        nbytes = os.path.getsize(path)
    return Run(seconds, blocked, final_wait, waited, nbytes, step_times)


def check_last(folder: str, latest: bool, last_step: int, trainer_step: int, trainer: Trainer) -> None:
    """Loads the last checkpoint and compares it with the trainer's state (--check)."""
    path = os.path.join(folder, "latest.pt" if latest else f"ckpt_{last_step}.pt")
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == last_step, (path, loaded["step"], last_step)
    if last_step != trainer_step:
        return  # training went on after the last checkpoint: only its step can be compared
    state = trainer.model.state_dict()
    assert loaded["model"].keys() == state.keys(), path
    for key, value in state.items():
        assert torch.equal(loaded["model"][key], value), (path, key)
    optimizer = trainer.opt.state_dict()["state"]
    assert loaded["optimizer"]["state"].keys() == optimizer.keys(), path
    for index, entry in optimizer.items():
        for name, value in entry.items():
            assert torch.equal(loaded["optimizer"]["state"][index][name], value), (path, index, name)


def clear_folder(folder: str) -> float:
    """Deletes the round's files and syncs (discards happen here, not in the next timing)."""
    start = time.perf_counter()
    shutil.rmtree(folder)
    os.sync()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------
# the report


def report(args, runs: dict, reference: MemcpyReference, first_async: float | None) -> None:
    n_ckpt = args.steps // args.every
    none = runs.get("none")
    for mode, rounds in runs.items():
        rates = [args.steps / r.seconds for r in rounds]
        secs = statistics.median(r.seconds for r in rounds)
        line = f"train[{mode}] -- {args.steps} steps"
        if mode != "none":
            line += f", {n_ckpt} ckpts of {rounds[-1].nbytes / 1e9:.3f} GB"
        line += f", {secs:.2f} secs, {statistics.median(rates):.2f} steps/s"
        line += f" (step alone median {statistics.median(t for r in rounds for t in r.step_times):.3f} s)"
        if none is not None:
            ratios = [rate * n.seconds / args.steps for rate, n in zip(rates, none)]
            line += f", {statistics.median(ratios):.3f}x none"
        if mode != "none":
            blocked = [b for r in rounds for b in r.blocked]
            line += f"; blocked per ckpt median {statistics.median(blocked):.3f} s, max {max(blocked):.3f} s"
        if mode == "save_async":
            line += (f", final wait median {statistics.median(r.final_wait for r in rounds):.3f} s"
                     f", waited for the previous save at {sum(r.waited for r in rounds)} of "
                     f"{sum(len(r.blocked) for r in rounds)} ckpts")
        line += f"   (rounds {', '.join(f'{r.seconds:.2f}' for r in rounds)} secs)"
        print(line, flush=True)

    copy = statistics.median(reference.times)
    gb = reference.nbytes / 1e9
    print(f"memcpy_reference -- {gb:.2f} GB, {copy:.3f} secs, {gb / copy:.2f} GB/s"
          f"   ({len(reference.times)} copies, min {min(reference.times):.3f}, max {max(reference.times):.3f})",
          flush=True)

    if "save_async" in runs:
        rounds = runs["save_async"]
        blocked = statistics.median(b for r in rounds for b in r.blocked)
        ratio = blocked / copy
        print(f"# save_async blocked / memcpy: {ratio:.2f} (median blocked {blocked:.3f} s / median copy "
              f"{copy:.3f} s; target <= 1.2: {'met' if ratio <= 1.2 else 'NOT met'})")
        if first_async is not None:
            print(f"# first save_async of the process (fresh snapshot memory): blocked {first_async:.3f} s")
        if none is not None:
            ratios = [n.seconds / r.seconds for r, n in zip(rounds, none)]
            throughput = statistics.median(ratios)
            print(f"# save_async throughput / none: {throughput:.3f} (median of per-round ratios "
                  f"{', '.join(f'{x:.3f}' for x in ratios)}; target >= 0.90: "
                  f"{'met' if throughput >= 0.90 else 'NOT met'})", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-6l", choices=list(LOCAL_MODELS) + models.names(),
                        help="model to train (default gpt2-6l; tiny for checking the benchmark)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="parameter dtype")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=60, help="training steps per loop (N)")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every K steps")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, modes interleaved; medians reported")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first (creates the optimizer state; step time shown in the header)")
    parser.add_argument("--copies", type=int, default=5, help="memcpy reference copies per round")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--latest", action="store_true", help="overwrite one latest.pt instead of ckpt_{step}.pt")
    parser.add_argument("--engine", default="auto", help="fastpersist engine option for save and save_async")
    parser.add_argument("--folder", default=None,
                        help="where checkpoints are written (default: a temporary folder under /var/tmp)")
    parser.add_argument("--check", action="store_true",
                        help="after each loop, outside the timing, load the last checkpoint and compare it")
    args = parser.parse_args(argv)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {MODES}")
    if args.steps < args.every or args.every < 1:
        parser.error("--steps must be at least --every, and --every at least 1")
    config = config_of(args.model)
    if config.arch == "gpt2" and args.seq > config.max_positions:
        parser.error(f"--seq {args.seq} is longer than {args.model}'s {config.max_positions} positions")

    built = time.perf_counter()
    model = build_model(args.model, DTYPES[args.dtype])
    trainer = Trainer(model, args.batch, args.seq)
    built = time.perf_counter() - built
    warmup = []
    for _ in range(max(args.warmup, 1)):  # at least one: the optimizer's state exists from the first step
        began = time.perf_counter()
        trainer.step()
        warmup.append(time.perf_counter() - began)
    checkpoint = trainer.checkpoint(0)
    reference = MemcpyReference(checkpoint)
    params = sum(p.numel() for p in model.parameters())
    runner = micro.Runner(args.folder)
    threads = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    print(f"# torch {torch.__version__}; fastpersist {fastpersist.__version__}; model {args.model} "
          f"({config.note}): {params:,} params, {args.dtype}, {trainer.optimizer_kind}; checkpoint "
          f"{reference.nbytes / 1e9:.3f} GB of tensor data (model + optimizer state, "
          f"{len(reference.sources)} storages); batch {args.batch} x {args.seq} tokens; "
          f"K={args.every} (checkpoint every {args.every} steps), {args.steps} steps, "
          f"{args.steps // args.every} ckpts per loop; {args.rounds} rounds, medians; "
          f"cores {os.cpu_count()} ({len(threads) if threads else '?'} usable, torch threads "
          f"{torch.get_num_threads()}); engine {args.engine}; {'latest.pt' if args.latest else 'ckpt_{step}.pt'}; "
          f"folder {runner.folder}; built in {built:.1f} s; warmup step median {statistics.median(warmup):.3f} s",
          flush=True)
    del checkpoint

    runs: dict[str, list[Run]] = {m: [] for m in modes}
    first_async = None
    try:
        for round_ in range(1, args.rounds + 1):
            cleanup = []
            for mode in modes:
                folder = os.path.join(runner.folder, f"round{round_}-{mode.replace('.', '_')}")
                if os.path.exists(folder):  # left by an interrupted run in --folder
                    shutil.rmtree(folder)
                os.makedirs(folder)
                run = train(trainer, mode, args.steps, args.every, folder, args.latest, args.engine)
                runs[mode].append(run)
                if mode == "save_async" and first_async is None and run.blocked:
                    first_async = run.blocked[0]
                if args.check and mode != "none":
                    check_last(folder, args.latest, args.steps - args.steps % args.every, args.steps, trainer)
                cleanup.append(clear_folder(folder))
            reference.run(args.copies)
            print(f"# round {round_}: " + ", ".join(f"{m} {runs[m][-1].seconds:.2f} s" for m in modes)
                  + f"; deleting files took {sum(cleanup):.2f} s (untimed)", flush=True)
        report(args, runs, reference, first_async)
    finally:
        runner.close()


if __name__ == "__main__":
    main()
