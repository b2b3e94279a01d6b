// The bridge's memory history (bridge/history.h) against PyTorch's rules for
// which entry carries which stack (CUDACachingAllocator's record_trace and
// free): below RecordContext::ALLOC no trace entry has one, a live block
// keeps its allocation's for the snapshot from STATE on; a free's request
// carries the free's stack, else its block's; so does its completion, and a
// deferred one the stack of the request completing it (process_events),
// else its block's; an out-of-memory entry the request's; a segment change
// during a free comes after the free's completion. Compiled against torch's
// headers and linked with its libc10 by tools/check_bridge.sh (no GPU, no
// CUDA runtime: only cudaStream_t's type is used).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bridge/history.h"

using gpualloc_bridge::History;
using gpualloc_bridge::RecordContext;
using gpualloc_bridge::TraceEntry;

namespace {

struct Named : c10::GatheredContext {
  explicit Named(std::string n) : name(std::move(n)) {}
  std::string name;
};

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what.c_str());
    ++failures;
  }
}

std::shared_ptr<c10::GatheredContext> named(const char* n) { return std::make_shared<Named>(n); }

std::string name_of(const std::shared_ptr<c10::GatheredContext>& c) {
  auto* n = dynamic_cast<Named*>(c.get());
  return n == nullptr ? "-" : n->name;
}

std::shared_ptr<c10::GatheredContext> recorder() { return named("recorder"); }

// "action:stack" for each entry of device 0, oldest first.
std::string entries(const History& h) {
  std::string out;
  auto all = h.traces(1);
  for (const auto& e : all[0]) {
    const char* a = e.action_ == TraceEntry::ALLOC            ? "alloc"
                    : e.action_ == TraceEntry::FREE_REQUESTED ? "free_requested"
                    : e.action_ == TraceEntry::FREE_COMPLETED ? "free_completed"
                    : e.action_ == TraceEntry::SEGMENT_MAP    ? "segment_map"
                    : e.action_ == TraceEntry::SEGMENT_UNMAP  ? "segment_unmap"
                                                              : "other";
    out += std::string(out.empty() ? "" : " ") + a + ":" + name_of(e.context_);
  }
  return out;
}

void record(History& h, RecordContext when) { h.configure(true, &recorder, 1000, when, true, {}); }

// An allocation by "a" freed by "f" at once, and one by "b" left live.
void alloc_free_keep(History& h) {
  void* p = reinterpret_cast<void*>(0x1000);
  h.on_alloc(p, 64, 0, nullptr, named("a"));
  // The bridge gathers a free's stack at "all" only.
  uint64_t seq = h.on_free_requested(p, 0, h.gather(RecordContext::ALL) ? named("f") : nullptr);
  h.after_free(p, seq);
  h.on_alloc(reinterpret_cast<void*>(0x2000), 64, 0, nullptr, named("b"));
}

void check(const std::string& what, const std::string& got, const std::string& want) {
  expect(got == want, what + ": got \"" + got + "\", want \"" + want + "\"");
}

}  // namespace

