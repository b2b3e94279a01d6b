//! The bytes of a shared expandable allocation, as `shareIpcHandle` returns
//! them and `getIpcDevPtr` reads them.
//!
//! Two formats, both behind PyTorch's version byte (2):
//! - `'e'`, PyTorch's own for expandable segments: the sender's pid, one
//!   handle size, the handle count, then one descriptor number per handle.
//!   Used whenever every handle under the block has the same size, so that
//!   a receiver under PyTorch's allocator opens it too.
//! - `'g'`, gpualloc's: the pid and a count, then a descriptor number and a
//!   size per handle, for blocks over handles of several sizes (the page
//!   pool makes them). Only a receiver under gpualloc opens it; PyTorch's
//!   rejects the type.
//!
//! Integers are little-endian; PyTorch's header is the C struct
//! `{pid_t pid; size_t segment_size; size_t num_handles;}` (4 bytes of
//! padding after the pid).

/// PyTorch's shareable-handle version byte.
pub(crate) const VERSION: u8 = 2;
/// PyTorch's type byte for an expandable segment.
pub(crate) const TYPE_EXPANDABLE: u8 = b'e';
/// gpualloc's type byte for handles of several sizes.
pub(crate) const TYPE_GPUALLOC: u8 = b'g';

/// The most handles one share may name (a 2 MiB page each: 2 TiB).
const MAX_HANDLES: u64 = 1 << 20;

/// A decoded share: whose descriptors, and the handles in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Shared {
    /// The sending process.
    pub pid: i32,
    /// `(descriptor number in the sender, bytes)` per handle.
    pub parts: Vec<(i32, u64)>,
}

/// Whether `bytes` is a share in one of the formats here (not a CUDA IPC
/// handle of a plain segment, type `'c'`).
pub(crate) fn is_expandable(bytes: &[u8]) -> bool {
    bytes.len() > 2
        && bytes[0] == VERSION
        && (bytes[1] == TYPE_EXPANDABLE || bytes[1] == TYPE_GPUALLOC)
}

/// Encodes a share: PyTorch's `'e'` when the handles are of one size.
pub(crate) fn encode(pid: i32, parts: &[(i32, u64)]) -> Vec<u8> {
    let mut out = vec![VERSION];
    let uniform = parts.windows(2).all(|w| w[0].1 == w[1].1);
    if uniform && let Some(&(_, size)) = parts.first() {
        out.push(TYPE_EXPANDABLE);
        out.extend_from_slice(&pid.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&size.to_le_bytes());
        out.extend_from_slice(&(parts.len() as u64).to_le_bytes());
        for &(fd, _) in parts {
            out.extend_from_slice(&fd.to_le_bytes());
        }
    } else {
        out.push(TYPE_GPUALLOC);
        out.extend_from_slice(&pid.to_le_bytes());
        out.extend_from_slice(&(parts.len() as u32).to_le_bytes());
        for &(fd, size) in parts {
            out.extend_from_slice(&fd.to_le_bytes());
            out.extend_from_slice(&[0; 4]);
            out.extend_from_slice(&size.to_le_bytes());
        }
    }
    out
}

/// Reads little-endian integers off the front of a byte slice.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        if self.0.len() < N {
            return Err(format!("the share ends inside {what}"));
        }
        let (head, rest) = self.0.split_at(N);
        self.0 = rest;
        Ok(head.try_into().expect("N bytes"))
    }
    fn i32(&mut self, what: &str) -> Result<i32, String> {
        self.take::<4>(what).map(i32::from_le_bytes)
    }
    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.take::<4>(what).map(u32::from_le_bytes)
    }
    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.take::<8>(what).map(u64::from_le_bytes)
    }
}

