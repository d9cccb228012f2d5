"""The documentation's promises about itself: examples that are skipped say
why, every Python example is one Sybil runs (conftest.py at the root), and
every generated benchmark table is what its committed JSON renders to."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from fastpersist.bench import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
GPU_A = os.path.join(REPO, "benchmarks", "results", "gpu-h200-2026-11-27-a.json")


def read(path):
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def test_every_skipped_example_says_why():
    for page in PAGES:
        for directive in re.findall(r"<!--\s*skip:(.*?)-->", read(page), re.S):
            assert re.fullmatch(r'\s*next\s+"[^"]{10,}"\s*', directive), (page, directive)


def test_every_python_example_is_one_sybil_runs():
    """A block fenced as py, python3 or pycon would be neither run nor
    reported: Python examples are fenced ```python."""
    for page in PAGES:
        fences = re.findall(r"^[ \t]*```+[ \t]*(\S*)", read(page), re.M)
        assert len(fences) % 2 == 0, page
        for language in fences[::2]:  # the opening fences
            assert language in ("", "python", "sh", "yaml", "text"), (page, language)
    assert sum(read(page).count("```python") for page in PAGES) >= 9


def test_generated_tables_match_their_json():
    stale = report.render_pages(PAGES, write=False)
    assert not stale, f"run: fastpersist bench report --update {' '.join(os.path.relpath(p, REPO) for p in stale)}"
    assert "<!-- fastpersist bench report ../benchmarks/results/gpu-h200-2026-11-27-b.json -->" in read(
        os.path.join(REPO, "docs", "results.md"))


def test_report_renders_machine_date_command_and_numbers():
    document = report.load(GPU_A)
    text = report.markdown(document, "benchmarks/results/gpu-h200-2026-11-27-a.json")
    assert "- date: 2026-11-27 (from the file name)" in text
    assert "- command: fastpersist bench gpu --size 1 --repeats 3 --dtype bfloat16 --device cuda --folder /tmp" in text
    assert "NVIDIA H200" in text and "16 CPUs" in text
    fastpersist_save = next(r for r in document["results"] if r["mechanism"] == "fastpersist.save")
    assert (f"| save from the device | fastpersist.save | {fastpersist_save['median_s']:.3f} | "
            f"{fastpersist_save['gb_per_s']:.2f} | 2.40 | 0.79 |") in text


def test_report_takes_the_recorded_date_over_the_file_name(tmp_path):
    document = dict(report.load(GPU_A), date="2027-01-02 03:04 UTC")
    path = tmp_path / "x-2026-11-27.json"
    path.write_text(json.dumps(document))
    assert report.date_of(report.load(str(path)), str(path)) == "2027-01-02 03:04 UTC"


def run_cli(*argv, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "fastpersist", "bench", "report", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_report_command_text_markdown_and_one_line_errors(tmp_path):
    out = run_cli(GPU_A)
    assert out.returncode == 0 and "fastpersist.load(map_location=device)" in out.stdout
    assert run_cli(GPU_A, "--markdown").stdout.count("\n| ") >= 12
    for bad, words in ((tmp_path / "missing.json", "cannot read"), (tmp_path / "x.json", "is not JSON")):
        if bad.name == "x.json":
            bad.write_text("nope")
        out = run_cli(str(bad))
        assert out.returncode == 1 and words in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_report_check_and_update_a_page(tmp_path):
    shutil.copy(GPU_A, tmp_path / "r.json")
    page = tmp_path / "page.md"
    page.write_text("# Results\n\n<!-- fastpersist bench report r.json -->\nold numbers\n<!-- end bench report -->\n")
    out = run_cli("--check", str(page))
    assert out.returncode == 1 and f"stale: {page}" in out.stdout
    assert run_cli("--update", str(page)).returncode == 0
    assert "old numbers" not in page.read_text() and "NVIDIA H200" in page.read_text()
    assert run_cli("--check", str(page)).returncode == 0
