"""safetensors cold loads to the GPU and to the host (run on a GPU machine: GB=2 python benchmarks/safetensors_gpu.py): safetensors' load_file against fastpersist's,
interleaved rounds, page cache dropped before each; then saves from the GPU."""
import os, statistics, sys, time, random
import torch
import safetensors.torch as st
from fastpersist import safetensors as fst
from fastpersist import patching

orig_load = getattr(st, "_fastpersist_original_load_file", st.load_file)
orig_save = getattr(st, "_fastpersist_original_save_file", st.save_file)
path = "/tmp/st-bench.safetensors"
g = torch.Generator().manual_seed(0)
n = int(float(os.environ.get("GB", "1")) * (1 << 30)) // (16 << 20)
state = {f"layer.{i}.weight": torch.randn(4096, 2048, generator=g).bfloat16() for i in range(n)}
orig_save(state, path)
def drop():
    fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
def timed(fn):
    drop(); torch.cuda.synchronize(); t = time.perf_counter(); out = fn(); torch.cuda.synchronize()
    for v in out.values(): v.view(-1)[-1].item() if v.is_cuda else v.sum()
    s = time.perf_counter() - t; del out; return s
rows = {"safetensors load_file(device=cuda)": lambda: orig_load(path, device="cuda"),
        "fastpersist load_file(device=cuda)": lambda: fst.load_file(path, device="cuda"),
        "safetensors load_file (cpu, every byte touched)": lambda: orig_load(path),
        "fastpersist load_file (cpu, every byte touched)": lambda: fst.load_file(path)}
times = {k: [] for k in rows}
for r in range(3):
    order = list(rows); random.shuffle(order)
    for k in order: times[k].append(timed(rows[k]))
size = os.path.getsize(path) / 1e9
for k, v in times.items():
    print(f"{k:50s} median {statistics.median(v):.3f} s  {size / statistics.median(v):.2f} GB/s  {[round(x, 3) for x in v]}")
gpu_state = {k: v.cuda() for k, v in state.items()}
def save_theirs(p):
    orig_save(gpu_state, p); fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.close(fd)
save_rows = {"safetensors save_file (from GPU) + fsync": save_theirs,
             "fastpersist save_file (from GPU, durable)": lambda p: fst.save_file(gpu_state, p)}
st_times = {k: [] for k in save_rows}
for r in range(3):
    order = list(save_rows); random.shuffle(order)
    for k in order:
        p = f"/tmp/st-save-{r}.safetensors"; t = time.perf_counter(); save_rows[k](p); st_times[k].append(time.perf_counter() - t); os.unlink(p)
for k, v in st_times.items():
    print(f"{k:50s} median {statistics.median(v):.3f} s  {size / statistics.median(v):.2f} GB/s  {[round(x, 3) for x in v]}")
os.unlink(path)
