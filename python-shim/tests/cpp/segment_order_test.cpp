// SegmentOrder (bridge/segment_order.h, Note [Registration order]) against a
// model: random pages of one device enter and leave the listed view in runs,
// each run numbered as it enters; the snapshot's segments are the maximal
// runs of listed pages (cut at random places, as adjacent reservations
// are). Every segment must get the smallest number of the pages in it,
// every number must be >= 0, and segments first mapped earlier must sort
// first, which is what register_mem_pool relies on.
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>

#include "bridge/segment_order.h"

using gpualloc_bridge::SegmentOrder;

namespace {
const uint64_t kPage = 2 << 20;
const int kPages = 96;
}  // namespace

int main() {
  std::mt19937_64 rng(11);
  long checked = 0;
  for (int round = 0; round < 200; ++round) {
    SegmentOrder order;
    std::map<int, int64_t> number;  // listed page -> its run's number
    int64_t next = 0;
    for (int op = 0; op < 200; ++op) {
      int start = static_cast<int>(rng() % kPages);
      int len = 1 + static_cast<int>(rng() % 10);
      if (start + len > kPages) len = kPages - start;
      bool all_free = true, all_listed = true;
      for (int p = start; p < start + len; ++p) {
        all_free = all_free && number.count(p) == 0;
        all_listed = all_listed && number.count(p) != 0;
      }
      if (all_free) {
        order.listed(0, start * kPage, len * kPage, true);
        for (int p = start; p < start + len; ++p) number[p] = next;
        ++next;
      } else if (all_listed) {
        order.unlisted(0, start * kPage, len * kPage);
        for (int p = start; p < start + len; ++p) number.erase(p);
      } else {
        continue;
      }
      // The snapshot: maximal runs, cut at random.
      for (auto it = number.begin(); it != number.end();) {
        int s = it->first, e = s;
        int64_t want = it->second;
        while (number.count(e) != 0 && (e == s || rng() % 5 != 0)) {
          want = std::min(want, number[e]);
          ++e;
        }
        int32_t got = order.of(0, s * kPage, (e - s) * kPage, true);
        if (got < 0 || got != want) {
          std::printf("round %d op %d: pages %d..%d numbered %d, want %lld\n", round, op, s, e, got,
                      static_cast<long long>(want));
          return 1;
        }
        ++checked;
        it = number.lower_bound(e);
      }
    }
    // A segment never seen gets a new number, larger than any given.
    SegmentOrder fresh;
    fresh.listed(1, 0, kPage, true);
    if (fresh.of(1, 4 * kPage, kPage, true) != 1 || fresh.of(1, 0, kPage, true) != 0) {
      std::printf("an unseen segment is not numbered after the seen ones\n");
      return 1;
    }
    // The default pools count apart: their churn leaves the private
    // pools' numbers as they are.
    for (int i = 0; i < 5; ++i) {
      fresh.listed(1, (8 + i) * kPage, kPage, false);
    }
    fresh.listed(1, 20 * kPage, kPage, true);
    if (fresh.of(1, 20 * kPage, kPage, true) != 2 || fresh.of(1, 12 * kPage, kPage, false) != 4) {
      std::printf("the default pools' ranges took the private pools' numbers\n");
      return 1;
    }
  }
  std::printf("ok (%ld segments checked)\n", checked);
  return 0;
}