int main() {
  {
    History h;
    record(h, RecordContext::STATE);
    alloc_free_keep(h);
    check("state: no entry has a stack", entries(h), "alloc:- free_requested:- free_completed:- alloc:-");
    check("state: a live block keeps its stack", name_of(h.context_of(reinterpret_cast<void*>(0x2000))), "b");
    check("state: a freed block has none", name_of(h.context_of(reinterpret_cast<void*>(0x1000))), "-");
  }
  {
    History h;
    record(h, RecordContext::ALLOC);
    alloc_free_keep(h);
    check("alloc: a free without a stack of its own carries its block's", entries(h),
          "alloc:a free_requested:a free_completed:a alloc:b");
  }
  {
    History h;
    record(h, RecordContext::ALL);
    alloc_free_keep(h);
    check("all: a free carries its own stack", entries(h), "alloc:a free_requested:f free_completed:f alloc:b");
  }
  {
    // A free that waits for other streams completes later, with the stack
    // of the request that completes it (PyTorch's process_events(context)
    // in malloc), else its block's.
    History h;
    record(h, RecordContext::ALL);
    void* p = reinterpret_cast<void*>(0x3000);
    void* q = reinterpret_cast<void*>(0x3800);
    h.on_alloc(p, 64, 0, nullptr, named("a"));
    h.on_alloc(q, 64, 0, nullptr, named("b"));
    for (void* x : {p, q}) {
      uint64_t seq = h.on_free_requested(x, 0, named("f"));
      h.on_block_deferred(x);
      h.after_free(x, seq);
    }
    check("deferred: not complete when the free returns", entries(h),
          "alloc:a alloc:b free_requested:f free_requested:f");
    History::pending_context() = named("m");
    h.on_block_freed(p);
    History::pending_context().reset();
    h.on_block_freed(q);
    check("deferred: complete when gpualloc frees it", entries(h),
          "alloc:a alloc:b free_requested:f free_requested:f free_completed:m free_completed:b");
  }
  {
    // A checkpoint's restore frees with its own stack, else the block's.
    History h;
    record(h, RecordContext::ALLOC);
    void* p = reinterpret_cast<void*>(0x3000);
    h.on_alloc(p, 64, 0, nullptr, named("a"));
    h.on_free(p, 0, nullptr);
    check("restore at alloc: the block's stack", entries(h), "alloc:a free_requested:a free_completed:a");
  }
  for (RecordContext when : {RecordContext::STATE, RecordContext::ALLOC}) {
    // An out-of-memory entry has the request's stack, from "alloc" on.
    History h;
    record(h, when);
    h.on_event(TraceEntry::OOM, 0, 0, 1 << 30, nullptr, named("r"));
    auto all = h.traces(1);
    std::string got = all[0].size() == 1 ? name_of(all[0][0].context_) : "no entry";
    check("out of memory", got, when == RecordContext::STATE ? "-" : "r");
  }
  {
    // Memory given back during a free comes after the free's completion.
    History h;
    record(h, RecordContext::ALL);
    void* p = reinterpret_cast<void*>(0x4000);
    h.on_alloc(p, 64, 0, nullptr, named("a"));
    uint64_t seq = h.on_free_requested(p, 0, named("f"));
    h.on_event(TraceEntry::SEGMENT_UNMAP, 0, 0x4000, 2 << 20, nullptr, gpualloc_bridge::TracePool{0, 0});
    h.after_free(p, seq);
    check("a segment change during a free", entries(h), "alloc:a free_requested:f free_completed:f segment_unmap:-");
  }
  {
    // Stopping clears the rings, not the stacks of live blocks.
    History h;
    record(h, RecordContext::STATE);
    alloc_free_keep(h);
    h.configure(false, nullptr, 1000, RecordContext::NEVER, false, {});
    check("stopped: the rings are empty", entries(h), "");
    check("stopped: a live block keeps its stack", name_of(h.context_of(reinterpret_cast<void*>(0x2000))), "b");
    h.on_alloc(reinterpret_cast<void*>(0x5000), 64, 0, nullptr, nullptr);
    check("stopped: nothing is recorded", entries(h), "");
  }
  {
    // skip_actions by PyTorch's names; an unknown one raises PyTorch's error.
    using gpualloc_bridge::skip_action;
    expect(skip_action("free_completed") == TraceEntry::FREE_COMPLETED, "skip_action(free_completed)");
    expect(skip_action("segment_unmap") == TraceEntry::SEGMENT_UNMAP, "skip_action(segment_unmap)");
    expect(skip_action("oom") == TraceEntry::OOM, "skip_action(oom)");
    std::string err = "no error";
    try {
      skip_action("free");
    } catch (const c10::Error& e) {
      err = e.what_without_backtrace();
    }
    expect(err.find("Unknown TraceEntry action: free") != std::string::npos, "skip_action(free) raised: " + err);
    // Recording with a skipped action leaves it out.
    History h;
    h.configure(true, &recorder, 1000, RecordContext::ALL, true, {static_cast<int>(skip_action("free_requested"))});
    void* p = reinterpret_cast<void*>(0x6000);
    h.on_alloc(p, 64, 0, nullptr, named("a"));
    h.after_free(p, h.on_free_requested(p, 0, named("f")));
    check("free_requested skipped", entries(h), "alloc:a free_completed:f");
  }
  if (failures != 0) {
    std::printf("%d failed\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
