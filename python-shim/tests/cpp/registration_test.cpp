// AnnouncedRanges (bridge/registration.h) against models of consumers that
// register on ALLOC and deregister by start address on FREE, as
// ProcessGroupNCCL's communicators do. The first listens from the start;
// in half the rounds more start at random moments and first register the
// snapshot's segments by themselves (mapped runs, cut at random places as
// adjacent reservations are), as a communicator created after the model's
// memory does. After every map/unmap of random page ranges each consumer
// must hold exactly the mapped pages, each once. A consumer refuses an
// ALLOC of a start it holds and a FREE of a start it does not (NCCL's
// registration throws; the bridge tolerates it); with one consumer nothing
// may be refused. Each map is of one of three pools, and every range a
// consumer holds must be announced in the pool of all its pages (NCCL
// registers a MemPool's segments by it). Maps of the two private pools
// join the pool's touching ranges (Note [A pool's runs]): a consumer that
// listens from the start holds each private pool's run as one range.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "bridge/registration.h"

using gpualloc_bridge::AnnouncedRanges;
using Pool = AnnouncedRanges::Pool;

namespace {

const uint64_t kPage = 2 << 20;
const int kPages = 64;
const Pool kPools[] = {{0, 0}, {1, 0}, {7, 42}};

struct Consumer {
  std::map<uint64_t, std::pair<uint64_t, Pool>> held;  // start -> (size, pool)
  int refused = 0;

  void apply(const std::vector<AnnouncedRanges::Change>& cs) {
    for (const auto& c : cs) {
      if (c.alloc) {
        if (!held.emplace(c.addr, std::make_pair(c.size, c.pool)).second) {
          ++refused;
        }
      } else if (held.erase(c.addr) != 1) {
        ++refused;
      }
    }
  }

  // The pages held, or -1 in `twice` for the first page held twice and in
  // `elsewhere` for the first held in another pool than its own.
  std::set<int> pages(const std::map<int, Pool>& pool_of, int* twice, int* elsewhere) const {
    std::set<int> out;
    *twice = -1;
    *elsewhere = -1;
    for (const auto& [s, held_as] : held) {
      for (uint64_t p = s / kPage; p < (s + held_as.first) / kPage; ++p) {
        if (!out.insert(static_cast<int>(p)).second && *twice < 0) {
          *twice = static_cast<int>(p);
        }
        auto it = pool_of.find(static_cast<int>(p));
        if ((it == pool_of.end() || it->second != held_as.second) && *elsewhere < 0) {
          *elsewhere = static_cast<int>(p);
        }
      }
    }
    return out;
  }
};

}  // namespace

int main() {
  std::mt19937_64 rng(7);
  int snapshots = 0;
  int refusals = 0;
  for (int round = 0; round < 400; ++round) {
    bool late_consumers = round % 2 == 1;
    AnnouncedRanges a;
    std::set<int> mapped;        // page indices
    std::map<int, Pool> pool_of;  // mapped page -> its pool
    std::vector<Consumer> consumers(1);
    for (int op = 0; op < 300; ++op) {
      if (late_consumers && consumers.size() < 4 && rng() % 40 == 0) {
        // A communicator starts: it registers the snapshot's segments.
        Consumer c;
        for (auto it = mapped.begin(); it != mapped.end();) {
          // A segment is of one pool.
          int start = *it;
          int end = start;
          while (mapped.count(end) != 0 && pool_of[end] == pool_of[start] && (end == start || rng() % 6 != 0)) {
            ++end;
          }
          c.held[start * kPage] = {(end - start) * kPage, pool_of[start]};
          a.registered_from_snapshot(0, start * kPage, (end - start) * kPage, pool_of[start]);
          it = mapped.lower_bound(end);
        }
        consumers.push_back(c);
        ++snapshots;
      }
      int start = static_cast<int>(rng() % kPages);
      int len = 1 + static_cast<int>(rng() % 8);
      if (start + len > kPages) {
        len = kPages - start;
      }
      bool all_free = true;
      bool all_mapped = true;
      for (int p = start; p < start + len; ++p) {
        all_free = all_free && mapped.count(p) == 0;
        all_mapped = all_mapped && mapped.count(p) != 0;
      }
      std::vector<AnnouncedRanges::Change> cs;
      if (all_free) {
        Pool pool = kPools[rng() % 3];
        cs = a.mapped(0, start * kPage, len * kPage, pool, pool != kPools[0]);
        for (int p = start; p < start + len; ++p) {
          mapped.insert(p);
          pool_of[p] = pool;
        }
      } else if (all_mapped) {
        cs = a.unmapped(0, start * kPage, len * kPage);
        for (int p = start; p < start + len; ++p) {
          mapped.erase(p);
          pool_of.erase(p);
        }
      } else {
        continue;
      }
      for (auto& c : consumers) {
        c.apply(cs);
      }
      for (size_t i = 0; i < consumers.size(); ++i) {
        int twice = -1;
        int elsewhere = -1;
        if (consumers[i].pages(pool_of, &twice, &elsewhere) != mapped) {
          std::printf("round %d op %d: consumer %zu holds other pages than the mapped ones\n", round, op, i);
          return 1;
        }
        if (twice >= 0) {
          std::printf("round %d op %d: consumer %zu holds page %d twice\n", round, op, i, twice);
          return 1;
        }
        if (elsewhere >= 0) {
          std::printf("round %d op %d: consumer %zu holds page %d in another pool\n", round, op, i, elsewhere);
          return 1;
        }
      }
      if (consumers.size() == 1 && consumers[0].refused != 0) {
        std::printf("round %d op %d: with one consumer, a change was refused\n", round, op);
        return 1;
      }
      if (!late_consumers) {
        const auto& held = consumers[0].held;
        for (auto it = held.begin(); it != held.end() && std::next(it) != held.end(); ++it) {
          auto nx = std::next(it);
          Pool p = it->second.second;
          if (p != kPools[0] && nx->second.second == p && it->first + it->second.first == nx->first) {
            std::printf("round %d op %d: a run of pool (%llu, %llu) is held in pieces at %llu\n", round, op,
                        static_cast<unsigned long long>(p.first), static_cast<unsigned long long>(p.second),
                        static_cast<unsigned long long>(nx->first / kPage));
            return 1;
          }
        }
      }
    }
    for (const auto& c : consumers) {
      refusals += c.refused;
    }
  }
  if (snapshots == 0) {
    std::printf("no consumer started late: the test tested nothing new\n");
    return 1;
  }
  std::printf("ok (%d late consumers, %d refused changes)\n", snapshots, refusals);
  return 0;
}
