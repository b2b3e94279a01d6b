//! Lines of a text log, each read with a bound: a damaged or foreign input
//! (a line of gigabytes, `/dev/zero` on a pipe) is refused at the line that
//! passes the bound, having read no more of it than the bound, instead of
//! being read whole into memory.

use std::io::{BufRead, Read};

/// The longest line, in bytes without its end (`\n` or `\r\n`). An RMM
/// log's lines have tens of bytes.
pub const MAX_LINE: usize = 64 << 10;

/// The lines of `src`, numbered from 1.
pub struct Lines<R> {
    src: R,
    /// The number of the last line read.
    number: u64,
    buf: Vec<u8>,
}

impl<R: BufRead> Lines<R> {
    pub fn new(src: R) -> Lines<R> {
        Lines {
            src,
            number: 0,
            buf: Vec::new(),
        }
    }

    /// The next line's number and bytes, without its end; `None` at the
    /// end of the input. An error (`line N: ...`) for a failed read or a
    /// line above [`MAX_LINE`], of which at most `MAX_LINE + 2` bytes are
    /// read (the rest is left: stop reading at an error).
    pub fn next_bytes(&mut self) -> Option<Result<(u64, &[u8]), String>> {
        self.buf.clear();
        let limit = MAX_LINE as u64 + 2; // room for `\r\n`
        let n = self.number + 1;
        match (&mut self.src).take(limit).read_until(b'\n', &mut self.buf) {
            Ok(0) => return None,
            Ok(_) => self.number = n,
            Err(e) => return Some(Err(format!("line {n}: {e}"))),
        }
        let mut line = &self.buf[..];
        if let Some(l) = line.strip_suffix(b"\n") {
            line = l.strip_suffix(b"\r").unwrap_or(l);
        }
        if line.len() > MAX_LINE {
            return Some(Err(format!(
                "line {n}: longer than {MAX_LINE} bytes, the limit of a line (64 KiB)"
            )));
        }
        Some(Ok((n, line)))
    }

    /// [`Lines::next_bytes`] as text; an error for a line not in UTF-8.
    pub fn next_str(&mut self) -> Option<Result<(u64, &str), String>> {
        Some(self.next_bytes()?.and_then(|(n, b)| {
            std::str::from_utf8(b)
                .map(|s| (n, s))
                .map_err(|e| format!("line {n}: not UTF-8 text ({e})"))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_end_at_a_newline_and_are_bounded() {
        let long = "x".repeat(MAX_LINE);
        let text = format!("a\r\nb\n{long}\r\n{long}\n{long}y\nz");
        let mut lines = Lines::new(text.as_bytes());
        let mut next = || lines.next_str().map(|r| r.map(|(n, s)| (n, s.len())));
        assert_eq!(next(), Some(Ok((1, 1))));
        assert_eq!(next(), Some(Ok((2, 1))));
        assert_eq!(next(), Some(Ok((3, MAX_LINE))));
        assert_eq!(next(), Some(Ok((4, MAX_LINE))));
        let err = next().unwrap().unwrap_err();
        assert!(err.starts_with("line 5: longer than 65536 bytes"), "{err}");
        let mut lines = Lines::new(&b"\xff\n"[..]);
        assert!(lines.next_str().unwrap().is_err());
        assert!(lines.next_str().is_none());
    }
}
