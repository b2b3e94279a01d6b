//! A Parquet file written row group by row group: the rows of the group
//! under way are held column by column and written once
//! [`ROWS_PER_GROUP`] have accumulated, so memory stays bounded whatever
//! the length of the trace.
//!
//! # Why the `parquet` crate's column writers, not `arrow`
//!
//! The export needs a handful of integer and string columns, written in
//! order: the low-level column writer API does that directly. The `arrow`
//! feature (arrow-array, -buffer, -data, -schema, -select, -ipc) would
//! only add a second in-memory representation to fill before writing, and
//! nearly doubles what the dependency costs to build. One codec, Snappy
//! (pure Rust, small), is compiled in: every Parquet reader reads it.
//!
//! Measured on a shared 2-core machine (CPU seconds, as the wall clock
//! there follows other people's builds): a clean debug build of this crate
//! took 67 s before parquet and 162 s with it; parquet alone builds in
//! 72 s, and 132 s with `arrow` and arrow-array. The release binary grew
//! from 3.40 MB to 4.88 MB (release build 123 s to 231 s of CPU).

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int32Type, Int64Type};
use parquet::errors::ParquetError;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

use crate::input::CliError;

/// Rows buffered before they are written as one row group.
pub const ROWS_PER_GROUP: usize = 1 << 17;

/// What a column holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    /// Unsigned 64-bit integer (addresses, bytes, streams).
    U64,
    /// Signed 64-bit integer (times in ns, counts).
    I64,
    /// Unsigned 32-bit integer (devices, process ids, threads).
    U32,
    /// UTF-8 string (action names, phase names).
    Str,
}

impl Ty {
    fn schema(self) -> &'static str {
        match self {
            Ty::U64 => "INT64 {} (INTEGER(64,false))",
            Ty::I64 => "INT64 {}",
            Ty::U32 => "INT32 {} (INTEGER(32,false))",
            Ty::Str => "BYTE_ARRAY {} (STRING)",
        }
    }
}

/// One value of a row; `Null` only in a column declared optional.
pub enum V {
    /// An integer column's value (unsigned ones keep their bits).
    Int(i64),
    /// A string column's value.
    Str(ByteArray),
    /// No value.
    Null,
}

impl V {
    /// An unsigned value.
    pub fn u(x: u64) -> V {
        V::Int(x as i64)
    }

    /// An unsigned value, or null.
    pub fn opt(x: Option<u64>) -> V {
        x.map_or(V::Null, V::u)
    }
}

struct Column {
    ty: Ty,
    optional: bool,
    ints: Vec<i64>,
    strs: Vec<ByteArray>,
    defs: Vec<i16>,
}

/// A Parquet file being written.
pub struct Table {
    path: PathBuf,
    writer: SerializedFileWriter<BufWriter<File>>,
    cols: Vec<Column>,
    rows: usize,
}

/// A column: name, type, whether it may be null.
pub type ColumnSpec = (&'static str, Ty, bool);

fn perr(path: &Path, e: impl std::fmt::Display) -> CliError {
    CliError(format!("{}: cannot write Parquet: {e}", path.display()))
}

impl Table {
    /// Creates `path` with the columns `spec` (the schema is named `name`)
    /// and `meta` as the file's key-value metadata.
    pub fn create(
        path: &Path,
        name: &str,
        spec: &[ColumnSpec],
        meta: &[(&str, String)],
    ) -> Result<Table, CliError> {
        let fields: String = spec
            .iter()
            .map(|(n, ty, optional)| {
                let rep = if *optional { "OPTIONAL" } else { "REQUIRED" };
                format!("  {rep} {};\n", ty.schema().replace("{}", n))
            })
            .collect();
        let schema = parse_message_type(&format!("message {name} {{\n{fields}}}"))
            .map_err(|e| perr(path, e))?;
        let kv = meta
            .iter()
            .map(|(k, v)| KeyValue::new((*k).to_string(), v.clone()))
            .collect();
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_created_by(format!("gpualloc {}", env!("CARGO_PKG_VERSION")))
            .set_key_value_metadata(Some(kv))
            .build();
        let file = File::create(path)
            .map_err(|e| CliError(format!("{}: cannot write: {e}", path.display())))?;
        let writer = SerializedFileWriter::new(
            BufWriter::with_capacity(1 << 20, file),
            Arc::new(schema),
            Arc::new(props),
        )
        .map_err(|e| perr(path, e))?;
        let cols = spec
            .iter()
            .map(|&(_, ty, optional)| Column {
                ty,
                optional,
                ints: Vec::new(),
                strs: Vec::new(),
                defs: Vec::new(),
            })
            .collect();
        Ok(Table {
            path: path.to_path_buf(),
            writer,
            cols,
            rows: 0,
        })
    }

    /// Appends a row (one value per column, in the schema's order); writes
    /// a row group when enough have accumulated.
    pub fn push(&mut self, row: impl IntoIterator<Item = V>) -> Result<(), CliError> {
        let mut n = 0;
        for (c, v) in self.cols.iter_mut().zip(row) {
            n += 1;
            let present = !matches!(v, V::Null);
            debug_assert!(present || c.optional, "null in a required column");
            if c.optional {
                c.defs.push(i16::from(present));
            }
            match v {
                V::Int(x) => c.ints.push(x),
                V::Str(s) => c.strs.push(s),
                V::Null => {}
            }
        }
        debug_assert_eq!(n, self.cols.len(), "one value per column");
        self.rows += 1;
        if self.rows >= ROWS_PER_GROUP {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), CliError> {
        if self.rows == 0 {
            return Ok(());
        }
        let path = &self.path;
        let mut rg = self.writer.next_row_group().map_err(|e| perr(path, e))?;
        for c in &mut self.cols {
            let mut w = rg
                .next_column()
                .map_err(|e| perr(path, e))?
                .ok_or_else(|| perr(path, "fewer columns than the schema's"))?;
            let defs = c.optional.then_some(&c.defs[..]);
            let r: Result<usize, ParquetError> = match c.ty {
                Ty::Str => w.typed::<ByteArrayType>().write_batch(&c.strs, defs, None),
                Ty::U32 => {
                    let v: Vec<i32> = c.ints.iter().map(|&x| x as u32 as i32).collect();
                    w.typed::<Int32Type>().write_batch(&v, defs, None)
                }
                Ty::U64 | Ty::I64 => w.typed::<Int64Type>().write_batch(&c.ints, defs, None),
            };
            r.map_err(|e| perr(path, e))?;
            w.close().map_err(|e| perr(path, e))?;
            c.ints.clear();
            c.strs.clear();
            c.defs.clear();
        }
        rg.close().map_err(|e| perr(path, e))?;
        self.rows = 0;
        Ok(())
    }

    /// Writes the last row group and the footer.
    pub fn finish(mut self) -> Result<(), CliError> {
        self.flush()?;
        let path = self.path.clone();
        let mut w = self.writer.into_inner().map_err(|e| perr(&path, e))?;
        std::io::Write::flush(&mut w)
            .map_err(|e| CliError(format!("{}: cannot write: {e}", path.display())))
    }
}
