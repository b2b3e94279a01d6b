"""C++ compiled against the installed torch for a GPU check (the checks that
call torch's allocator from C++: churn_cpp, trace_cpp, compat's
expandable_segment_sizes), built once per torch in GPUALLOC_BUILD_DIR (or
/tmp)."""

from __future__ import annotations

import os


def build(name: str, source: str, functions: list[str], opt: str = "-O2"):
    """`source`'s `functions` as a Python module called `name`."""
    import torch
    from torch.utils.cpp_extension import load_inline

    # One build a torch: a build against another one's headers would load.
    folder = os.path.join(os.environ.get("GPUALLOC_BUILD_DIR") or "/tmp", f"{name}-{torch.__version__}")
    os.makedirs(folder, exist_ok=True)
    return load_inline(name, cpp_sources=[source], functions=functions, build_directory=folder,
                       extra_cflags=[opt], with_cuda=True)
