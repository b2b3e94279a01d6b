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
//
// Note [Communicators that register the snapshot]
// A communicator that starts after memory was mapped registers the
// snapshot's segments by itself: whole mapped runs, where one started
// earlier holds the same memory in the pieces it was announced in. Each
// snapshot taken while trackers listen is therefore remembered too
// (`registered_from_snapshot`), so the announced ranges may overlap: every
// start any communicator registered is one of them. An unmap withdraws
// every announced range over the hole and, transitively, every range over
// one of those (by start address: each communicator drops the one it holds
// there; one that holds none refuses, which the bridge tolerates), then
// announces once what of their union stays mapped. Every communicator then
// holds exactly the mapped memory again, each page once.
//
// Every range keeps the private pool gpualloc named for it (`{0, 0}`: the
// default pools): ProcessGroupNCCL registers the SEGMENT_ALLOC of a
// MemPool registered with it (`register_mem_pool`) by `TraceEntry.mempool_`.
// What stays of withdrawn ranges is announced again pool by pool, each
// piece in the pool of the ranges it came from.
//
// Note [A pool's runs]
// ProcessGroupNCCL.deregister_mem_pool deregisters the start of each
// segment of the pool's snapshot, and gpualloc's snapshot lists a mapped
// run of an expandable segment as one segment, however many mappings made
// it. So a mapping of a private pool's expandable memory (`joins`) takes
// the announced ranges of the pool it touches with it: they are withdrawn
// and their union announced once, and every run is one announced range,
// registered and deregistered at its start. Runs of two segments never
// touch (gpualloc reserves an unmapped page past each segment's end).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

namespace gpualloc_bridge {

class AnnouncedRanges {
 public:
  // A private pool's id; `{0, 0}` for the default pools.
  using Pool = std::pair<uint64_t, uint64_t>;

  struct Change {
    bool alloc;  // true: announce [addr, addr + size); false: withdraw the range at addr
    int device;
    uint64_t addr;
    uint64_t size;
    Pool pool;
  };

  // Memory [addr, addr + size) of pool `pool` became usable: announce it;
  // with `joins`, together with the pool's announced ranges it touches
  // (Note [A pool's runs]).
  std::vector<Change> mapped(int device, uint64_t addr, uint64_t size, Pool pool = {0, 0}, bool joins = false) {
    std::vector<Change> out;
    if (size == 0) {
      return out;
    }
    // A range announced already (a seeded segment) is not announced twice.
    auto& d = devices_[device];
    if (d.covers(addr, addr + size)) {
      return out;
    }
    uint64_t lo = addr;
    uint64_t hi = addr + size;
    std::vector<std::pair<uint64_t, uint64_t>> frontier{{lo, hi}};
    while (joins && !frontier.empty()) {
      auto [a, b] = frontier.back();
      frontier.pop_back();
      // Touching [a, b) or overlapping it, in this pool.
      for (auto [s, r] : d.over(a > 0 ? a - 1 : 0, b + 1)) {
        if (r.pool == pool) {
          d.ranges.erase(s);
          out.push_back({false, device, s, r.size, r.pool});
          lo = std::min(lo, s);
          hi = std::max(hi, s + r.size);
          frontier.emplace_back(s, s + r.size);
        }
      }
    }
    d.put(lo, hi - lo, pool);
    out.push_back({true, device, lo, hi - lo, pool});
    return out;
  }

