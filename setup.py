"""The compiled kernels (`einpage.runtime._cpu`); everything else is in pyproject.toml.

The extension is optional: where no C compiler is at hand the install still succeeds and the
NumPy paths run (`einpage.runtime.storedmm` says which is in use)."""
import sys

from setuptools import Extension, setup

# -ffp-contract=off: a dequantized value is computed as NumPy computes it (a product, then a sum,
# never one fused multiply-add), so the compiled and NumPy paths give the same bits
flags = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-std=c11"]

setup(ext_modules=[Extension("einpage.runtime._cpu", ["einpage/runtime/_cpu.c"],
                             extra_compile_args=flags, optional=True)])
