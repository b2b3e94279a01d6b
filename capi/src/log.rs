//! The stderr logger for `GPUALLOC_LOG=info|debug` (`gpualloc::log` lists
//! the events). Off by default: no logger is installed, so every event costs
//! one atomic load.

use std::sync::Once;

/// Installs the stderr logger once, when `GPUALLOC_LOG` asks for one. A bad
/// value is reported on stderr and logging stays off: it must not stop the
/// program. Another global `tracing` subscriber already set wins.
pub(crate) fn init_from_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| match gpualloc::log::level_from_env() {
        Ok(Some(level)) => {
            let _ = tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .with_max_level(level)
                .with_ansi(false)
                .with_target(false)
                .try_init();
        }
        Ok(None) => {}
        Err(e) => eprintln!("gpualloc: {e}; logging stays off"),
    });
}
