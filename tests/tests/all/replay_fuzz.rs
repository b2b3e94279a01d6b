//! The replay takes any sequence of records without panicking: `gpualloc
//! replay` reads traces it did not write (damaged, imported, or from
//! another version), and a record is decoded whatever its bits
//! (Note [Typed trace events]). Private-pool calls with any operands, frees
//! of unknown blocks, restores of checkpoints never taken, segments that
//! overlap: each is applied as far as it makes sense.

use gpualloc::Config;
use gpualloc::replay::replay;
use gpualloc::trace::{Action, TraceEvent};
use proptest::prelude::*;

/// One record: an action, and operands drawn from small sets so that
/// addresses, pools and checkpoints collide often.
fn record() -> impl Strategy<Value = TraceEvent> {
    (
        0..Action::ALL.len(),
        0u64..4,
        0u64..24,
        prop_oneof![0u64..8, 1u64..(64 << 20), Just(u64::MAX)],
        prop_oneof![0u64..8, 1u64..(64 << 20), Just(u64::MAX)],
        0u64..1000,
    )
        .prop_map(|(a, stream, slot, size, aux, t)| TraceEvent {
            time_ns: t,
            action: Action::ALL[a],
            device: 0,
            stream,
            addr: slot << 26,
            size,
            aux,
            thread: 1,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: gpualloc_tests::cases(256), ..ProptestConfig::default() })]

    #[test]
    fn any_records_replay_without_panicking(
        evs in prop::collection::vec(record(), 0..300),
        plain in any::<bool>(),
    ) {
        let conf = if plain { "expandable_segments:false" } else { "" };
        let r = replay(evs.into_iter(), 2 << 30, &Config::parse(conf).unwrap());
        prop_assert!(r.peak_allocated <= r.peak_reserved || r.peak_reserved == 0);
    }
}
