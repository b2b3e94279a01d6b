//! A streaming pickle writer restricted to what MemoryViz.js reads:
//! protocol 4, dict, list, tuple, int (< 2^63), float, str, bool, None.
//! No memo, no frames, no BINUNICODE8/BINBYTES/LONG4, no globals.

use std::io::{self, Write};

/// Items per APPENDS/SETITEMS batch, as Python's pickler does.
const BATCH: usize = 1000;

/// Writes one pickled object, container by container.
pub struct Pickler<W: Write> {
    w: W,
    /// Open containers: (is_list, items in the current batch).
    open: Vec<(bool, usize)>,
}

impl<W: Write> Pickler<W> {
    /// Starts a protocol-4 pickle.
    pub fn new(mut w: W) -> io::Result<Self> {
        w.write_all(&[0x80, 4])?;
        Ok(Pickler {
            w,
            open: Vec::new(),
        })
    }

    /// Opens a dict; write key, value, key, value..., then [`end`](Self::end).
    pub fn dict(&mut self) -> io::Result<()> {
        self.w.write_all(b"}(")?;
        self.open.push((false, 0));
        Ok(())
    }

    /// Opens a list; write items, then [`end`](Self::end).
    pub fn list(&mut self) -> io::Result<()> {
        self.w.write_all(b"](")?;
        self.open.push((true, 0));
        Ok(())
    }

    /// Closes the innermost dict or list.
    pub fn end(&mut self) -> io::Result<()> {
        let (is_list, _) = self.open.pop().expect("end without open");
        self.w.write_all(if is_list { b"e" } else { b"u" })?;
        self.item_done()
    }

    /// Counts a finished item of the enclosing container; starts a new batch when due.
    fn item_done(&mut self) -> io::Result<()> {
        if let Some((is_list, n)) = self.open.last_mut() {
            *n += 1;
            let limit = if *is_list { BATCH } else { 2 * BATCH };
            if *n == limit {
                *n = 0;
                let op: &[u8] = if *is_list { b"e(" } else { b"u(" };
                self.w.write_all(op)?;
            }
        }
        Ok(())
    }

    /// An integer; values above `i64::MAX` are written as `i64::MAX`.
    pub fn int(&mut self, v: u64) -> io::Result<()> {
        self.sint(i64::try_from(v).unwrap_or(i64::MAX))
    }

    /// A signed integer.
    pub fn sint(&mut self, v: i64) -> io::Result<()> {
        if (0..256).contains(&v) {
            self.w.write_all(&[b'K', v as u8])?;
        } else if (0..65536).contains(&v) {
            self.w.write_all(b"M")?;
            self.w.write_all(&(v as u16).to_le_bytes())?;
        } else if let Ok(x) = i32::try_from(v) {
            self.w.write_all(b"J")?;
            self.w.write_all(&x.to_le_bytes())?;
        } else {
            let bytes = v.to_le_bytes();
            let mut n = 8;
            // Minimal two's complement: drop redundant sign bytes.
            while n > 1
                && ((bytes[n - 1] == 0 && bytes[n - 2] < 0x80)
                    || (bytes[n - 1] == 0xff && bytes[n - 2] >= 0x80))
            {
                n -= 1;
            }
            self.w.write_all(&[0x8a, n as u8])?;
            self.w.write_all(&bytes[..n])?;
        }
        self.item_done()
    }

    /// A string.
    pub fn str(&mut self, s: &str) -> io::Result<()> {
        if s.len() < 256 {
            self.w.write_all(&[0x8c, s.len() as u8])?;
        } else {
            self.w.write_all(b"X")?;
            self.w.write_all(&(s.len() as u32).to_le_bytes())?;
        }
        self.w.write_all(s.as_bytes())?;
        self.item_done()
    }

    /// A bool.
    pub fn bool(&mut self, b: bool) -> io::Result<()> {
        self.w.write_all(&[if b { 0x88 } else { 0x89 }])?;
        self.item_done()
    }

    /// A tuple of two integers.
    pub fn int_pair(&mut self, a: u64, b: u64) -> io::Result<()> {
        self.open.push((true, 0)); // Items inside a tuple are not batched.
        self.int(a)?;
        self.int(b)?;
        self.open.pop();
        self.w.write_all(&[0x86])?;
        self.item_done()
    }

    /// `key: int` inside a dict.
    pub fn kv_int(&mut self, k: &str, v: u64) -> io::Result<()> {
        self.str(k)?;
        self.int(v)
    }

    /// `key: str` inside a dict.
    pub fn kv_str(&mut self, k: &str, v: &str) -> io::Result<()> {
        self.str(k)?;
        self.str(v)
    }

    /// Ends the pickle and returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        assert!(self.open.is_empty(), "unclosed containers");
        self.w.write_all(b".")?;
        self.w.flush()?;
        Ok(self.w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::unpickle::loads;

    #[test]
    fn writes_what_the_reader_reads() {
        let mut p = Pickler::new(Vec::new()).unwrap();
        p.dict().unwrap();
        p.kv_int("small", 7).unwrap();
        p.kv_int("addr", 0x7f00_0000_0000).unwrap();
        p.str("neg").unwrap();
        p.sint(-70000).unwrap();
        p.str("list").unwrap();
        p.list().unwrap();
        for i in 0..2500 {
            p.int(i).unwrap();
        }
        p.end().unwrap();
        p.str("pool").unwrap();
        p.int_pair(0, 0).unwrap();
        p.str("t").unwrap();
        p.bool(true).unwrap();
        p.kv_str("long", &"x".repeat(300)).unwrap();
        p.end().unwrap();
        let bytes = p.finish().unwrap();
        let v = loads(&bytes).unwrap();
        assert_eq!(v.get("small").and_then(|x| x.as_int()), Some(7));
        assert_eq!(
            v.get("addr").and_then(|x| x.as_int()),
            Some(0x7f00_0000_0000)
        );
        assert_eq!(v.get("neg").and_then(|x| x.as_int()), Some(-70000));
        assert_eq!(v.get("list").map(|l| l.items().len()), Some(2500));
        assert_eq!(v.get("list").unwrap().items()[2499].as_int(), Some(2499));
        assert_eq!(v.get("pool").map(|t| t.items().len()), Some(2));
        assert_eq!(
            v.get("long").and_then(|s| s.as_str().map(str::len)),
            Some(300)
        );
    }
}
