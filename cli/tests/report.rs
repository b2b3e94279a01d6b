//! `gpualloc report` on a trace recorded here with a checkpoint save, step
//! marks and a fragmentation OOM: the page names the cause and the
//! configuration that avoids it, backed by replays.

use std::path::Path;
use std::process::Command;

use gpualloc::trace::TraceOptions;
use gpualloc::{Allocator, Config, SimBackend};

const MIB: u64 = 1 << 20;

/// PyTorch's rules on a 1 GiB device: 4 MiB blocks fill 20 MiB segments, one
/// block in five stays, so 100 MiB cannot be found in ~800 MiB of cache.
fn record(path: &Path) {
    let a = Allocator::new(
        Config::parse("policy:pytorch").unwrap(),
        1,
        Box::new(|_| Ok(SimBackend::new(1 << 30).with_wall_clock())),
    );
    a.trace_start_with(
        path,
        TraceOptions {
            lossless: true,
            ..TraceOptions::default()
        },
    )
    .unwrap();
    let weights = a.malloc(0, 8 * MIB, 0).unwrap();
    for _ in 0..4 {
        a.phase_push("forward").unwrap();
        let act = a.malloc(0, 30 * MIB, 0).unwrap();
        a.free(0, act).unwrap();
        a.phase_pop();
        a.phase_push("checkpoint_save").unwrap();
        let copy = a.malloc(0, 16 * MIB, 0).unwrap();
        a.free(0, copy).unwrap();
        a.phase_pop();
        a.mark("step").unwrap();
    }
    a.empty_cache().unwrap();
    a.phase_push("forward").unwrap();
    let blocks: Vec<_> = (0..49 * 5)
        .map(|_| a.malloc(0, 4 * MIB, 0).unwrap())
        .collect();
    for (k, p) in blocks.into_iter().enumerate() {
        if k % 5 != 0 {
            a.free(0, p).unwrap();
        }
    }
    assert!(a.malloc(0, 100 * MIB, 0).is_err(), "the scenario must OOM");
    a.phase_pop();
    a.free(0, weights).unwrap();
    a.trace_stop().unwrap();
}

/// `gpualloc report TRACE -o HTML`; the page.
fn report(trace: &Path, html: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpualloc"))
        .args([
            "report",
            trace.to_str().unwrap(),
            "-o",
            html.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(html).unwrap()
}

#[test]
fn report_explains_an_oom_and_replays_the_remedy() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, html) = (dir.path().join("t.gtrace"), dir.path().join("t.html"));
    record(&trace);
    let page = report(&trace, &html);
    for want in [
        "cached but the largest free range is",
        "for a request of 100.00 MiB: fragmentation.",
        "Configurations replayed on a simulated device of",
        "<code>policy:pytorch (the trace's configuration)</code></td><td>1</td>",
        "Use <code>GPUALLOC_CONF=",
        "the replay has no OOM",
        "Replayed under the recorded configuration, the same request fails with",
        // Recorded by today's allocator: the replay keeps to it.
        "Until then it obtained the memory the recording did, allocation by allocation.",
        "Checkpoint save <code>checkpoint_save</code>: opened 4 time(s); allocated memory grew by up to 16.00 MiB",
    ] {
        assert!(page.contains(want), "report lacks {want:?}");
    }
    let start = page.find("id=\"gpualloc-data\">").unwrap() + "id=\"gpualloc-data\">".len();
    let end = start + page[start..].find("</script>").unwrap();
    let data: serde_json::Value = serde_json::from_str(&page[start..end]).unwrap();
    let dev = &data["devices"][0];
    let oom = dev["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["kind"] == "oom")
        .expect("a layout at the OOM");
    assert_eq!(
        oom["blocks_total"].as_u64(),
        Some(49 + 1),
        "one block in five, and the weights"
    );
    assert_eq!(dev["steps"].as_array().unwrap().len(), 5, "four marks");
    let names = data["names"].as_array().unwrap();
    let spans = dev["spans"].as_array().unwrap();
    assert_eq!(spans.len(), 4, "the checkpoint saves, shaded on the chart");
    assert!(
        spans
            .iter()
            .all(|s| names[s[0].as_u64().unwrap() as usize] == "checkpoint_save")
    );
}

/// The recorded OOM of `examples/yolo-style-oom.gtrace` (expandable
/// segments under a memory limit): the trace shows a free range larger
/// than the request, so the page says that memory was not the allocator's
/// to take, and what the replay found (this build's policy, which left the
/// recording's choices before the request, avoids it), never "together
/// enough, but neither alone" (the cache alone held enough), nor memory
/// the trace does not show.
#[test]
fn an_oom_beside_a_free_range_that_fits_is_not_called_a_split_cache() {
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("yolo.html");
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/yolo-style-oom.gtrace"
    );
    let page = report(Path::new(trace), &html);
    assert!(!page.contains("neither alone"));
    for want in [
        "yet the request of 30.25 MiB failed: that memory was not the allocator",
        "the memory limit left 14.00 MiB",
        "Replayed under the recorded configuration, the run does not fail",
        "and avoids the OOM",
        "this build's policy avoids the OOM in replay",
    ] {
        assert!(page.contains(want), "report lacks {want:?}");
    }
    assert!(!page.contains("memory the trace does not show"));
}

/// The README's trace was recorded by an older version: its replay reaches
/// the same failed request by another path, and the report says from when.
#[test]
fn report_says_where_the_replay_left_the_recordings_path() {
    let dir = tempfile::tempdir().unwrap();
    let trace = std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/yolo-style-oom.gtrace"
    ));
    let page = report(&trace, &dir.path().join("r.html"));
    assert!(
        // On the trace's clock, as `replay` and `summary` give it (and the
        // OOM beside it: 13.103 s), not from the device's first event,
        // 460.7 ms later (6.586 s, 12.642 s).
        page.contains("the replay obtained the memory the recording did until 7.223 s"),
        "report lacks the departure, or gives it on another clock than the OOM's"
    );
    assert!(
        page.contains("<b>At 13.103 s</b>"),
        "the OOM on the trace's clock"
    );
    // The trace names the build that recorded it (no commit then); so
    // does this one, when built from a git checkout.
    let this = gpualloc::trace::producer();
    let cause = if this == "gpualloc 0.1.0" {
        "a trace recorded by another version".to_string()
    } else {
        format!("the trace was recorded by gpualloc 0.1.0, this is {this}")
    };
    assert!(page.contains(&cause), "report lacks {cause:?}");
}