  // Memory [addr, addr + size) is about to go: withdraw every announced
  // range over it, and every range over one of those, then announce their
  // union less the hole (Note [Communicators that register the snapshot]).
  std::vector<Change> unmapped(int device, uint64_t addr, uint64_t size) {
    std::vector<Change> out;
    if (size == 0) {
      return out;
    }
    auto& d = devices_[device];
    uint64_t end = addr + size;
    std::vector<std::tuple<Pool, uint64_t, uint64_t>> taken;  // pool, [start, end)
    std::vector<std::pair<uint64_t, uint64_t>> frontier{{addr, end}};
    while (!frontier.empty()) {
      auto [lo, hi] = frontier.back();
      frontier.pop_back();
      for (auto [s, r] : d.over(lo, hi)) {
        d.ranges.erase(s);
        out.push_back({false, device, s, r.size, r.pool});
        taken.emplace_back(r.pool, s, s + r.size);
        frontier.emplace_back(s, s + r.size);
      }
    }
    // What of the withdrawn ranges stays mapped: their union less the
    // hole, pool by pool.
    std::sort(taken.begin(), taken.end());
    std::vector<std::tuple<Pool, uint64_t, uint64_t>> runs;
    for (auto [p, s, e] : taken) {
      if (!runs.empty() && std::get<0>(runs.back()) == p && s <= std::get<2>(runs.back())) {
        std::get<2>(runs.back()) = std::max(std::get<2>(runs.back()), e);
      } else {
        runs.emplace_back(p, s, e);
      }
    }
    for (auto [p, s, e] : runs) {
      for (auto [a, b] : {std::make_pair(s, std::min(e, addr)), std::make_pair(std::max(s, end), e)}) {
        if (a < b) {
          d.put(a, b - a, p);
          out.push_back({true, device, a, b - a, p});
        }
      }
    }
    return out;
  }

  // Ranges a consumer registered by itself when trackers were attached:
  // what was mapped then (a segment of pool `pool`).
  void seed(int device, uint64_t addr, uint64_t size, Pool pool = {0, 0}) {
    if (size != 0) {
      devices_[device].put(addr, size, pool);
    }
  }

  // A snapshot's segment [addr, addr + size), which a communicator starting
  // now registers by itself. Remembered as far as announced memory runs on
  // without a gap from its start (the rest went since the snapshot was
  // read); not at all when its start went (nothing could withdraw it).
  void registered_from_snapshot(int device, uint64_t addr, uint64_t size, Pool pool = {0, 0}) {
    auto& d = devices_[device];
    uint64_t stop = std::min(d.covered_from(addr), addr + size);
    if (stop > addr) {
      d.put(addr, stop - addr, pool);
    }
  }

 private:
  struct Range {
    uint64_t size;
    Pool pool;
  };

  struct Device {
    std::map<uint64_t, Range> ranges;  // start -> range; overlapping ranges allowed
    uint64_t longest = 0;

    // One range a start: the longer is kept (a FREE names only the start).
    void put(uint64_t s, uint64_t n, Pool pool) {
      auto [it, fresh] = ranges.try_emplace(s, Range{n, pool});
      if (!fresh && it->second.size < n) {
        it->second = Range{n, pool};
      }
      longest = std::max(longest, n);
    }

    // The ranges overlapping [lo, hi), as (start, range).
    std::vector<std::pair<uint64_t, Range>> over(uint64_t lo, uint64_t hi) const {
      std::vector<std::pair<uint64_t, Range>> out;
      auto it = ranges.lower_bound(lo > longest ? lo - longest : 0);
      for (; it != ranges.end() && it->first < hi; ++it) {
        if (it->first + it->second.size > lo) {
          out.emplace_back(it->first, it->second);
        }
      }
      return out;
    }

    // The end of the announced memory that runs without a gap from `at`
    // (`at` itself when `at` is not announced).
    uint64_t covered_from(uint64_t at) const {
      uint64_t reach = at;
      for (bool grew = true; grew;) {
        grew = false;
        for (auto [s, r] : over(reach, reach + 1)) {
          if (s + r.size > reach) {
            reach = s + r.size;
            grew = true;
          }
        }
      }
      return reach;
    }

    bool covers(uint64_t lo, uint64_t hi) const { return covered_from(lo) >= hi; }
  };

  std::map<int, Device> devices_;
};

}  // namespace gpualloc_bridge
