"""The bridge's error and warning messages are one string each.

Note [Numbers in the bridge's messages] (python-shim/gpualloc/bridge/api.h):
a message that streamed a number through c10::str crashed the process on
the GPU machine where an error was to be raised. Each TORCH_CHECK,
TORCH_CHECK_WITH, TORCH_WARN and TORCH_WARN_ONCE of the bridge therefore
takes its message as one argument (a literal or a std::string built with
num() and ptr_text()), which c10::str hands on without a stream.
"""

from __future__ import annotations

import glob
import os
import re
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = [os.path.join(ROOT, "python-shim", "gpualloc", "bridge.cpp")] + sorted(
    glob.glob(os.path.join(ROOT, "python-shim", "gpualloc", "bridge", "*.h")))

# Macro -> how many leading arguments are not the message.
MACROS = {
    "TORCH_CHECK": 1, "TORCH_CHECK_WITH": 2, "TORCH_CHECK_VALUE": 1, "TORCH_CHECK_TYPE": 1,
    "TORCH_CHECK_INDEX": 1, "TORCH_CHECK_NOT_IMPLEMENTED": 1, "TORCH_INTERNAL_ASSERT": 1,
    "TORCH_WARN": 0, "TORCH_WARN_ONCE": 0, "TORCH_WARN_DEPRECATION": 0, "C10_THROW_ERROR": 1,
    "AT_ERROR": 0,
}
# Calls that build a message from pieces out of sight: not in the bridge.
# c10::str itself; C10_CUDA_CHECK_WARN's TORCH_WARN of two pieces, which
# CUDAGuard's destructor also reaches (bridge/device_scope.h instead); and
# c10's parseTraceEntryAction, whose error streams the unknown name
# (history.h's skip_action instead).
FORBIDDEN = ("c10::str", "C10_CUDA_CHECK_WARN", "CUDAGuard", "parseTraceEntryAction")


def strip_comments(text: str) -> str:
    """The source with // and /* */ comments blanked (string literals kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def arguments(text: str, start: int) -> list[str]:
    """The top-level arguments of the call whose '(' is at `start`."""
    args, depth, cur, i = [], 0, [], start + 1
    while i < len(text):
        c = text[i]
        if c in "\"'":
            j = i + 1
            while text[j] != c:
                j += 2 if text[j] == "\\" else 1
            cur.append(text[i:j + 1])
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                args.append("".join(cur).strip())
                return args
            depth -= 1
        elif c == "," and depth == 0:
            args.append("".join(cur).strip())
            cur = []
            i += 1
            continue
        cur.append(c)
        i += 1
    raise AssertionError(f"unbalanced call at {start}")


def calls(path: str):
    """(macro, line, arguments) of every message macro in `path`."""
    with open(path, encoding="utf-8") as f:
        text = strip_comments(f.read())
    names = "|".join(sorted(MACROS, key=len, reverse=True))
    for m in re.finditer(rf"\b({names})\s*\(", text):
        line = text.count("\n", 0, m.start()) + 1
        yield m.group(1), line, arguments(text, m.end() - 1)


class BridgeMessages(unittest.TestCase):
    def test_the_parser_reads_calls(self):
        found = [c for p in SOURCES for c in calls(p)]
        self.assertGreater(len(found), 10)
        self.assertEqual(arguments('f(a, g(b, c), "x, y")', 1), ["a", "g(b, c)", '"x, y"'])

    def test_no_message_is_built_out_of_sight(self):
        for path in SOURCES:
            with open(path, encoding="utf-8") as f:
                text = strip_comments(f.read())
            for name in FORBIDDEN:
                with self.subTest(file=os.path.basename(path), call=name):
                    self.assertNotIn(name + "(" if name == "c10::str" else name, text,
                                     f"{os.path.basename(path)} uses {name}: build one std::string instead")

    def test_every_message_is_one_argument(self):
        for path in SOURCES:
            for macro, line, args in calls(path):
                message = args[MACROS[macro]:]
                with self.subTest(file=os.path.basename(path), line=line):
                    self.assertLessEqual(
                        len(message), 1,
                        f"{os.path.basename(path)}:{line}: {macro} with a message of {len(message)} pieces "
                        f"({message}); build one std::string (num(), ptr_text())")


if __name__ == "__main__":
    unittest.main()
