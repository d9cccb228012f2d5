#!/usr/bin/env bash
# `make sanitize`: the C engine built with AddressSanitizer and
# UndefinedBehaviorSanitizer, and the engine tests run against that build.
# Fails on a test failure and on any sanitizer report, in pytest itself or in
# any process it starts (the tests run python, capsh, mkfs and mount in
# subprocesses, which inherit the environment below and so the sanitizers).
#
# Everything goes under build/sanitize/: the in-place
# fastpersist/_engine_cffi*.so is neither rebuilt nor used.
#   build/sanitize/lib/fastpersist/  a copy of fastpersist/*.py + the sanitized .so
#   build/sanitize/tmp/              the generated C source and object files
#   build/sanitize/logs/             ASan reports, one file per process (asan.<pid>)
#   build/sanitize/pytest.log        the test output, searched for UBSan reports
#
# Usage: tests/run_sanitized.sh [pytest arguments]
#   PYTHON (default python3) and SANITIZE_TESTS (the test files) may be set.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
OUT=$ROOT/build/sanitize
TESTS=${SANITIZE_TESTS:-tests/test_engine.py tests/test_save.py tests/test_faults.py tests/test_temporaries.py tests/test_streamed_write.py tests/test_streamed_read.py tests/test_state_pickle.py tests/test_plain_pickle.py}
# -fno-wrapv undoes the -fwrapv of CPython's own CFLAGS (which setuptools
# passes on): under it signed overflow is defined, and UBSan would not check it.
FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1 -fno-wrapv"

rm -rf "$OUT"
mkdir -p "$OUT/lib" "$OUT/tmp" "$OUT/logs"

# 1. The extension, through csrc/build_engine.py's FFI object as setup.py
#    uses it; FASTPERSIST_EXTRA_CFLAGS adds the flags (last, so -O1 wins over
#    -O2) to compiling and linking. --force: header changes count too.
echo "== building the sanitized engine into ${OUT#"$ROOT"/}/lib"
FASTPERSIST_EXTRA_CFLAGS="$FLAGS" "$PYTHON" setup.py -q build_ext --force \
    --build-lib "$OUT/lib" --build-temp "$OUT/tmp"
cp fastpersist/*.py "$OUT/lib/fastpersist/"
for so in "$OUT"/lib/fastpersist/_engine_cffi*.so "$OUT"/lib/fastpersist/_plain_pickle*.so; do
    symbols=$(nm -D "$so")
    if ! grep -q __asan_init <<<"$symbols" || ! grep -q __ubsan_handle <<<"$symbols"; then
        echo "error: $so is not instrumented with ASan and UBSan" >&2
        exit 1
    fi
done

# 2. The runtimes. python is not instrumented, so libasan must come first in
#    the process (LD_PRELOAD; it must also see every malloc from the start);
#    libubsan likewise, since gcc keeps UBSan's runtime apart from ASan's.
asan=$(readlink -f "$(gcc -print-file-name=libasan.so)")
ubsan=$(readlink -f "$(gcc -print-file-name=libubsan.so)")
for lib in "$asan" "$ubsan"; do
    [ -f "$lib" ] || { echo "error: no sanitizer runtime $lib (gcc's libasan/libubsan)" >&2; exit 1; }
done

# ASAN_OPTIONS:
#   detect_leaks=0  CPython and torch keep memory until exit by design
#   log_path        ASan reports go to files, one per process (a forked child
#                   too), so that a report in a subprocess is caught whether
#                   or not its test looks at its exit status; checked below
#   exitcode=66     the status of a process that ASan ended
# UBSAN_OPTIONS:
#   halt_on_error=1 (with -fno-sanitize-recover=undefined) any UB is fatal
#   print_stacktrace=1, exitcode=67
#   UBSan reports go to stderr: gcc's libubsan, loaded beside libasan, ignores
#   log_path (both export __sanitizer_set_report_path, and libasan's, first,
#   wins). pytest therefore runs with --capture=sys, so that C-level stderr
#   (the test process's, and that of children whose output no test captures)
#   is not swallowed with the fd capture of a test that dies, and its output
#   is searched for reports; a captured child's report fails its test through
#   the exit status.
# torch 2.13 (CPU) imports and runs under this preload without further
# options (no verify_asan_link_order=0 needed: the preload puts libasan first).
env_run=(env
    LD_PRELOAD="$asan $ubsan"
    ASAN_OPTIONS="detect_leaks=0:exitcode=66:log_path=$OUT/logs/asan"
    UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=67"
    PYTHONPATH="$OUT/lib"
)

# 3. The tests, run from build/sanitize/lib: `python -m` puts the current
#    folder first on sys.path, which must not be the repository root (its
#    fastpersist/ holds the unsanitized .so). PYTHONPATH comes before the
#    editable install, whose finder is appended to sys.meta_path.
cd "$OUT/lib"
"${env_run[@]}" "$PYTHON" -c '
import sys, fastpersist._engine_cffi as m
print("== engine module:", m.__file__)
sys.exit(not m.__file__.startswith(sys.argv[1]))' "$OUT/lib/" \
    || { echo "error: the tests would not import the sanitized engine" >&2; exit 1; }

# Left out: ASan intercepts mlock() and makes it a no-op that succeeds
# (sanitizer_common does so for mlock/mlockall: the kernel copes badly with
# locking in a process that maps terabytes, as ASan's shadow memory does), so
# the refusal that test provokes cannot happen under ASan.
skip=(--deselect tests/test_engine.py::test_memlock_refusal_is_reported_once)

set +e
# shellcheck disable=SC2046,SC2086
"${env_run[@]}" "$PYTHON" -m pytest -p no:cacheprovider --capture=sys -v "${skip[@]}" \
    $(printf "$ROOT/%s " $TESTS) "$@" 2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
set -e

reports=$(find "$OUT/logs" -type f | sort)
for f in $reports; do
    printf '\n==== ASan report %s\n' "${f#"$ROOT"/}"
    cat "$f"
done
ubsan_reports=$(grep -cE ':[0-9]+:[0-9]+: runtime error: ' "$OUT/pytest.log" || true)
if [ -n "$reports" ] || [ "$ubsan_reports" != 0 ]; then
    echo "sanitize: FAILED, $(echo -n "$reports" | grep -c .) ASan report(s), $ubsan_reports UBSan report(s) above" >&2
    exit 1
fi
if [ "$status" != 0 ]; then
    echo "sanitize: FAILED, pytest exit status $status (66: ASan, 67: UBSan ended a process)" >&2
    exit "$status"
fi
echo "sanitize: passed, no sanitizer reports"