/// Decodes a share made by [`encode`] (or by PyTorch's expandable segments).
///
/// # Errors
/// A message naming what is wrong: another version or type, a length that
/// does not match the count, a zero or oversized handle.
pub(crate) fn decode(bytes: &[u8]) -> Result<Shared, String> {
    if !is_expandable(bytes) {
        return Err(format!(
            "not a share of expandable memory (version {:?}, type {:?}; expected {VERSION} and 'e' or 'g')",
            bytes.first(),
            bytes.get(1).map(|&b| b as char)
        ));
    }
    let mut r = Reader(&bytes[2..]);
    let pid = r.i32("the pid")?;
    let mut parts = Vec::new();
    if bytes[1] == TYPE_EXPANDABLE {
        r.take::<4>("the header's padding")?;
        let size = r.u64("the handle size")?;
        let n = r.u64("the handle count")?;
        if n > 0 && n <= MAX_HANDLES && r.0.len() as u64 == n * 64 {
            return Err(format!(
                "the share carries {n} fabric handles, which gpualloc does not import"
            ));
        }
        check_count(n, r.0.len() as u64, 4)?;
        for _ in 0..n {
            parts.push((r.i32("a descriptor")?, size));
        }
    } else {
        let n = u64::from(r.u32("the handle count")?);
        check_count(n, r.0.len() as u64, 16)?;
        for _ in 0..n {
            let fd = r.i32("a descriptor")?;
            r.take::<4>("a descriptor's padding")?;
            parts.push((fd, r.u64("a handle size")?));
        }
    }
    if pid <= 0 {
        return Err(format!("the share names no process (pid {pid})"));
    }
    if let Some(&(fd, size)) = parts.iter().find(|p| p.1 == 0 || p.1 > 1 << 40) {
        return Err(format!("descriptor {fd} has a handle size of {size} bytes"));
    }
    Ok(Shared { pid, parts })
}

fn check_count(n: u64, left: u64, each: u64) -> Result<(), String> {
    if n == 0 || n > MAX_HANDLES || n * each != left {
        return Err(format!(
            "the share names {n} handles but has {left} bytes for them ({each} each)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_handles_use_pytorchs_layout() {
        let b = encode(4321, &[(7, 2 << 20), (9, 2 << 20)]);
        // version, type, pid, 4 padding bytes, size, count, two descriptors:
        // the bytes of PyTorch's ShareHeader followed by ints.
        let mut want = vec![2, b'e'];
        want.extend_from_slice(&4321i32.to_le_bytes());
        want.extend_from_slice(&[0; 4]);
        want.extend_from_slice(&(2u64 << 20).to_le_bytes());
        want.extend_from_slice(&2u64.to_le_bytes());
        want.extend_from_slice(&7i32.to_le_bytes());
        want.extend_from_slice(&9i32.to_le_bytes());
        assert_eq!(b, want);
        assert_eq!(
            decode(&b).unwrap(),
            Shared {
                pid: 4321,
                parts: vec![(7, 2 << 20), (9, 2 << 20)]
            }
        );
    }

    #[test]
    fn mixed_sizes_round_trip_in_gpuallocs_layout() {
        let parts = vec![(3, 2 << 20), (4, 16 << 20), (5, 2 << 20)];
        let b = encode(99, &parts);
        assert_eq!(b[1], TYPE_GPUALLOC);
        assert_eq!(b.len(), 2 + 8 + 16 * 3);
        assert_eq!(decode(&b).unwrap(), Shared { pid: 99, parts });
    }

    #[test]
    fn damaged_shares_are_refused_with_the_reason() {
        let good = encode(99, &[(3, 2 << 20), (4, 16 << 20)]);
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(decode(&long).unwrap_err().contains("2 handles"));
        let cuda = [2u8, b'c', 0, 0];
        assert!(decode(&cuda).unwrap_err().contains("'c'"));
        assert!(!is_expandable(&cuda));
        let zero = encode(99, &[(3, 0)]);
        assert!(decode(&zero).unwrap_err().contains("0 bytes"));
        // PyTorch's shares of fabric handles: 64 bytes a handle.
        let mut fabric = encode(99, &[(3, 2 << 20), (4, 2 << 20)]);
        fabric.truncate(26);
        fabric.extend_from_slice(&[7; 128]);
        assert!(decode(&fabric).unwrap_err().contains("2 fabric handles"));
        let nobody = encode(0, &[(3, 2 << 20)]);
        assert!(decode(&nobody).unwrap_err().contains("pid 0"));
    }
}
