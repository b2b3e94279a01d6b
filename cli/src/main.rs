//! `gpualloc`: explains a recorded allocation trace offline.
//!
//! # The key decision: stream, never load
//!
//! A trace of a long training run holds hundreds of millions of events, so
//! no command loads one. Every command streams the file block by block (a
//! decoder thread feeds the analysis thread) and keeps only what its answer
//! needs: live blocks, reserved ranges, bounded timelines and tables. What
//! needs the position of the peak or the duration (the layout at the peak,
//! fragmentation over time) is computed by a second streaming pass, rather
//! than by keeping history in memory. Memory therefore follows the number of
//! live blocks, not the length of the trace.
//!
//! The modules go by role: `analyses` (one question each, answered from the
//! rebuilt allocator state), `formats` (exports and imports) and `commands`
//! (what formats or combines them: summary, diff, replay, report); `input`
//! reads traces for all of them.

mod analyses;
mod commands;
mod formats;
mod input;
mod units;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use crate::input::CliError;

#[derive(Parser)]
#[command(
    name = "gpualloc",
    version,
    about = "Inspect gpualloc allocation traces offline"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Events, duration, peaks, fragmentation at the peak, OOMs, phases, sizes.
    ///
    /// With several traces (one per rank of a job, e.g. written with
    /// GPUALLOC_TRACE=/path/trace-{rank}.gtrace): the ranks side by side
    /// (peak allocated and reserved, step times, OOMs), the rank with the
    /// highest peak and the ranks that ran out of memory, then each trace's
    /// summary. Ranks are labelled from the file names (trace-3.gtrace is
    /// rank 3), else by the names, else by position.
    Summary {
        /// One .gtrace file, or several (one per rank).
        #[arg(required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// Print one JSON object (stable field names) instead of the text.
        #[arg(long)]
        json: bool,
        /// Use the readable prefix of a truncated or damaged file.
        #[arg(long)]
        allow_truncated: bool,
    },
    /// One self-contained HTML file with charts (no network needed to view it).
    ///
    /// With several traces (one per rank): a table of the ranks at the top
    /// (peaks, step times, OOMs), then each rank's report in its own
    /// section, in the same file.
    Report {
        /// One .gtrace file, or several (one per rank).
        #[arg(required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// Output HTML file.
        #[arg(short, long)]
        output: PathBuf,
        /// Use the readable prefix of a truncated or damaged file.
        #[arg(long)]
        allow_truncated: bool,
    },
    /// Allocations alive at the end, grouped by size and phase, with their growth per iteration.
    Leaks {
        /// A .gtrace file.
        file: PathBuf,
        /// Groups to list per device (at least 1).
        #[arg(long, default_value_t = 30, allow_negative_numbers = true,
              value_parser = clap::value_parser!(u64).range(1..))]
        limit: u64,
        /// Print one JSON object (stable field names) instead of the table.
        #[arg(long)]
        json: bool,
        /// Use the readable prefix of a truncated or damaged file.
        #[arg(long)]
        allow_truncated: bool,
    },
    /// Replays the trace through gpualloc's policy on a simulated device.
    Replay {
        /// A .gtrace file.
        file: PathBuf,
        /// Simulated device capacity (e.g. 24GiB, 80G, 1073741824). Default:
        /// the memory of the device the trace was recorded on, where the
        /// trace tells it.
        // A leading `-` is a value (`-1GiB`), refused by the parser with
        // its name, not taken for flags.
        #[arg(long, allow_hyphen_values = true)]
        capacity: Option<String>,
        /// Allocator configuration (GPUALLOC_CONF syntax); repeat to compare
        /// several. Default: the configuration the trace was recorded with.
        #[arg(long)]
        config: Vec<String>,
        /// Print one JSON object per configuration (a JSON array) instead of the table.
        #[arg(long)]
        json: bool,
        /// Use the readable prefix of a truncated or damaged file.
        #[arg(long)]
        allow_truncated: bool,
        /// Also find, for each configuration, the smallest memory limit
        /// under which the replay has no OOM (replayed again about a dozen
        /// times; the configuration's own caps are replaced).
        #[arg(long)]
        min_limit: bool,
    },
    /// Writes the trace in other tools' formats.
    ///
    /// Several traces (one per rank) go to Parquet only, into a folder:
    /// `gpualloc export --parquet out/ run/trace-*.gtrace`.
    Export {
        /// A .gtrace file (several with --parquet FOLDER/).
        #[arg(required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// PyTorch memory snapshot pickle (opens in memory_viz).
        #[arg(long)]
        torch_snapshot: Option<PathBuf>,
        /// Chrome / Perfetto trace JSON.
        #[arg(long)]
        chrome: Option<PathBuf>,
        /// CSV with RMM's logging columns.
        #[arg(long)]
        csv: Option<PathBuf>,
        /// Parquet tables of events, segment lifetimes and phases/steps
        /// (for DuckDB, Polars, Spark): PREFIX.events.parquet,
        /// PREFIX.segments.parquet and PREFIX.phases.parquet; when PREFIX is
        /// a folder (or ends with /), the trace's name in that folder.
        #[arg(long, value_name = "PREFIX")]
        parquet: Option<PathBuf>,
        /// Use the readable prefix of a truncated or damaged file.
        #[arg(long)]
        allow_truncated: bool,
    },
    /// Converts a PyTorch memory snapshot or an RMM CSV log into a .gtrace file.
    Import {
        /// The snapshot pickle or CSV log.
        file: PathBuf,
        /// Output .gtrace file.
        #[arg(short, long)]
        output: PathBuf,
        /// Input format (default: from the file's first bytes).
        #[arg(long, value_enum, default_value_t = From::Auto)]
        from: From,
    },
    /// Peaks and fragmentation of two traces side by side.
    Diff {
        /// The first trace.
        a: PathBuf,
        /// The second trace.
        b: PathBuf,
        /// Print one JSON object (stable field names) instead of the table.
        #[arg(long)]
        json: bool,
        /// Use the readable prefix of truncated or damaged files.
        #[arg(long)]
        allow_truncated: bool,
    },
    /// Writes a synthetic trace by running the allocator on a simulated
    /// device (for benchmarks and demonstrations).
    Generate {
        /// Output .gtrace file.
        #[arg(short, long)]
        output: PathBuf,
        /// Approximate number of events, in whole training steps of a few hundred events each (0, a header only, to 10^10).
        #[arg(long, default_value_t = 1_000_000, allow_negative_numbers = true,
              value_parser = clap::value_parser!(u64).range(0..=10_000_000_000))]
        events: u64,
        /// Random seed.
        #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
        seed: u64,
    },
}

