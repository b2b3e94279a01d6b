//! The allocation trace: vocabulary, recorder, file format.

mod event;
pub mod recorder;

pub use event::{Action, TraceEvent, pool_code};
pub use recorder::DeviceTrace;
