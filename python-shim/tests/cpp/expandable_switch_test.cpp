// ExpandableSwitch (bridge/expandable_switch.h, Note [PyTorch's
// expandable_segments switch]) against this torch's own settings parser:
// gpualloc is told "plain" only once PyTorch's expandable_segments was
// stated and is false, and only when that changes.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bridge/expandable_switch.h"

using gpualloc_bridge::ExpandableSwitch;
using gpualloc_bridge::names_expandable_segments;

namespace {
std::vector<int> told;

int fake_set_plain_requests(int plain) {
  told.push_back(plain);
  return GPUALLOC_OK;
}

void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    std::exit(1);
  }
}

void expect_told(const std::vector<int>& want, const char* what) {
  expect(told == want, what);
}
}  // namespace

int main() {
  expect(names_expandable_segments("expandable_segments:False"), "the key alone");
  expect(names_expandable_segments("max_split_size_mb:64, expandable_segments : True"), "after another key");
  expect(!names_expandable_segments("expandable_segments_handle_type:posix_fd"), "a longer key");
  expect(!names_expandable_segments("pinned_expandable_segments:True"), "a key ending in it");
  expect(!names_expandable_segments(""), "nothing set");

  gpualloc_bridge::api.set_plain_requests = &fake_set_plain_requests;
  ExpandableSwitch sw;
  expect(!sw.sync(), "unset: nothing said");
  expect_told({}, "unset: nothing to tell");
  c10::CachingAllocator::setAllocatorSettings("max_split_size_mb:64");
  sw.sync();
  expect_told({}, "another key: nothing to tell");
  c10::CachingAllocator::setAllocatorSettings("expandable_segments:False");
  expect(sw.sync(), "turned plain: said");
  expect_told({1}, "stated off: plain");
  expect(!sw.sync(), "still plain: not said again");
  c10::CachingAllocator::setAllocatorSettings("max_split_size_mb:128");
  sw.sync();
  expect_told({1}, "still off after another key");
  c10::CachingAllocator::setAllocatorSettings("expandable_segments:True");
  sw.sync();
  expect_told({1, 0}, "on again");
  c10::CachingAllocator::setAllocatorSettings("expandable_segments:False");
  sw.sync();
  expect_told({1, 0, 1}, "off again");
  std::printf("expandable switch: ok\n");
  return 0;
}
