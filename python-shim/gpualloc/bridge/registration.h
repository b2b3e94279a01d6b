// What torch's allocator trace trackers are told about segments.
//
// ProcessGroupNCCL registers memory with NCCL on SEGMENT_ALLOC (a range) and
// deregisters on SEGMENT_FREE (by start address only); it ignores the
// SEGMENT_MAP/UNMAP events of expandable memory, which is why NCCL buffer
// registration breaks with PyTorch's expandable segments. gpualloc maps and
// unmaps pages of expandable segments in ranges that need not match earlier
// ones, so the bridge keeps the set of ranges it has announced and turns
// every map/unmap into ALLOC/FREE of whole announced ranges: a tracker that
// registers on ALLOC and deregisters on FREE always has exactly the mapped
// memory registered, each range once, and never a range that was unmapped.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace gpualloc_bridge {

class AnnouncedRanges {
 public:
  struct Change {
    bool alloc;  // true: announce [addr, addr + size); false: withdraw the range at addr
    int device;
    uint64_t addr;
    uint64_t size;
  };

  // Memory [addr, addr + size) became usable: announce it.
  std::vector<Change> mapped(int device, uint64_t addr, uint64_t size) {
    std::vector<Change> out;
    if (size == 0) {
      return out;
    }
    // A range announced already (a seeded segment) is not announced twice.
    auto& m = ranges_[device];
    auto it = m.upper_bound(addr);
    if (it != m.begin() && std::prev(it)->first + std::prev(it)->second >= addr + size) {
      return out;
    }
    m[addr] = size;
    out.push_back({true, device, addr, size});
    return out;
  }

  // Memory [addr, addr + size) is about to go: withdraw every announced
  // range it touches and announce again what of them stays.
  std::vector<Change> unmapped(int device, uint64_t addr, uint64_t size) {
    std::vector<Change> out;
    auto& m = ranges_[device];
    uint64_t end = addr + size;
    auto it = m.upper_bound(addr);
    if (it != m.begin() && std::prev(it)->first + std::prev(it)->second > addr) {
      --it;
    }
    std::vector<std::pair<uint64_t, uint64_t>> keep;
    while (it != m.end() && it->first < end) {
      uint64_t s = it->first;
      uint64_t e = s + it->second;
      out.push_back({false, device, s, it->second});
      if (s < addr) {
        keep.emplace_back(s, addr - s);
      }
      if (e > end) {
        keep.emplace_back(end, e - end);
      }
      it = m.erase(it);
    }
    for (const auto& [s, n] : keep) {
      m[s] = n;
      out.push_back({true, device, s, n});
    }
    return out;
  }

  // Ranges a consumer registered by itself (ProcessGroupNCCL registers the
  // snapshot's segments when a communicator starts).
  void seed(int device, uint64_t addr, uint64_t size) { ranges_[device][addr] = size; }

 private:
  std::map<int, std::map<uint64_t, uint64_t>> ranges_;
};

}  // namespace gpualloc_bridge
