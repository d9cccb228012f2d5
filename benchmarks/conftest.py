"""Microbenchmarks with pytest-benchmark (benchmarks/test_micro.py); not part
of the test suite (pyproject's testpaths is tests/) nor of CI:

    python -m pytest benchmarks/ --benchmark-only
    python -m pytest benchmarks/ --benchmark-only --micro-sizes 256,1024 --micro-folder /mnt/nvme -k io_uring

Every round is set up outside its timing (pedantic mode): reads start with the
file dropped from the page cache, writes go to a file that does not exist
("new") or replace a complete one ("existing").
"""
from __future__ import annotations

import os

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")

import pytest  # noqa: E402


def pytest_addoption(parser):
    group = parser.getgroup("fastpersist microbenchmarks")
    group.addoption("--micro-sizes", default="64,256", help="checkpoint sizes in MB, 10^6 bytes (default: 64,256)")
    group.addoption("--micro-engines", default="all", help="all, or a list such as io_uring,psync (default: all)")
    group.addoption("--micro-folder", default=None,
                    help="existing folder on the filesystem to measure (default: the current folder); the "
                         "benchmarks work in a temporary folder inside it")
    group.addoption("--micro-rounds", type=int, default=5, help="timed rounds per benchmark (default: 5)")
    group.addoption("--micro-cache-drop", choices=("auto", "file"), default="file",
                    help="file: posix_fadvise(DONTNEED) on the file (default); auto: also /proc/sys/vm/drop_caches "
                         "where writable")


def _engines(config) -> list:
    from fastpersist.bench import common

    try:
        return common.resolve_engines(config.getoption("--micro-engines"), common.bench_options())[0]
    except common.BenchError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_generate_tests(metafunc):
    if "size_mb" in metafunc.fixturenames:
        sizes = [int(s) for s in metafunc.config.getoption("--micro-sizes").split(",") if s.strip()]
        metafunc.parametrize("size_mb", sizes, ids=[f"{s}MB" for s in sizes], scope="module")
    if "engine" in metafunc.fixturenames:
        metafunc.parametrize("engine", _engines(metafunc.config), scope="module")


@pytest.fixture(scope="session")
def workspace(request):
    from fastpersist.bench import common

    try:
        ws = common.Workspace(request.config.getoption("--micro-folder"))
    except common.BenchError as exc:
        raise pytest.UsageError(str(exc)) from None
    yield ws
    ws.close()


@pytest.fixture(scope="session")
def dropper(request):
    from fastpersist.bench import common

    return common.CacheDropper(request.config.getoption("--micro-cache-drop"))


@pytest.fixture(scope="session")
def rounds(request) -> int:
    return request.config.getoption("--micro-rounds")
