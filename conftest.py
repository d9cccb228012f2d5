"""The documentation's examples as tests: every ```python block in README.md
and docs/*.md runs under pytest through Sybil (`make test` collects them;
`python -m pytest README.md docs` runs them alone). The blocks of one page
share a namespace and run in order, in a temporary folder, with torch
patched as `import fastpersist` patches it outside the test suite. A block
that cannot run on a CPU machine is preceded by
<!-- skip: next "the reason" -->, and is reported as skipped with that reason
(tests/test_docs.py refuses a skip without one). Without Sybil (the GPU
machines) the examples are not collected, except under CI=true, where
that is an error."""
import os
import shutil
import tempfile

try:
    from sybil import Sybil
    from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
except ImportError:  # the GPU machines have no Sybil (.ci/gpu runs tests/ only); CI must run the examples
    if os.environ.get("CI") == "true":
        raise
    Sybil = None

os.environ.setdefault("FASTPERSIST_AUTOPATCH", "0")  # as tests/conftest.py: the suite patches per test


def _setup(namespace):
    import fastpersist

    namespace["_doc_cwd"] = os.getcwd()
    namespace["_doc_folder"] = tempfile.mkdtemp(prefix="fastpersist-doc-")
    os.chdir(namespace["_doc_folder"])
    fastpersist.patch()  # what `import fastpersist` does in a user's program


def _teardown(namespace):
    import fastpersist

    try:
        fastpersist.wait_for_saves()
        fastpersist.wait_for_releases()
    finally:
        fastpersist.unpatch()
        os.chdir(namespace["_doc_cwd"])
        shutil.rmtree(namespace["_doc_folder"], ignore_errors=True)


if Sybil is not None:
    pytest_collect_file = Sybil(
        parsers=[PythonCodeBlockParser(), SkipParser()],
        patterns=["README.md", "docs/*.md"],
        setup=_setup,
        teardown=_teardown,
    ).pytest()
