"""docs/torch-compat.md against the bridge and against torch's headers.

The table must list every member the bridge overrides and every virtual
member of torch's CUDAAllocator, DeviceAllocator and Allocator in the
installed torch (found through torch.utils.cpp_extension, or the directory
in GPUALLOC_TORCH_INCLUDE). Without torch headers the second check says
SKIPPED; tests/gpu/run.sh runs it where torch is installed.
"""

from __future__ import annotations

import os
import re
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(ROOT, "docs", "torch-compat.md")
BRIDGE = os.path.join(ROOT, "python-shim", "gpualloc", "bridge.cpp")

# (header relative to the include root, class name) whose virtuals the bridge must cover.
CLASSES = [
    ("c10/cuda/CUDACachingAllocator.h", "CUDAAllocator"),
    ("c10/core/CachingDeviceAllocator.h", "DeviceAllocator"),
    ("c10/core/Allocator.h", "Allocator"),
]


def table_members(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        m = re.match(r"\|\s*`(\w+)`", line)
        if m:
            names.add(m.group(1))
    return names


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", " ", src)


def _name_before_paren(src: str, close: int) -> str | None:
    """The identifier before the '(' that matches the ')' at `close`."""
    depth = 0
    for i in range(close, -1, -1):
        if src[i] == ")":
            depth += 1
        elif src[i] == "(":
            depth -= 1
            if depth == 0:
                m = re.search(r"(~?\w+)\s*$", src[:i])
                return m.group(1) if m else None
    return None


def overridden_members(src: str) -> set[str]:
    src = _strip_comments(src)
    names = set()
    for m in re.finditer(r"\)\s*(?:const\s*)?(?:override|final)\b", src):
        name = _name_before_paren(src, m.start())
        if name:
            names.add(name)
    return names


def class_body(src: str, name: str) -> str:
    m = re.search(r"(?:class|struct)\s+(?:\w+\s+)?" + name + r"\b[^;{]*\{", src)
    if not m:
        raise AssertionError(f"class {name} not found")
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        i += 1
    return src[m.end() : i - 1]


def virtual_members(body: str) -> set[str]:
    body = _strip_comments(body)
    names = set()
    for m in re.finditer(r"\bvirtual\b", body):
        paren = body.index("(", m.end())
        ident = re.search(r"(~?\w+)\s*$", body[m.end() : paren])
        if ident and not ident.group(1).startswith("~"):
            names.add(ident.group(1))
    return names


def torch_include_dir() -> str | None:
    env = os.environ.get("GPUALLOC_TORCH_INCLUDE")
    if env:
        return env
    try:
        from torch.utils import cpp_extension
    except Exception:  # noqa: BLE001 - no torch here
        return None
    for d in cpp_extension.include_paths():
        if os.path.isfile(os.path.join(d, CLASSES[0][0])):
            return d
    return None


class TorchCompatTable(unittest.TestCase):
    def setUp(self):
        with open(TABLE) as f:
            self.table = table_members(f.read())
        with open(BRIDGE) as f:
            self.bridge = overridden_members(f.read())

    def test_parsers_see_something(self):
        self.assertGreater(len(self.table), 40, "the table lost its rows")
        self.assertIn("setCheckpointPoolState", self.bridge)
        self.assertIn("copy_data", self.bridge)  # a `final` one

    def test_every_bridge_override_is_in_the_table(self):
        missing = sorted(self.bridge - self.table)
        self.assertEqual(missing, [], f"docs/torch-compat.md does not list: {missing}")

    def test_the_parser_finds_virtuals(self):
        src = "struct C10_API Allocator {\n virtual ~Allocator() = default;\n virtual DataPtr allocate(size_t n) = 0;\n" \
              " // virtual void gone();\n virtual DeleterFnPtr raw_deleter() const {\n return nullptr; }\n};"
        self.assertEqual(virtual_members(class_body(src, "Allocator")), {"allocate", "raw_deleter"})

    def test_every_virtual_of_the_installed_torch_is_in_the_table(self):
        inc = torch_include_dir()
        if inc is None:
            print("\nSKIPPED: no torch headers (install torch or set GPUALLOC_TORCH_INCLUDE)", flush=True)
            self.skipTest("no torch headers")
        found = set()
        for header, cls in CLASSES:
            with open(os.path.join(inc, header)) as f:
                found |= virtual_members(class_body(f.read(), cls))
        self.assertIn("allocate", found)
        missing = sorted(found - self.table)
        self.assertEqual(missing, [], f"torch at {inc} declares virtual members docs/torch-compat.md does not list: {missing}")


if __name__ == "__main__":
    unittest.main()