/// Formats `gpualloc import` reads.
#[derive(Clone, Copy, ValueEnum)]
enum From {
    /// Decide from the first bytes.
    Auto,
    /// `torch.cuda.memory._dump_snapshot` pickle.
    Torch,
    /// RMM `logging_resource_adaptor` CSV.
    Rmm,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `GPUALLOC_LOG=info|debug`: the allocator's decisions during `replay`
    // and `generate`, on stderr.
    gpualloc::log::install_from_env();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpualloc: {e}");
            ExitCode::FAILURE
        }
    }
}

fn warn(w: &Option<String>) {
    if let Some(w) = w {
        input::warn_once(w, w);
    }
}

/// The smallest and largest `replay --capacity`.
const CAPACITY_RANGE: (u64, u64) = (1 << 20, gpualloc::config::MAX_BYTES);

/// `replay --capacity`'s value in bytes, or what is wrong with it.
fn parse_capacity(capacity: &str) -> Result<u64, CliError> {
    if capacity.starts_with("--") {
        // Taken as the value since `-1GiB` must be one.
        return Err(CliError(format!(
            "--capacity needs a size (such as 80GiB), not the option {capacity}"
        )));
    }
    let cap = units::parse_bytes(capacity)
        .map_err(|e| CliError(format!("--capacity {capacity}: {e}")))?;
    let (min, max) = CAPACITY_RANGE;
    if !(min..=max).contains(&cap) {
        return Err(CliError(format!(
            "--capacity {capacity}: {cap} bytes is not in {min}..={max} (1 MiB to 1 PiB)"
        )));
    }
    Ok(cap)
}

