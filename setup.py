"""The C engine is built by cffi (out-of-line API mode) from csrc/; beside
it, fastpersist._plain_pickle, a small CPython extension (limited API, one
build for every Python) that writes plain checkpoints' pickles."""
import os

from setuptools import Extension, setup

# `make sanitize` builds both extensions with ASan/UBSan through this (see csrc/build_engine.py)
EXTRA_FLAGS = os.environ.get("FASTPERSIST_EXTRA_CFLAGS", "").split()

setup(
    cffi_modules=["csrc/build_engine.py:ffibuilder"],
    # optional: where it cannot be built (no Python headers), plain_pickle runs its Python writer
    ext_modules=[Extension("fastpersist._plain_pickle", ["csrc/fp_plain_pickle.c"], py_limited_api=True, optional=True,
                           define_macros=[("Py_LIMITED_API", "0x03090000")],
                           extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"]
                           + EXTRA_FLAGS, extra_link_args=EXTRA_FLAGS)],
)
