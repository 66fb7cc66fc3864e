//! The error of reading or validating a store file. Every variant names the
//! file, and the field, offset, record or key at fault, so a bad file is
//! never served and never anonymous.

use std::path::PathBuf;

use crate::text::hex_bytes;

/// Why a store file (or one of its records) was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// Reading the file failed.
    #[error("read {path} at offset {offset} length {len}: {source}")]
    Io {
        /// File read.
        path: PathBuf,
        /// Byte offset of the read.
        offset: u64,
        /// Length of the read in bytes.
        len: u64,
        /// OS error.
        source: std::io::Error,
    },
    /// The file could not be opened, or is no regular file (a FIFO, a
    /// device).
    #[error(transparent)]
    Open(#[from] crate::regular::OpenError),
    /// The first 8 bytes are not the store magic.
    #[error(
        "{path}: not a flashtier store (magic {}, expected FTSTORE\\0)",
        hex_bytes(found)
    )]
    BadMagic {
        /// File.
        path: PathBuf,
        /// The bytes found at offset 0.
        found: [u8; 8],
    },
    /// The format version is not one this build reads.
    #[error("{path}: field format_version: unknown version {found} (this build reads {supported})")]
    UnknownVersion {
        /// File.
        path: PathBuf,
        /// Version found in the header.
        found: u32,
        /// Version this build reads.
        supported: u32,
    },
    /// The file is shorter than its header (or the 4096-byte header) says.
    #[error(
        "{path}: truncated: field {field} needs {expected_len} bytes, the file has {actual_len}"
    )]
    Truncated {
        /// File.
        path: PathBuf,
        /// What needed the bytes (`header`, `file_len`).
        field: &'static str,
        /// Bytes the file should have.
        expected_len: u64,
        /// Bytes it has.
        actual_len: u64,
    },
    /// The file is longer than its header says (appended or mismatched data).
    #[error("{path}: field file_len: header says {expected_len} bytes, the file has {actual_len}")]
    TrailingBytes {
        /// File.
        path: PathBuf,
        /// Bytes the header says.
        expected_len: u64,
        /// Bytes the file has.
        actual_len: u64,
    },
    /// The header's own checksum does not match its bytes.
    #[error("{path}: field header_checksum: stored {stored:#018x}, computed {computed:#018x}")]
    HeaderChecksum {
        /// File.
        path: PathBuf,
        /// Checksum stored in the header.
        stored: u64,
        /// Checksum of the header bytes.
        computed: u64,
    },
    /// The record stride is zero or not a multiple of 4096.
    #[error("{path}: field record_stride_bytes: {stride} is not a non-zero multiple of 4096")]
    UnalignedStride {
        /// File.
        path: PathBuf,
        /// The stride found.
        stride: u64,
    },
    /// A header field holds a value the format forbids.
    #[error("{path}: field {field}: value {value}: {why}")]
    BadField {
        /// File.
        path: PathBuf,
        /// Header field name (as in docs/format.md).
        field: &'static str,
        /// The value found.
        value: u64,
        /// What rule it breaks.
        why: &'static str,
    },
    /// A region (records, checksum table, manifest) lies outside the file or
    /// overlaps another.
    #[error(
        "{path}: {table} at offset {offset} length {len} overflows or overlaps (file_len {file_len}): {why}"
    )]
    TableOverflow {
        /// File.
        path: PathBuf,
        /// Region name.
        table: &'static str,
        /// Region offset.
        offset: u64,
        /// Region length in bytes.
        len: u64,
        /// File length from the header.
        file_len: u64,
        /// What is wrong.
        why: &'static str,
    },
    /// The manifest or checksum table does not match its checksum in the header.
    #[error("{path}: field {table}_checksum: stored {stored:#018x}, computed {computed:#018x}")]
    TableChecksum {
        /// File.
        path: PathBuf,
        /// `manifest` or `checksum_table`.
        table: &'static str,
        /// Checksum stored in the header.
        stored: u64,
        /// Checksum of the bytes.
        computed: u64,
    },
    /// The manifest is not valid JSON for this format version.
    #[error("{path}: manifest: {source}")]
    ManifestJson {
        /// File.
        path: PathBuf,
        /// Parser error.
        source: serde_json::Error,
    },
    /// The manifest is well-formed but breaks a rule of its own.
    #[error("{path}: manifest field {field}: {why}")]
    ManifestInvalid {
        /// File.
        path: PathBuf,
        /// Manifest field path (`record.tensors[2].len_bytes`).
        field: String,
        /// What is wrong.
        why: String,
    },
    /// The manifest disagrees with the header's geometry.
    #[error("{path}: manifest field {field} = {manifest} disagrees with header ({header})")]
    ManifestMismatch {
        /// File.
        path: PathBuf,
        /// The field that disagrees.
        field: &'static str,
        /// The manifest's value.
        manifest: String,
        /// The header's value.
        header: String,
    },
    /// A record's bytes do not match its checksum.
    #[error(
        "{path}: record {index} ({key}): checksum mismatch: stored {expected:#018x}, computed {actual:#018x}"
    )]
    RecordChecksum {
        /// File.
        path: PathBuf,
        /// Record index.
        index: u64,
        /// The record's key, e.g. `layer=3 expert=7`.
        key: String,
        /// Checksum in the table.
        expected: u64,
        /// Checksum of the bytes.
        actual: u64,
    },
    /// A record buffer of the wrong length was handed in for verification.
    #[error("{path}: record {index} ({key}): {got} bytes given, the payload is {expected}")]
    RecordLength {
        /// File.
        path: PathBuf,
        /// Record index.
        index: u64,
        /// The record's key.
        key: String,
        /// Payload bytes.
        expected: u64,
        /// Bytes given.
        got: u64,
    },
    /// A record index at or past the record count.
    #[error("{path}: record {index} out of range (the store has {count} records)")]
    RecordOutOfRange {
        /// File.
        path: PathBuf,
        /// Index asked for.
        index: u64,
        /// Record count.
        count: u64,
    },
    /// A key the store does not hold.
    #[error("{path}: no record for key {key}")]
    KeyNotFound {
        /// File.
        path: PathBuf,
        /// The key asked for.
        key: String,
    },
    /// The store holds a different kind than the caller needs.
    #[error("{path}: store kind is {found}, expected {expected}")]
    WrongKind {
        /// File.
        path: PathBuf,
        /// Kind in the file.
        found: &'static str,
        /// Kind wanted.
        expected: &'static str,
    },
}
