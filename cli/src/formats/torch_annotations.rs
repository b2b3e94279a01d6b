//! A snapshot's `external_annotations` (PyTorch's `record_function` ranges,
//! `{name, stage, device, time_us}`) as phases and marks.
//!
//! `export --torch-snapshot` writes a trace's phases and marks there, with
//! two keys of its own that PyTorch's tools ignore: `gpualloc_position`,
//! the number of the device's `device_traces` entries before it (times are
//! whole microseconds, so a phase that ends in the microsecond of its last
//! allocation would otherwise come back before it), and `gpualloc_mark` on
//! the `START` and `END` of a mark. Without them (a snapshot PyTorch
//! wrote), a `START` goes before the entries of its microsecond and an
//! `END` after them. Ranges become phases when they nest, with one stack
//! per device as a trace's phases have; an `END` that closes no open range
//! (one that began before the recording, or another thread's that ended
//! out of order) is left out and counted. A range still open at the end
//! stays open, as an unfinished phase does.

use crate::formats::unpickle::Value;

/// A phase or mark of one device, by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Annotation {
    /// A range began.
    Push(String),
    /// The innermost range ended.
    Pop(String),
    /// A point in time.
    Mark(String),
}

/// Where an annotation goes among its device's `device_traces` entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Place {
    /// Microseconds since the Unix epoch, as the snapshot gives them.
    pub time_us: i64,
    /// Entries of the device before it, when the export said so.
    pub position: Option<u64>,
}

impl Place {
    /// Whether the annotation comes before entry number `index`, at
    /// `time_us` (`None`: the entry has no time): by position when known;
    /// otherwise by time, a `START` before the entries of its microsecond
    /// and an `END` or mark after, and never before an entry without a
    /// time. Annotations keep their own order, so a `START` that follows an
    /// `END` of its microsecond comes after that microsecond's entries too.
    pub fn before(&self, a: &Annotation, index: u64, time_us: Option<i64>) -> bool {
        match (self.position, time_us) {
            (Some(p), _) => p <= index,
            (None, Some(t)) => {
                self.time_us < t || (self.time_us == t && matches!(a, Annotation::Push(_)))
            }
            (None, None) => false,
        }
    }
}

