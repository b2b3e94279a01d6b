"""Tests of the gpualloc package on the simulated backend (no GPU, no torch needed).

The library keeps one allocator per process, so the environment is fixed
here, before any test module loads it; tests that need another environment
run a subprocess.
"""

import os

os.environ["GPUALLOC_BACKEND"] = "sim"
os.environ["GPUALLOC_SIM_CAPACITY"] = "2GiB"
os.environ["GPUALLOC_SIM_DEVICES"] = "2"
os.environ.pop("GPUALLOC_CONF", None)
# PyTorch's settings may cap devices too (Note [PyTorch's settings under gpualloc]).
for _name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
    os.environ.pop(_name, None)
os.environ.pop("GPUALLOC_TRACE", None)
