"""The package is described in pyproject.toml; this only adds the optional C extension of the CPU
decode path (mlx_qwen3vl/cpu/_decode.c, see mlx_qwen3vl/cpu/decode.py). Without a C compiler the build
skips it and the same steps run in numpy."""

import sys

from setuptools import Extension, setup

# Float reductions may be reordered (so the compiler can vectorize them), as the numpy kernels
# and BLAS reorder theirs; errno and trapping semantics are not needed. Not -ffast-math: the
# softmax relies on inf and NaN behaving as IEEE says.
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-ffp-contract=fast", "-Wno-psabi"]

extensions = []
if sys.platform != "win32":  # GCC / clang vector extensions
    extensions.append(Extension("mlx_qwen3vl.cpu._decode", ["mlx_qwen3vl/cpu/_decode.c"], extra_compile_args=FLAGS,
                                optional=True))

setup(ext_modules=extensions)