/// The annotations of device `device`, in order, with the number of
/// entries left out (no name, stage or time, or an `END` that closes no
/// open range).
pub(crate) fn for_device(root: &Value, device: i64) -> (Vec<(Place, Annotation)>, u64) {
    let mut raw: Vec<(Place, bool, bool, String)> = Vec::new();
    let mut left_out = 0u64;
    for a in list(root) {
        if a.get("device").and_then(|d| d.as_int()).unwrap_or(0) != device {
            continue;
        }
        let name = a.get("name").and_then(|n| n.as_str().map(String::from));
        let stage = a.get("stage").and_then(|s| s.as_str().map(String::from));
        let time = a.get("time_us").and_then(|t| t.as_int());
        let position = a
            .get("gpualloc_position")
            .and_then(|p| p.as_int())
            .map(|p| p.max(0) as u64);
        let mark = a
            .get("gpualloc_mark")
            .and_then(|m| m.as_int())
            .is_some_and(|m| m != 0);
        let start = match stage.as_deref() {
            Some("START") => true,
            Some("END") => false,
            _ => {
                left_out += 1;
                continue;
            }
        };
        match (name, time) {
            (Some(n), Some(time_us)) => raw.push((Place { time_us, position }, start, mark, n)),
            _ => left_out += 1,
        }
    }
    // Stable: the list's order stands where they tie. By position when
    // any has one (the export gives all of them one), else by time.
    if raw.iter().any(|(p, ..)| p.position.is_some()) {
        raw.sort_by_key(|(p, ..)| p.position.unwrap_or(u64::MAX));
    } else {
        raw.sort_by_key(|(p, ..)| p.time_us);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut open: Vec<String> = Vec::new();
    for (place, start, mark, name) in raw {
        if mark {
            // A mark's START stands for it; its END adds nothing.
            if start {
                out.push((place, Annotation::Mark(name)));
            }
        } else if start {
            open.push(name.clone());
            out.push((place, Annotation::Push(name)));
        } else if open.last() == Some(&name) {
            open.pop();
            out.push((place, Annotation::Pop(name)));
        } else {
            left_out += 1;
        }
    }
    (out, left_out)
}

/// The earliest annotation time, if any has one.
pub(crate) fn earliest_us(root: &Value) -> Option<i64> {
    list(root)
        .iter()
        .filter_map(|a| a.get("time_us").and_then(|t| t.as_int()))
        .min()
}

/// Annotations naming no device in `0..devices`: none of the imported
/// devices takes them.
pub(crate) fn outside(root: &Value, devices: usize) -> u64 {
    list(root)
        .iter()
        .filter(|a| {
            let d = a.get("device").and_then(|d| d.as_int()).unwrap_or(0);
            d < 0 || d as u64 >= devices as u64
        })
        .count() as u64
}

fn list(root: &Value) -> Vec<Value> {
    root.get("external_annotations")
        .map(|l| l.items())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::pickle::Pickler;
    use crate::formats::unpickle;

    /// `(name, stage, device, time_us, gpualloc_position, gpualloc_mark)`.
    type Entry<'a> = (&'a str, &'a str, u64, u64, Option<u64>, bool);

    fn snapshot(entries: &[Entry]) -> Value {
        let mut p = Pickler::new(Vec::new()).unwrap();
        p.dict().unwrap();
        p.str("external_annotations").unwrap();
        p.list().unwrap();
        for &(name, stage, device, t, position, mark) in entries {
            p.dict().unwrap();
            p.kv_str("name", name).unwrap();
            p.kv_str("stage", stage).unwrap();
            p.kv_int("device", device).unwrap();
            p.kv_int("time_us", t).unwrap();
            if let Some(n) = position {
                p.kv_int("gpualloc_position", n).unwrap();
            }
            if mark {
                p.str("gpualloc_mark").unwrap();
                p.bool(true).unwrap();
            }
            p.end().unwrap();
        }
        p.end().unwrap();
        p.end().unwrap();
        unpickle::loads(&p.finish().unwrap()).unwrap()
    }

    fn names(got: &[(Place, Annotation)]) -> Vec<Annotation> {
        got.iter().map(|(_, a)| a.clone()).collect()
    }

    #[test]
    fn marks_phases_and_what_is_left_out() {
        use Annotation::*;
        let root = snapshot(&[
            ("fwd", "START", 0, 10, None, false),
            ("step", "START", 0, 15, None, true),
            ("step", "END", 0, 15, None, true),
            ("empty range", "START", 0, 16, None, false),
            ("empty range", "END", 0, 16, None, false),
            ("other device", "START", 1, 12, None, false),
            ("fwd", "END", 0, 20, None, false),
            ("never opened", "END", 0, 25, None, false),
            ("open at the end", "START", 0, 30, None, false),
            ("no stage", "BEGIN", 0, 31, None, false),
            ("other device", "START", 4, 12, None, false),
        ]);
        let (got, left_out) = for_device(&root, 0);
        let want = vec![
            Push("fwd".into()),
            Mark("step".into()),
            Push("empty range".into()),
            Pop("empty range".into()),
            Pop("fwd".into()),
            Push("open at the end".into()),
        ];
        assert_eq!(names(&got), want);
        assert_eq!(left_out, 2);
        let (got, left_out) = for_device(&root, 1);
        assert_eq!(names(&got), vec![Push("other device".into())]);
        assert_eq!(left_out, 0);
        assert_eq!(outside(&root, 2), 1);
        assert_eq!(earliest_us(&root), Some(10));
    }

    #[test]
    fn ranges_out_of_order_are_left_out_not_misnested() {
        let root = snapshot(&[
            ("a", "START", 0, 1, None, false),
            ("b", "START", 0, 2, None, false),
            ("a", "END", 0, 3, None, false),
            ("b", "END", 0, 4, None, false),
        ]);
        let (got, left_out) = for_device(&root, 0);
        assert_eq!(left_out, 1, "{got:?}");
        assert_eq!(got.last().map(|g| &g.1), Some(&Annotation::Pop("b".into())));
    }

    #[test]
    fn a_position_places_an_annotation_where_its_time_cannot() {
        let (push, pop) = (Annotation::Push("p".into()), Annotation::Pop("p".into()));
        let at = |position| Place {
            time_us: 7,
            position,
        };
        // Entry 3 at the same microsecond: by time a START goes before it
        // and an END after; a position says exactly.
        assert!(at(None).before(&push, 3, Some(7)));
        assert!(!at(None).before(&pop, 3, Some(7)));
        assert!(at(None).before(&pop, 3, Some(8)));
        assert!(at(Some(3)).before(&pop, 3, Some(7)));
        assert!(!at(Some(4)).before(&push, 3, Some(7)));
        assert!(
            !at(None).before(&push, 3, None),
            "an untimed entry places nothing"
        );
        assert!(at(Some(3)).before(&push, 3, None));
    }
}
