"""Save a real model checkpoint (random weights, real layout): vanilla
torch.save + fsync against fastpersist per engine and the raw engine writing
the same number of bytes as the checkpoint file.

The checkpoint is ``{'model': state_dict, 'optimizer': ..., 'step': n}``; the
optimizer entry (``--optimizer``) is an Adam-style state dict with exp_avg and
exp_avg_sq per distinct parameter, in the parameters' dtype. Models come from
benchmarks/models.py (``--list`` shows them).

    python benchmarks/torch_save_model.py --model gpt2-large --repeats 5
    python benchmarks/torch_save_model.py --model llama-1b --dtype bfloat16 --optimizer
    python benchmarks/torch_save_model.py --model llama-1b --gpu     # the state on cuda:0

With ``--gpu`` the model (and its optimizer state) lives on the GPU: torch.save
copies each storage to host memory first, fastpersist streams them through
its pinned buffers; the raw engine still writes from (page-locked) host
memory, the ceiling no device copy can beat.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from fastpersist.bench import common, micro  # noqa: E402
import models  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STEP = 1000


def adam_state(model: torch.nn.Module) -> dict:
    """torch.optim.Adam.state_dict()'s layout, with non-zero moments."""
    state = {}
    params = list(model.parameters())  # distinct parameters: a tied head appears once
    with torch.no_grad():
        for i, p in enumerate(params):
            exp_avg = torch.zeros_like(p)
            exp_avg_sq = torch.zeros_like(p)
            exp_avg.copy_(p).mul_(0.1)           # touches every page, cheaply
            exp_avg_sq.copy_(p).square_().mul_(0.01)
            state[i] = {"step": torch.tensor(float(STEP)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    group = {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
             "fused": None, "params": list(range(len(params)))}
    return {"state": state, "param_groups": [group]}


def model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2-large", choices=models.names(), help="model to build (see --list)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="parameter dtype")
    parser.add_argument("--optimizer", action="store_true",
                        help="also checkpoint Adam-style state (exp_avg, exp_avg_sq per parameter)")
    parser.add_argument("--gpu", action="store_true", help="build the model on cuda:0 (saves from and loads to "
                                                           "GPU memory)")


def device_of(args) -> str:
    """cuda:0 with --gpu (refused in one line where there is no CUDA device), else cpu."""
    if not args.gpu:
        return "cpu"
    if not torch.cuda.is_available():
        raise SystemExit("# --gpu: no CUDA device is available here (torch.cuda.is_available() is False)")
    return "cuda:0"


def build_checkpoint(args) -> tuple[dict, float]:
    """{'model': state_dict[, 'optimizer': Adam state], 'step': n} and the seconds it took."""
    start = time.perf_counter()
    model = models.build(args.model, DTYPES[args.dtype], device=device_of(args))
    checkpoint = {"model": model.state_dict()}
    if args.optimizer:
        checkpoint["optimizer"] = adam_state(model)
    checkpoint["step"] = STEP
    return checkpoint, time.perf_counter() - start


def describe(args, checkpoint: dict, built: float) -> str:
    where = (f" on {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})" if args.gpu else "")
    return (f"torch {torch.__version__}; model {args.model} ({models.get_config(args.model).note}): "
            f"{models.param_count(args.model):,} params, {args.dtype}{where}"
            f"{' + Adam state' if args.optimizer else ''}; checkpoint {common.storage_bytes(checkpoint) / 1e9:.2f} GB "
            f"of tensor data ({len(checkpoint['model'])} model keys; built in {built:.1f} s)")


def list_models() -> None:
    print(f"{'name':<12} {'arch':<5} {'layers':>6} {'d':>5} {'heads':>7} {'ffn':>6} {'vocab':>7} "
          f"{'tied':>4} {'params':>14} {'fp32 GB':>8} {'bf16 GB':>8}  note")
    for name, c in models.CONFIGS.items():
        heads = f"{c.heads}/{c.num_kv_heads}" if c.num_kv_heads != c.heads else str(c.heads)
        print(f"{name:<12} {c.arch:<5} {c.layers:>6} {c.hidden:>5} {heads:>7} {c.ffn:>6} {c.vocab:>7} "
              f"{'yes' if c.tie_embeddings else 'no':>4} {models.param_count(name):>14,} "
              f"{models.param_bytes(name, torch.float32) / 1e9:>8.2f} "
              f"{models.param_bytes(name, torch.bfloat16) / 1e9:>8.2f}  {c.note}")
    print("(GB of parameters; --optimizer triples it)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--list", action="store_true", help="print the model registry with sizes and exit")
    micro.common_arguments(parser)
    args = parser.parse_args(argv)

    if args.list:
        list_models()
        return

    checkpoint, built = build_checkpoint(args)

    # The raw write repeats the largest tensor's storage (already touched).
    source = max((t for t in common.tensors_in(checkpoint) if t.is_contiguous() and t.storage_offset() == 0),
                 key=lambda t: t.untyped_storage().nbytes())
    if source.is_cuda:  # the ceiling writes host memory: a page-locked copy of it
        source = torch.empty(source.shape, dtype=source.dtype, pin_memory=True).copy_(source)
    engines = micro.usable_engines(args.engines)
    runner = micro.Runner(args.folder)
    print(f"# {describe(args, checkpoint, built)}; folder {runner.folder}; {args.repeats} rounds, medians",
          flush=True)
    micro.run_rounds(runner, checkpoint, source, engines, args.repeats, vanilla=not args.no_vanilla)

if __name__ == "__main__":
    main()
