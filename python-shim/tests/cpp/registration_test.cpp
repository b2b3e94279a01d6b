// AnnouncedRanges (bridge/registration.h) against a model of a consumer that
// registers on ALLOC and deregisters by start address on FREE, as
// ProcessGroupNCCL does: after every map/unmap of random page ranges the
// registered bytes must be exactly the mapped bytes, with no range
// registered twice and no FREE of an unknown start.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>

#include "bridge/registration.h"

using gpualloc_bridge::AnnouncedRanges;

int main() {
  const uint64_t page = 2 << 20;
  const int pages = 64;
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    AnnouncedRanges a;
    std::set<int> mapped;                 // page indices
    std::map<uint64_t, uint64_t> consumer;  // start -> size
    auto apply = [&](const std::vector<AnnouncedRanges::Change>& cs) {
      for (const auto& c : cs) {
        if (c.alloc) {
          if (consumer.count(c.addr) != 0) {
            std::printf("round %d: range at %llu announced twice\n", round, (unsigned long long)c.addr);
            std::exit(1);
          }
          consumer[c.addr] = c.size;
        } else if (consumer.erase(c.addr) != 1) {
          std::printf("round %d: FREE of unknown start %llu\n", round, (unsigned long long)c.addr);
          std::exit(1);
        }
      }
    };
    for (int op = 0; op < 300; ++op) {
      int start = static_cast<int>(rng() % pages);
      int len = 1 + static_cast<int>(rng() % 8);
      if (start + len > pages) {
        len = pages - start;
      }
      bool all_free = true;
      bool all_mapped = true;
      for (int p = start; p < start + len; ++p) {
        all_free = all_free && mapped.count(p) == 0;
        all_mapped = all_mapped && mapped.count(p) != 0;
      }
      if (all_free) {
        apply(a.mapped(0, start * page, len * page));
        for (int p = start; p < start + len; ++p) mapped.insert(p);
      } else if (all_mapped) {
        apply(a.unmapped(0, start * page, len * page));
        for (int p = start; p < start + len; ++p) mapped.erase(p);
      } else {
        continue;
      }
      std::set<int> registered;
      for (const auto& [s, n] : consumer) {
        for (uint64_t p = s / page; p < (s + n) / page; ++p) {
          if (!registered.insert(static_cast<int>(p)).second) {
            std::printf("round %d: page %llu registered twice\n", round, (unsigned long long)p);
            return 1;
          }
        }
      }
      if (registered != mapped) {
        std::printf("round %d op %d: registered pages differ from mapped pages\n", round, op);
        return 1;
      }
    }
  }
  std::printf("ok\n");
  return 0;
}
