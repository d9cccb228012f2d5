"""The C engine is built by cffi (out-of-line API mode) from csrc/; beside
it, fastpersist._plain_pickle, a small CPython extension (limited API, one
build for every Python) that writes plain checkpoints' pickles."""
from setuptools import Extension, setup

setup(
    cffi_modules=["csrc/build_engine.py:ffibuilder"],
    ext_modules=[Extension("fastpersist._plain_pickle", ["csrc/fp_plain_pickle.c"], py_limited_api=True,
                           define_macros=[("Py_LIMITED_API", "0x03090000")],
                           extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"])],
)
