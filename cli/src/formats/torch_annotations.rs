//! A snapshot's `external_annotations` (PyTorch's `record_function` ranges,
//! `{name, stage, device, time_us}`) as phases and marks.
//!
//! A `START` and an `END` of one name at one time, on one device, are a
//! mark: how `export --torch-snapshot` writes one, so that a trace survives
//! the round trip. Other ranges become phases when they nest, with one
//! stack per device as a trace's phases have; an `END` that closes no open
//! range (a range that began before the recording, or one of another
//! thread that ended out of order) is left out and counted. A range still
//! open at the end stays open, as an unfinished phase does.

use crate::formats::unpickle::Value;

/// A phase or mark of one device, by name, at `time_us`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Annotation {
    /// A range began.
    Push(String),
    /// The innermost range ended.
    Pop(String),
    /// A point in time.
    Mark(String),
}

/// The annotations of device `device`, in time order, with the number of
/// entries left out (no name, stage or time, or an `END` that closes
/// nothing open).
pub(crate) fn for_device(root: &Value, device: i64) -> (Vec<(i64, Annotation)>, u64) {
    let mut raw: Vec<(i64, bool, String)> = Vec::new();
    let mut left_out = 0u64;
    let list = root
        .get("external_annotations")
        .map(|l| l.items())
        .unwrap_or_default();
    for a in list {
        if a.get("device").and_then(|d| d.as_int()).unwrap_or(0) != device {
            continue;
        }
        let name = a.get("name").and_then(|n| n.as_str().map(String::from));
        let stage = a.get("stage").and_then(|s| s.as_str().map(String::from));
        let time = a.get("time_us").and_then(|t| t.as_int());
        match (name, stage.as_deref(), time) {
            (Some(n), Some("START"), Some(t)) => raw.push((t, true, n)),
            (Some(n), Some("END"), Some(t)) => raw.push((t, false, n)),
            _ => left_out += 1,
        }
    }
    raw.sort_by_key(|&(t, _, _)| t); // stable: a mark's START stays first
    let mut out = Vec::with_capacity(raw.len());
    let mut open: Vec<String> = Vec::new();
    let mut i = 0;
    while i < raw.len() {
        let (t, start, ref name) = raw[i];
        let next = raw.get(i + 1);
        if start && next.is_some_and(|(t2, s2, n2)| *t2 == t && !s2 && n2 == name) {
            out.push((t, Annotation::Mark(name.clone())));
            i += 2;
            continue;
        }
        if start {
            open.push(name.clone());
            out.push((t, Annotation::Push(name.clone())));
        } else if open.last() == Some(name) {
            open.pop();
            out.push((t, Annotation::Pop(name.clone())));
        } else {
            left_out += 1;
        }
        i += 1;
    }
    (out, left_out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::pickle::Pickler;
    use crate::formats::unpickle;

    fn snapshot(entries: &[(&str, &str, u64, u64)]) -> Value {
        let mut p = Pickler::new(Vec::new()).unwrap();
        p.dict().unwrap();
        p.str("external_annotations").unwrap();
        p.list().unwrap();
        for &(name, stage, device, t) in entries {
            p.dict().unwrap();
            p.kv_str("name", name).unwrap();
            p.kv_str("stage", stage).unwrap();
            p.kv_int("device", device).unwrap();
            p.kv_int("time_us", t).unwrap();
            p.end().unwrap();
        }
        p.end().unwrap();
        p.end().unwrap();
        unpickle::loads(&p.finish().unwrap()).unwrap()
    }

    #[test]
    fn marks_phases_and_what_is_left_out() {
        use Annotation::*;
        let root = snapshot(&[
            ("fwd", "START", 0, 10),
            ("step", "START", 0, 15),
            ("step", "END", 0, 15),
            ("other device", "START", 1, 12),
            ("fwd", "END", 0, 20),
            ("never opened", "END", 0, 25),
            ("open at the end", "START", 0, 30),
        ]);
        let (got, left_out) = for_device(&root, 0);
        let want = vec![
            (10, Push("fwd".into())),
            (15, Mark("step".into())),
            (20, Pop("fwd".into())),
            (30, Push("open at the end".into())),
        ];
        assert_eq!(got, want);
        assert_eq!(left_out, 1);
        let (got, left_out) = for_device(&root, 1);
        assert_eq!(got, vec![(12, Push("other device".into()))]);
        assert_eq!(left_out, 0);
    }

    #[test]
    fn ranges_out_of_order_are_left_out_not_misnested() {
        let root = snapshot(&[
            ("a", "START", 0, 1),
            ("b", "START", 0, 2),
            ("a", "END", 0, 3),
            ("b", "END", 0, 4),
        ]);
        let (got, left_out) = for_device(&root, 0);
        assert_eq!(left_out, 1, "{got:?}");
        assert_eq!(
            got.last(),
            Some(&(4, Annotation::Pop("b".into()))),
            "{got:?}"
        );
    }
}