fn run(cmd: Command) -> Result<(), CliError> {
    match cmd {
        Command::Summary {
            files,
            json,
            allow_truncated,
        } => {
            let traces = analyses::ranks::par_map(files, |_, file| {
                let mut a = analyses::analysis::analyze(&file, allow_truncated)?;
                analyses::analysis::second_pass(&file, allow_truncated, &mut a)?;
                warn(&a.info.warning);
                Ok((file, a))
            })?;
            let out = match (&traces[..], json) {
                ([(file, a)], true) => commands::summary::render_json(a, file),
                ([(_, a)], false) => commands::summary::render(a),
                (_, true) => analyses::ranks::render_json(&analyses::ranks::label(traces)),
                (_, false) => analyses::ranks::render(&analyses::ranks::label(traces)),
            };
            emit(&out)?;
        }
        Command::Report {
            files,
            output,
            allow_truncated,
        } => {
            let inputs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
            input::refuse_overwrite("--output", &output, &inputs)?;
            let mut traces = analyses::ranks::par_map(files, |_, file| {
                let a = analyses::analysis::analyze(&file, allow_truncated)?;
                warn(&a.info.warning);
                if a.info.events == 0 {
                    eprintln!(
                        "gpualloc: {}: {}",
                        file.display(),
                        commands::summary::NO_EVENTS
                    );
                }
                Ok((file, a))
            })?;
            let html = if let [(file, a)] = &mut traces[..] {
                commands::report::render(a, file, allow_truncated)?
            } else {
                commands::report::render_ranks(analyses::ranks::label(traces), allow_truncated)?
            };
            input::write_atomically(&output, |o| {
                std::fs::write(o, &html)
                    .map_err(|e| CliError(format!("{}: cannot write: {e}", o.display())))
            })?;
            eprintln!("wrote {}", output.display());
        }
        Command::Leaks {
            file,
            limit,
            json,
            allow_truncated,
        } => {
            let a = analyses::analysis::analyze(&file, allow_truncated)?;
            warn(&a.info.warning);
            let limit = usize::try_from(limit).unwrap_or(usize::MAX);
            emit(&if json {
                analyses::leaks::render_json(&a, &file, limit)
            } else {
                analyses::leaks::render(&a, limit)
            })?;
        }
        Command::Replay {
            file,
            capacity,
            config,
            json,
            allow_truncated,
            min_limit,
        } => {
            let cap = capacity.as_deref().map(parse_capacity).transpose()?;
            emit(&commands::replay::run(
                &file,
                cap,
                &config,
                json,
                allow_truncated,
                min_limit,
            )?)?;
        }
        Command::Export {
            files,
            torch_snapshot,
            chrome,
            csv,
            parquet,
            allow_truncated,
        } => {
            if torch_snapshot.is_none() && chrome.is_none() && csv.is_none() && parquet.is_none() {
                return Err(CliError(
                    "export: name at least one of --torch-snapshot, --chrome, --csv, --parquet"
                        .into(),
                ));
            }
            let file = match &files[..] {
                [file] => file.clone(),
                _ if torch_snapshot.is_some() || chrome.is_some() || csv.is_some() => {
                    return Err(CliError(
                        "export: --torch-snapshot, --chrome and --csv take one trace; several go to --parquet FOLDER/".into(),
                    ));
                }
                _ => {
                    let folder = parquet.expect("checked above");
                    let outs =
                        formats::export_parquet::export_all(&folder, &files, allow_truncated)?;
                    outs.iter()
                        .flatten()
                        .for_each(|out| report_written(out, &None));
                    return Ok(());
                }
            };
            if let Some(p) = &parquet {
                let folder = if p.is_dir() || p.as_os_str().to_string_lossy().ends_with('/') {
                    p.as_path()
                } else {
                    p.parent().unwrap_or(Path::new("."))
                };
                if !folder.as_os_str().is_empty() && !folder.is_dir() {
                    return Err(CliError(format!(
                        "--parquet: {} is not a folder: create it first",
                        folder.display()
                    )));
                }
            }
            let parquet = parquet.map(|p| formats::export_parquet::outputs(&p, &file));
            let parquet_files = parquet.iter().flatten().map(|p| ("--parquet", Some(p)));
            let outs: Vec<(&str, &Path)> = [
                ("--torch-snapshot", torch_snapshot.as_ref()),
                ("--chrome", chrome.as_ref()),
                ("--csv", csv.as_ref()),
            ]
            .into_iter()
            .chain(parquet_files)
            .filter_map(|(option, out)| out.map(|o| (option, o.as_path())))
            .collect();
            for (option, out) in &outs {
                input::refuse_overwrite(option, out, &[&file])?;
            }
            input::refuse_shared_outputs(&outs)?;
            if let Some(out) = torch_snapshot {
                let n = input::write_atomically(&out, |o| {
                    formats::export_torch::export(&file, o, allow_truncated)
                })?;
                report_written(&out, &n);
            }
            if let Some(out) = chrome {
                input::write_atomically(&out, |o| {
                    formats::export_chrome::export(&file, o, allow_truncated)
                })?;
                report_written(&out, &None);
            }
            if let Some(out) = csv {
                input::write_atomically(&out, |o| {
                    formats::export_csv::export(&file, o, allow_truncated)
                })?;
                report_written(&out, &None);
            }
            if let Some(outs) = parquet {
                formats::export_parquet::export(&file, &outs, allow_truncated)?;
                for out in &outs {
                    report_written(out, &None);
                }
            }
        }
        Command::Import { file, output, from } => {
            input::refuse_overwrite("--output", &output, &[&file])?;
            let kind = match from {
                From::Auto => sniff(&file)?,
                other => other,
            };
            let n = input::write_atomically(&output, |o| match kind {
                From::Torch => formats::import_torch::import(&file, o),
                _ => formats::import_rmm::import(&file, o),
            })?;
            eprintln!("wrote {} ({n} events)", output.display());
        }
        Command::Diff {
            a,
            b,
            json,
            allow_truncated,
        } => emit(&commands::diff::run(&a, &b, json, allow_truncated)?)?,
        Command::Generate {
            output,
            events,
            seed,
        } => {
            let s = input::write_atomically(&output, |o| {
                commands::generate::generate(o, events, seed)
            })?;
            eprintln!(
                "wrote {} ({} events, {}, {} dropped)",
                output.display(),
                s.events,
                units::bytes(s.bytes),
                s.dropped
            );
        }
    }
    Ok(())
}

