"""Another allocator asked for after install(): gpualloc stays PyTorch's
CUDA allocator, and the program is told, instead of torch's "Can't swap
an already initialized allocator" (bridge) or a silent swap that drops
gpualloc (fallback). Runs on tests/fake_torch, whose change_current_allocator
records what it was given."""

import textwrap
import unittest

from . import __name__ as _env  # noqa: F401
from .test_auto import run

CODE = textwrap.dedent(
    """
    import warnings
    import torch, gpualloc
    assert getattr(torch, "FAKE", False)
    gpualloc.install(bridge=False)
    ours = list(torch.cuda.memory.installed)
    assert len(ours) == 1 and ours[0].alloc_fn.startswith("gpualloc_malloc"), ours

    class RmmAllocator:  # what rmm.allocators.torch hands PyTorch
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.memory.change_current_allocator(RmmAllocator())
        torch.cuda.change_current_allocator(RmmAllocator())
        torch.cuda.memory.change_current_allocator(ours[0])  # gpualloc's own: nothing said
    print("installed", len(torch.cuda.memory.installed))
    print("warnings", len(caught))
    print("text", str(caught[0].message))
    print("category", caught[0].category.__name__)
    """
)


class SwapTest(unittest.TestCase):
    def test_another_allocator_is_refused_with_a_warning_and_gpualloc_stays(self):
        out = run(["-c", CODE])
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
        self.assertEqual(lines["installed"], "1")  # nothing replaced gpualloc's allocator
        self.assertEqual(lines["warnings"], "2")
        self.assertEqual(lines["category"], "RuntimeWarning")
        self.assertIn("change_current_allocator(RmmAllocator) ignored", lines["text"])
        self.assertIn("use_mem_pool", lines["text"])


if __name__ == "__main__":
    unittest.main()
