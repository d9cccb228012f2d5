"""The C engine is built by cffi (out-of-line API mode) from csrc/."""
from setuptools import setup

setup(cffi_modules=["csrc/build_engine.py:ffibuilder"])