/// Writes a command's answer to stdout. A reader that stopped reading
/// (`| head`) ends the command quietly, as it ends other tools; any other
/// failure (a full disk behind a redirection) is an error, not a panic.
fn emit(out: &str) -> Result<(), CliError> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError(format!("cannot write the output: {e}")))
        }
        _ => Ok(()),
    }
}

fn report_written(out: &Path, note: &Option<String>) {
    eprintln!("wrote {}", out.display());
    warn(note);
}

fn sniff(path: &Path) -> Result<From, CliError> {
    use std::io::Read;
    let mut head = [0u8; 8];
    let open_err = |e| CliError(format!("{}: cannot open: {e}", path.display()));
    // A pipe's first bytes, once looked at, are gone for the importer.
    if input::is_stream(path) {
        return Err(CliError(format!(
            "{}: not a regular file (a pipe or a device): name its format with --from torch or --from rmm, which read it once",
            path.display()
        )));
    }
    let mut f = std::fs::File::open(path).map_err(open_err)?;
    let n = f.read(&mut head).map_err(open_err)?;
    // A CSV log is text (after a UTF-8 byte order mark, if any); pickles of
    // protocols 0 and 1 start with a mark or an empty dict or list, and
    // protocol 1 has binary bytes after it.
    let text = |h: &[u8]| {
        let h = h.strip_prefix(b"\xef\xbb\xbf").unwrap_or(h);
        h.iter()
            .all(|&b| b.is_ascii_graphic() || matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
    };
    match &head[..n] {
        [0x80, ..] | [b'(' | b'}' | b']', ..] => Ok(From::Torch),
        h if n > 0 && text(h) => Ok(From::Rmm),
        _ => Err(CliError(format!(
            "{}: neither a pickle (first byte 0x80) nor a CSV log; name the format with --from",
            path.display()
        ))),
    }
}
