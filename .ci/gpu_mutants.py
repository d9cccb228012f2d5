"""Each GPU test that names a mechanism must fail where that mechanism is
disabled: for each (what, file, text, replacement[, file, text,
replacement...], test) below, a copy of the tree with those edits runs that
one test, which must fail ("killed").
Run on the GPU machine by `bash .ci/gpu run mutants`; exits 1 where a
test survives its mutant or a mutant no longer applies (a test that skips
there, naming why, is reported UNVERIFIED)."""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MUTANTS = [
    ("the GDS data path synchronizes the current stream before cuFile",
     "fastpersist/gds.py", "torch.cuda.current_stream(tensor.device).synchronize()", "pass",
     "tests/test_gpu.py::test_a_gds_save_waits_for_kernels_still_queued"),
    ("save_async's device copies are complete when it returns",
     "fastpersist/async_save.py", "side.synchronize()  # the arena holds", "pass  # the arena holds",
     "tests/test_gpu.py::test_tensors_changed_after_save_async_returns_do_not_reach_the_file"),
    ("save_async's device copies wait for kernels the caller queued before it",
     "fastpersist/async_save.py", "side.wait_stream(torch.cuda.current_stream(device))", "pass",
     "tests/test_gpu.py::test_save_async_snapshots_what_kernels_queued_before_it_wrote"),
    ("a forked child runs no engine destroy hook (no cudaHostUnregister there)",
     "fastpersist/_engine.py", "if os.getpid() == creator:", "if True:",
     "tests/test_gpu.py::test_a_forked_child_does_not_touch_the_registration"),
    ("a forked child never unregisters an arena (nor collects one)",
     "fastpersist/async_save.py", "    if os.getpid() == pid:\n        unregister()", "    unregister()",
     "fastpersist/async_save.py", "    _forked_away.extend(_kept_from_children)", "    pass",
     "tests/test_gpu.py::test_snapshot_memory_of_gpu_state_is_registered_and_unregistered"),
    ("staged copies wait for the caller's stream (where the targets were allocated and written)",
     "fastpersist/device_io.py", "            side.wait_stream(current)  # the targets", "            pass  # the targets",
     "tests/test_gpu.py::test_a_staged_load_waits_for_kernels_still_queued_on_the_callers_stream"),
    ("staged copies wait for the stream of the thread that asked, not the reader's own",
     "fastpersist/device_io.py",
     "current = self.callers_streams.get(device) if self.callers_streams is not None else None", "current = None",
     "tests/test_gpu.py::test_a_staged_load_waits_for_kernels_still_queued_on_the_callers_stream"),
    ("a staging buffer is refilled only once its copies are done",
     "fastpersist/read_pipeline.py", "copies.wait(tokens[slot])  # its last copies have left it", "pass",
     "tests/test_gpu.py::test_a_staging_buffer_is_refilled_only_once_its_copies_have_read_it"),
    ("a refused registration's CUDA error is cleared",
     "fastpersist/device_io.py", "        _clear_cuda_error()\n        _report_refusal(", "        _report_refusal(",
     "tests/test_gpu.py::test_a_refused_registration_leaves_no_cuda_error_for_torch"),
]


def main() -> int:
    failures = 0
    for what, *edits, test in MUTANTS:
        with tempfile.TemporaryDirectory() as copy:
            for part in ("fastpersist", "tests"):
                shutil.copytree(os.path.join(ROOT, part), os.path.join(copy, part),
                                ignore=shutil.ignore_patterns("__pycache__"))
            applied = True
            for path, text, replacement in zip(edits[0::3], edits[1::3], edits[2::3]):
                target = os.path.join(copy, path)
                with open(target) as f:
                    source = f.read()
                if source.count(text) != 1:
                    print(f"NOT APPLIED ({source.count(text)} matches of {text!r}): {what}", flush=True)
                    applied = False
                    break
                with open(target, "w") as f:
                    f.write(source.replace(text, replacement))
            if not applied:
                failures += 1
                continue
            env = dict(os.environ, FASTPERSIST_AUTOPATCH="0",
                       PYTHONPATH=os.pathsep.join([copy] + [p for p in os.environ.get("PYTHONPATH", "").split(
                           os.pathsep) if p and os.path.abspath(p) != ROOT]))
            try:
                out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
                                     cwd=copy, env=env, capture_output=True, text=True, timeout=60)
            except subprocess.TimeoutExpired:  # the mutant hangs its test: that is a failure too
                print(f"killed (its test hung for 60 s): {what} -> {test}", flush=True)
                continue
            tail = (out.stdout.strip().splitlines() or [""])[-1]
            killed = out.returncode == 1  # a test failed (2+: collection or usage errors prove nothing)
            verdict = "killed" if killed else "UNVERIFIED (the test did not run)" if "skipped" in tail and \
                "passed" not in tail else "SURVIVED"
            print(f"{verdict}: {what} -> {test}: {tail}", flush=True)
            failures += verdict == "SURVIVED"  # UNVERIFIED (the test skipped here, e.g. no GDS) is said, not failed
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
