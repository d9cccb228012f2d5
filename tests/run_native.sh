#!/usr/bin/env bash
# `make sanitize` (second half): the engine's C tests under tests/native/,
# built with ThreadSanitizer, which cannot run inside CPython here (libtsan
# has to be loaded first, and CPython is not built for it). They cover the
# engine's own threads: the copy-out helper of fp_read_extents. The sources,
# macros and libraries are csrc/build_engine.py's, so the engines compiled
# in are those of the real build.
# Usage: tests/run_native.sh   (PYTHON, default python3, may be set)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=build/native
rm -rf "$OUT"
mkdir -p "$OUT/tmp"
IFS='|' read -r SOURCES MACROS LIBS < <(cd csrc && "$PYTHON" -c '
import build_engine as b
print(" ".join("csrc/" + s for s in b.sources),
      " ".join(f"-D{m}={v}" for m, v in b.macros),
      " ".join(b.static_archives + ["-l" + l for l in b.libraries]), sep="|")')
FLAGS="-fsanitize=thread -fno-omit-frame-pointer -g -O1 -std=gnu11 -Wall -Wextra -Wno-unused-parameter"
status=0
for test in tests/native/test_*.c; do
    name=$(basename "$test" .c)
    echo "== $name (ThreadSanitizer; $MACROS)"
    # shellcheck disable=SC2086  # word splitting intended
    cc $FLAGS $MACROS -Icsrc "$test" $SOURCES -o "$OUT/$name" $LIBS
    # halt_on_error: a race report fails the test, exitcode 66. setarch -R:
    # without address randomisation, as TSan's fixed memory layout can clash
    # with the mappings of kernels that randomise more bits (vm.mmap_rnd_bits)
    if ! TSAN_OPTIONS="halt_on_error=1 exitcode=66" setarch "$(uname -m)" -R "$OUT/$name" "$OUT/tmp"; then
        echo "native: $name failed" >&2
        status=1
    fi
done
exit $status
