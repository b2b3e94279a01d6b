// The order in which the snapshot's segments came to be.
//
// Note [Registration order]
// torch's ProcessGroupNCCL.register_mem_pool (2.11 and later) registers a
// MemPool's segments with NCCL sorted by `SegmentInfo.registration_counter`
// and asserts that each is set (>= 0): PyTorch's allocator numbers its
// segments as it creates them, so that every rank registers them, and opens
// symmetric-memory windows over them (a collective call), in one order.
// gpualloc's snapshot lists mapped runs instead, which grow, join and split
// as pages are mapped and unmapped. So the bridge numbers each range as it
// enters the snapshot (the listed view of Note [Segment events]); a range
// cut by an unmapping keeps its number in both pieces, and a segment of the
// snapshot gets the smallest number among the ranges it holds: the order
// its memory was first mapped in, the same on every rank that allocated
// the same way. A segment the bridge never saw enter (a race with a
// concurrent mapping) gets the next number. The private pools' ranges
// (graphs', MemPools') draw from a counter of their own: the default
// pools' stitches enter and leave the snapshot at every use and would
// soon run it past the 31 bits the field has.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <utility>

namespace gpualloc_bridge {

class SegmentOrder {
 public:
  // [addr, addr + size), of a private pool or not, entered the
  // snapshot's segments.
  void listed(int device, uint64_t addr, uint64_t size, bool private_pool) {
    if (size == 0) {
      return;
    }
    std::lock_guard<std::mutex> g(mutex_);
    auto& d = devices_[device];
    cut(d, addr, addr + size);  // nothing there, unless an event was missed
    d[addr] = {size, next_[private_pool]++};
  }

  // [addr, addr + size) left them; what stays of a range keeps its number.
  void unlisted(int device, uint64_t addr, uint64_t size) {
    if (size == 0) {
      return;
    }
    std::lock_guard<std::mutex> g(mutex_);
    cut(devices_[device], addr, addr + size);
  }

  // The number of the snapshot's segment [addr, addr + size): the smallest
  // of the ranges in it; a new one when none is known.
  int32_t of(int device, uint64_t addr, uint64_t size, bool private_pool) {
    std::lock_guard<std::mutex> g(mutex_);
    auto& d = devices_[device];
    uint64_t end = addr + size;
    int64_t best = -1;
    for (auto it = first_over(d, addr); it != d.end() && it->first < end; ++it) {
      if (it->first + it->second.size > addr && (best < 0 || it->second.number < best)) {
        best = it->second.number;
      }
    }
    if (best < 0) {
      cut(d, addr, end);
      best = next_[private_pool]++;
      d[addr] = {size, best};
    }
    return static_cast<int32_t>(std::min<int64_t>(best, std::numeric_limits<int32_t>::max()));
  }

 private:
  struct Range {
    uint64_t size;
    int64_t number;
  };
  using Ranges = std::map<uint64_t, Range>;  // start -> range; disjoint

  // The first range that may overlap [lo, ...): the one before `lo`, if any.
  static Ranges::iterator first_over(Ranges& d, uint64_t lo) {
    auto it = d.lower_bound(lo);
    return it == d.begin() ? it : std::prev(it);
  }

  // Takes [lo, hi) out of the ranges; the pieces left keep their numbers.
  static void cut(Ranges& d, uint64_t lo, uint64_t hi) {
    auto it = first_over(d, lo);
    while (it != d.end() && it->first < hi) {
      uint64_t s = it->first, e = s + it->second.size;
      int64_t n = it->second.number;
      if (e <= lo) {
        ++it;
        continue;
      }
      it = d.erase(it);
      if (s < lo) {
        d[s] = {lo - s, n};
      }
      if (e > hi) {
        d[hi] = {e - hi, n};
      }
    }
  }

  std::mutex mutex_;
  std::map<int, Ranges> devices_;
  int64_t next_[2] = {0, 0};  // the default pools', the private pools'
};

}  // namespace gpualloc_bridge
