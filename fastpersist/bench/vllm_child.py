"""One vLLM start for ``fastpersist bench vllm``, run by vLLM's interpreter
(its own environment): loads the model with one load format, times the
loader's ``load_weights`` the same way for every format (vLLM's own
"Loading weights took" is recorded beside it where the format logs one),
generates a few greedy tokens, optionally reloads in place, and prints one
line ``RESULT {json}``.

Usage: python -m fastpersist.bench.vllm_child '{"model": DIR, "load_format": ..., "kwargs": {...}, "reload": bool}'"""
import json
import logging
import os
import re
import sys
import threading
import time

for name, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("HF_HUB_OFFLINE", "1")):
    os.environ.setdefault(name, value)


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (RssAnon, RssFile)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    return 0


class _Logged(logging.Handler):
    """vLLM's own timing lines, as it logs them."""

    PATTERNS = {"vllm_loading_weights_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
                "vllm_reloading_s": re.compile(r"Reloading and processing weights took ([\d.]+) seconds")}

    def __init__(self):
        super().__init__()
        self.found: dict = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for key, pattern in self.PATTERNS.items():
            hit = pattern.search(message)
            if hit:
                self.found[key] = float(hit.group(1))


def main() -> None:
    case = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.model_executor import model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # fastpersist's format registers here, as in every vLLM process
    logged = _Logged()
    timings: dict = {}

    def timed(function):
        def load_weights(self, model, model_config):
            # vLLM sets its logging up as the engine starts, dropping handlers added before: added here
            if logged not in logging.getLogger("vllm").handlers:
                logging.getLogger("vllm").addHandler(logged)
            anon_before = _status("RssAnon")
            peak = {"RssAnon": anon_before, "RssFile": _status("RssFile")}
            done = threading.Event()

            def sample():  # private memory (RssAnon) apart from mapped file pages (RssFile), every 2 ms
                while not done.wait(0.002):
                    for field in peak:
                        peak[field] = max(peak[field], _status(field))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.perf_counter()
            try:
                function(self, model, model_config)
            finally:
                timings["load_weights_s"] = time.perf_counter() - started
                done.set()
                sampler.join()
            timings["anon_growth_bytes"] = peak["RssAnon"] - anon_before
            timings["file_peak_bytes"] = peak["RssFile"]
        return load_weights

    for cls in set(model_loader._LOAD_FORMAT_TO_MODEL_LOADER.values()):
        if "load_weights" in vars(cls):
            cls.load_weights = timed(vars(cls)["load_weights"])
    started = time.perf_counter()
    llm = LLM(model=case["model"], load_format=case["load_format"], enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=128, **case.get("kwargs", {}))
    timings["start_s"] = time.perf_counter() - started
    prompt = {"prompt_token_ids": [1, 5, 9, 200, 7, 3]}
    params = SamplingParams(max_tokens=8, temperature=0)
    timings["tokens"] = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    if case.get("reload"):
        started = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": case["model"], "is_checkpoint_format": True})
        timings["reload_s"] = time.perf_counter() - started
        timings["reload_tokens"] = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    timings.update(logged.found)
    print("RESULT " + json.dumps(timings), flush=True)


if __name__ == "__main__":
    main()
