"""Hugging Face checkpoints through the patched torch.save / torch.load: a
real transformers.Trainer trains a tiny GPT-2 built from a config (no
downloads) on the CPU, and resuming from its checkpoint ends where
uninterrupted training ends; accelerate's save_state / load_state round
trip. What goes through fastpersist is the torch-format files (optimizer,
scheduler, RNG states, training arguments); model weights are safetensors,
which neither framework writes with torch.save."""
import copy
import importlib
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'fastpersist[hf]')")
accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'fastpersist[hf]')")

import fastpersist  # noqa: E402
from fastpersist.patching import original_load  # noqa: E402

save_module = importlib.import_module("fastpersist.save")
load_module = importlib.import_module("fastpersist.load")


@pytest.fixture
def through_fastpersist(monkeypatch):
    """torch.save / torch.load patched for the test; the files fastpersist
    itself wrote and read (not handed to the original torch functions)."""
    was_patched = fastpersist.is_patched()
    fastpersist.patch()
    written, read = [], []
    real_save, real_open = save_module.save_to_path, load_module._CheckpointImage.open

    def save_to_path(obj, path, *args, **kwargs):
        written.append(os.path.basename(path))
        return real_save(obj, path, *args, **kwargs)

    def open_image(path, *args, **kwargs):
        image = real_open(path, *args, **kwargs)
        if image is not None:
            read.append(os.path.basename(path))
        return image

    monkeypatch.setattr(save_module, "save_to_path", save_to_path)
    monkeypatch.setattr(load_module._CheckpointImage, "open", staticmethod(open_image))
    yield written, read
    if not was_patched:
        fastpersist.unpatch()


def tiny_gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def dataset():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (32, 16), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


class StopAt(transformers.TrainerCallback):
    """A job killed after a step: the schedule is the full run's."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def train(folder, stop_at=None, resume=None):
    args = transformers.TrainingArguments(
        output_dir=str(folder), max_steps=8, per_device_train_batch_size=4, learning_rate=1e-2,
        save_strategy="steps", save_steps=4, logging_strategy="no", report_to=[], use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset(),
                                   callbacks=[StopAt(stop_at)] if stop_at else None)
    trainer.train(resume_from_checkpoint=resume)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_trainer_resume_equals_uninterrupted_training(tmp_path, through_fastpersist):
    written, read = through_fastpersist
    straight = train(tmp_path / "straight")
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"} <= set(written)

    interrupted = tmp_path / "interrupted"
    train(interrupted, stop_at=4)
    checkpoint = interrupted / "checkpoint-4"
    # standard torch files: the original torch.load reads what fastpersist wrote
    optimizer = original_load()(checkpoint / "optimizer.pt", weights_only=False)
    assert optimizer["state"], "optimizer state saved"
    read.clear()
    resumed = train(interrupted, resume=str(checkpoint))
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth"} <= set(read)
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


def test_accelerator_save_state_and_load_state(tmp_path, through_fastpersist):
    written, read = through_fastpersist
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).sum()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    accelerator.save_state(str(tmp_path / "state"))
    assert any(name.startswith("optimizer") for name in written), written
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_lr = scheduler.get_last_lr()

    for p in model.parameters():  # training goes on and changes everything
        p.data.add_(1.0)
    loss = model(torch.randn(4, 8)).pow(2).sum()
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()

    accelerator.load_state(str(tmp_path / "state"))
    assert any(name.startswith("optimizer") for name in read), read
    for key, value in saved_model.items():
        assert torch.equal(model.state_dict()[key], value), key
    restored = optimizer.state_dict()
    for index, state in saved_optimizer["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(restored["state"][index][key]), torch.as_tensor(value)), (index, key)
    assert scheduler.get_last_lr() == saved_lr
