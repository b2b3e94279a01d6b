//! Stream handles that every device shares, told apart by device.
//!
//! Note [Streams of other devices]
//! A `cudaStream_t` names one stream of one device, except the handles
//! every device has: the legacy default stream (handle 0, and
//! `CU_STREAM_LEGACY`, handle 1) and the per-thread default stream
//! (`CU_STREAM_PER_THREAD`, handle 2). With the handle alone,
//! `t.record_stream(torch.cuda.default_stream(1))` for a tensor of device 0
//! reads as device 0's own default stream: ignored when
//! the block was allocated there, or an event recorded on device 0's
//! default stream, so the block could be reused while device 1 still
//! reads it. PyTorch records on the stream's own device. So a shared
//! handle of another device is keyed as [`stream_on_device`] builds it
//! (the top bit set, then the device, then the handle), which no real
//! stream handle (a user-space address) can equal; the CUDA backend
//! records, waits and asks about captures in that device's context. Other
//! streams of other devices keep their handle, which is unique: the
//! backend finds their context from the stream.

use super::StreamId;

/// The handles that every device shares: 0 (legacy default), 1
/// (`CU_STREAM_LEGACY`), 2 (`CU_STREAM_PER_THREAD`).
pub const SHARED_STREAM_HANDLES: u64 = 3;

const OTHER_DEVICE: u64 = 1 << 63;

/// How a device's allocator keys `stream` of device `stream_device`
/// (Note [Streams of other devices]): the handle itself, unless it is a
/// shared handle of another device than `own`.
pub const fn stream_on_device(stream: StreamId, stream_device: u32, own: u32) -> StreamId {
    if stream_device == own || stream >= SHARED_STREAM_HANDLES {
        stream
    } else {
        OTHER_DEVICE | ((stream_device as u64) << 8) | stream
    }
}

/// `(device, shared handle)` for a key [`stream_on_device`] built for a
/// shared handle of another device; None for any other stream.
pub const fn other_device_stream(id: StreamId) -> Option<(u32, StreamId)> {
    if id & OTHER_DEVICE != 0 && id & 0xff < SHARED_STREAM_HANDLES {
        Some((((id & !OTHER_DEVICE) >> 8) as u32, id & 0xff))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_shared_handles_of_other_devices_are_keyed_apart() {
        assert_eq!(stream_on_device(0, 0, 0), 0, "own default stream");
        assert_eq!(stream_on_device(0x7f00_1234_5000, 1, 0), 0x7f00_1234_5000);
        for h in 0..SHARED_STREAM_HANDLES {
            for d in [1, 7, 255, 4096] {
                let k = stream_on_device(h, d, 0);
                assert!(k >= SHARED_STREAM_HANDLES && k != h);
                assert_eq!(other_device_stream(k), Some((d, h)));
            }
        }
        assert_ne!(stream_on_device(0, 1, 0), stream_on_device(0, 2, 0));
        assert_ne!(stream_on_device(0, 1, 0), stream_on_device(2, 1, 0));
        assert_eq!(other_device_stream(0), None);
        assert_eq!(other_device_stream(0x7f00_1234_5000), None);
    }
}
