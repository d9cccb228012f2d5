"""Runs vLLM (in its own virtual environment: tests/test_vllm.py starts
this with that interpreter) over a plan of cases, in one process, and
prints one JSON line per case: the greedy tokens of a fixed prompt, after
loading and after each reload in place, or the error raised.

Usage: python vllm_driver.py PLAN.json  (a list of {"model", "load_format",
"reloads": [dirs], "dtype", "extra_config", "tensor_parallel_size"}).
vLLM's own log goes to stdout and stderr."""
import gc
import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402

PROMPT = {"prompt_token_ids": [1, 5, 9, 200, 7, 3]}


def tokens(llm) -> list:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def run(case: dict) -> dict:
    result = {"case": case}
    llm = None
    try:
        llm = LLM(model=case["model"], load_format=case["load_format"], enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=128, dtype=case.get("dtype", "auto"),
                  model_loader_extra_config=case.get("extra_config") or {},
                  tensor_parallel_size=case.get("tensor_parallel_size", 1))
        result["tokens"] = [tokens(llm)]
        for folder in case.get("reloads", []):
            llm.collective_rpc("reload_weights", kwargs={"weights_path": folder, "is_checkpoint_format": True})
            result["tokens"].append(tokens(llm))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = "".join(traceback.format_exception(exc))
    finally:
        del llm
        gc.collect()
    return result


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    for case in plan:
        print(json.dumps(run(case)), flush=True)
