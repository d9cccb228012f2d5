"""`fastpersist info`: what it reports about the environment, not about itself."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("setting, expected", [("0", False), ("1", True), (None, True), ("off", False)])
def test_info_reports_what_import_will_do(tmp_path, setting, expected):
    env = {k: v for k, v in os.environ.items() if k != "FASTPERSIST_AUTOPATCH"}
    if setting is not None:
        env["FASTPERSIST_AUTOPATCH"] = setting
    out = subprocess.run([sys.executable, "-m", "fastpersist", "info", "--json", "--folder", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["autopatch_on_import"] is expected
    assert "torch_save_patched" not in info  # the command's own patching says nothing about the user's program
    assert info["o_direct"] and info["folder"] == str(tmp_path)


def test_info_states_how_loads_read_and_the_memory_they_hold(tmp_path):
    env = dict(os.environ, FASTPERSIST_READ_THREADS="3", FASTPERSIST_BUFFER_SIZE="8M", FASTPERSIST_NUM_BUFFERS="2")
    out = subprocess.run([sys.executable, "-m", "fastpersist", "info", "--json", "--folder", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    reads = json.loads(out.stdout)["read_pipeline"]
    assert reads["page_cache_threads"] == 3
    assert reads["engine_buffers_bytes"] == 16 << 20
    assert reads["engine_pool_max_bytes"] == (16 << 20) * 4  # max_engines
    text = subprocess.run([sys.executable, "-m", "fastpersist", "info", "--folder", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120).stdout
    assert "through the page cache with 3 threads" in text and "16 MiB an engine, at most 64 MiB" in text
