//! Commands that are more than a format or a single analysis: the text and
//! JSON summary, two traces side by side, the replay of a trace under other
//! configurations, the HTML report, and a synthetic trace for trying them.

pub(crate) mod diff;
pub(crate) mod generate;
pub(crate) mod min_limit;
pub(crate) mod replay;
pub(crate) mod report;
pub(crate) mod summary;
