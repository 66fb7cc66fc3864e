//! The 4096-byte header of a store file (format v1).
//!
//! Byte layout (all integers little-endian; docs/format.md is the reference):
//!
//! | offset | size | field |
//! | ---: | ---: | --- |
//! | 0 | 8 | magic `"FTSTORE\0"` |
//! | 8 | 4 | `format_version` (1) |
//! | 12 | 4 | `kind` (1 experts, 2 rows, 3 kv) |
//! | 16 | 4 | `checksum_algo` (1 = XXH3-64) |
//! | 20 | 4 | `flags` (0) |
//! | 24 | 8 | `record_count` |
//! | 32 | 8 | `record_stride_bytes` (non-zero multiple of 4096) |
//! | 40 | 8 | `payload_bytes` (per record, `1..=stride`) |
//! | 48 | 8 | `records_offset` (multiple of 4096, at least 4096) |
//! | 56 | 8 | `checksum_table_offset` |
//! | 64 | 8 | `checksum_table_len` (`8 * record_count`) |
//! | 72 | 8 | `manifest_offset` |
//! | 80 | 8 | `manifest_len` |
//! | 88 | 8 | `file_len` (multiple of 4096) |
//! | 96 | 8 | `checksum_table_checksum` |
//! | 104 | 8 | `manifest_checksum` |
//! | 112 | 3976 | reserved, zero |
//! | 4088 | 8 | `header_checksum` (XXH3-64 of bytes 0..4088) |
//!
//! Decoding checks, in order: magic, version, header checksum, the reserved
//! bytes and flags, kind and checksum algorithm, then the geometry (every
//! region inside `file_len`, in order, not overlapping, no `u64` overflow).
//! The version is checked before the checksum because a later version may
//! checksum differently; an unknown version is reported as such.

use std::path::Path;

use crate::checksum::{ChecksumAlgo, xxh3_64};
use crate::error::FormatError;
use crate::le::{get_u32, get_u64, put_u32, put_u64};

/// The magic at offset 0.
pub const MAGIC: [u8; 8] = *b"FTSTORE\0";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Size of the header in bytes.
pub const HEADER_BYTES: usize = 4096;
/// Alignment of records, strides, the tail and the file length.
pub const ALIGN_BYTES: u64 = 4096;
/// Largest manifest a reader accepts (it is read into memory whole).
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;

const HEADER_CHECKSUM_AT: usize = HEADER_BYTES - 8;
const RESERVED_AT: usize = 112;

/// What the records of a store hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum StoreKind {
    /// One record per (layer, expert) of a MoE model.
    Experts,
    /// Fixed-size rows of an embedding / Engram table, grouped into records.
    Rows,
    /// KV-cache blocks.
    Kv,
}

impl StoreKind {
    /// The header code.
    #[must_use]
    pub const fn code(self) -> u32 {
        match self {
            Self::Experts => 1,
            Self::Rows => 2,
            Self::Kv => 3,
        }
    }

    /// The kind with header code `code`, if known.
    #[must_use]
    pub const fn from_code(code: u32) -> Option<Self> {
        match code {
            1 => Some(Self::Experts),
            2 => Some(Self::Rows),
            3 => Some(Self::Kv),
            _ => None,
        }
    }

    /// Lower-case name (`experts`, `rows`, `kv`).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Experts => "experts",
            Self::Rows => "rows",
            Self::Kv => "kv",
        }
    }
}

impl std::fmt::Display for StoreKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A decoded (or planned) header. The version and magic are implied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the records hold.
    pub kind: StoreKind,
    /// Checksum algorithm of the header, tables and records.
    pub checksum_algo: ChecksumAlgo,
    /// Number of records.
    pub record_count: u64,
    /// Distance between record starts, a non-zero multiple of 4096.
    pub record_stride_bytes: u64,
    /// Meaningful bytes at the start of each record (the rest is zero).
    pub payload_bytes: u64,
    /// Offset of record 0.
    pub records_offset: u64,
    /// Offset of the checksum table.
    pub checksum_table_offset: u64,
    /// Length of the checksum table (`8 * record_count`).
    pub checksum_table_len: u64,
    /// Offset of the JSON manifest.
    pub manifest_offset: u64,
    /// Length of the JSON manifest.
    pub manifest_len: u64,
    /// Length of the whole file, a multiple of 4096.
    pub file_len: u64,
    /// Checksum of the checksum table.
    pub checksum_table_checksum: u64,
    /// Checksum of the manifest bytes.
    pub manifest_checksum: u64,
}

/// Round `n` up to a multiple of 4096, `None` on overflow.
#[must_use]
pub fn align_up(n: u64) -> Option<u64> {
    n.checked_next_multiple_of(ALIGN_BYTES)
}

impl Header {
    /// Plan the geometry of a new store: records from offset 4096 at a stride
    /// of `payload_bytes` rounded up to 4096, then the checksum table, then
    /// the manifest, the file padded to 4096. Checksums start at zero; the
    /// writer fills them in before encoding. `None` when the sizes overflow.
    #[must_use]
    pub fn plan(
        kind: StoreKind,
        record_count: u64,
        payload_bytes: u64,
        manifest_len: u64,
    ) -> Option<Self> {
        let stride = align_up(payload_bytes.max(1))?;
        let records_offset = HEADER_BYTES as u64;
        let records_end = record_count
            .checked_mul(stride)?
            .checked_add(records_offset)?;
        let table_len = record_count.checked_mul(8)?;
        let manifest_offset = records_end.checked_add(table_len)?;
        let manifest_end = manifest_offset.checked_add(manifest_len)?;
        Some(Self {
            kind,
            checksum_algo: ChecksumAlgo::Xxh3_64,
            record_count,
            record_stride_bytes: stride,
            payload_bytes,
            records_offset,
            checksum_table_offset: records_end,
            checksum_table_len: table_len,
            manifest_offset,
            manifest_len,
            file_len: align_up(manifest_end)?,
            checksum_table_checksum: 0,
            manifest_checksum: 0,
        })
    }

    /// End of the records region.
    #[must_use]
    pub fn records_end(&self) -> u64 {
        // Validated (or planned) headers cannot overflow here.
        self.record_count
            .saturating_mul(self.record_stride_bytes)
            .saturating_add(self.records_offset)
    }

    /// Offset of record `index`, `None` when out of range.
    #[must_use]
    pub fn record_offset(&self, index: u64) -> Option<u64> {
        (index < self.record_count).then(|| self.records_offset + index * self.record_stride_bytes)
    }

    /// Encode into the 4096 header bytes, computing the header checksum.
    #[must_use]
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..8].copy_from_slice(&MAGIC);
        put_u32(&mut b, 8, FORMAT_VERSION);
        put_u32(&mut b, 12, self.kind.code());
        put_u32(&mut b, 16, self.checksum_algo.code());
        put_u32(&mut b, 20, 0);
        let words = [
            self.record_count,
            self.record_stride_bytes,
            self.payload_bytes,
            self.records_offset,
            self.checksum_table_offset,
            self.checksum_table_len,
            self.manifest_offset,
            self.manifest_len,
            self.file_len,
            self.checksum_table_checksum,
            self.manifest_checksum,
        ];
        for (i, w) in words.iter().enumerate() {
            put_u64(&mut b, 24 + 8 * i, *w);
        }
        let sum = xxh3_64(&b[..HEADER_CHECKSUM_AT]);
        put_u64(&mut b, HEADER_CHECKSUM_AT, sum);
        b
    }

    /// Decode and validate header bytes (at least 4096 of them; only the
    /// first 4096 are read). `path` names the file in errors.
    pub fn decode(path: &Path, bytes: &[u8]) -> Result<Self, FormatError> {
        let p = || path.to_path_buf();
        if let Some(found) = bytes.get(0..8) {
            if found != MAGIC {
                let mut f = [0u8; 8];
                f.copy_from_slice(found);
                return Err(FormatError::BadMagic {
                    path: p(),
                    found: f,
                });
            }
        }
        let Some(b) = bytes.get(..HEADER_BYTES) else {
            return Err(FormatError::Truncated {
                path: p(),
                field: "header",
                expected_len: HEADER_BYTES as u64,
                actual_len: bytes.len() as u64,
            });
        };
        let version = get_u32(b, 8);
        if version != FORMAT_VERSION {
            return Err(FormatError::UnknownVersion {
                path: p(),
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let stored = get_u64(b, HEADER_CHECKSUM_AT);
        let computed = xxh3_64(&b[..HEADER_CHECKSUM_AT]);
        if stored != computed {
            return Err(FormatError::HeaderChecksum {
                path: p(),
                stored,
                computed,
            });
        }
        let h = Self::decode_fields(path, b)?;
        h.validate_geometry(path)?;
        Ok(h)
    }

    fn decode_fields(path: &Path, b: &[u8]) -> Result<Self, FormatError> {
        let bad = |field, value, why| FormatError::BadField {
            path: path.to_path_buf(),
            field,
            value,
            why,
        };
        if let Some(pos) = b[RESERVED_AT..HEADER_CHECKSUM_AT]
            .iter()
            .position(|&x| x != 0)
        {
            return Err(bad(
                "reserved",
                (RESERVED_AT + pos) as u64,
                "reserved bytes must be zero",
            ));
        }
        let flags = get_u32(b, 20);
        if flags != 0 {
            return Err(bad(
                "flags",
                u64::from(flags),
                "no flags are defined in version 1",
            ));
        }
        let kind_code = get_u32(b, 12);
        let kind = StoreKind::from_code(kind_code).ok_or_else(|| {
            bad(
                "kind",
                u64::from(kind_code),
                "unknown kind (1 experts, 2 rows, 3 kv)",
            )
        })?;
        let algo_code = get_u32(b, 16);
        let checksum_algo = ChecksumAlgo::from_code(algo_code).ok_or_else(|| {
            bad(
                "checksum_algo",
                u64::from(algo_code),
                "unknown checksum algorithm (1 = xxh3-64)",
            )
        })?;
        Ok(Self {
            kind,
            checksum_algo,
            record_count: get_u64(b, 24),
            record_stride_bytes: get_u64(b, 32),
            payload_bytes: get_u64(b, 40),
            records_offset: get_u64(b, 48),
            checksum_table_offset: get_u64(b, 56),
            checksum_table_len: get_u64(b, 64),
            manifest_offset: get_u64(b, 72),
            manifest_len: get_u64(b, 80),
            file_len: get_u64(b, 88),
            checksum_table_checksum: get_u64(b, 96),
            manifest_checksum: get_u64(b, 104),
        })
    }

    /// Check the geometry: stride, payload, alignment, and that records,
    /// checksum table and manifest lie in this order inside `file_len`.
    pub fn validate_geometry(&self, path: &Path) -> Result<(), FormatError> {
        let records_end = self.validate_records(path)?;
        self.validate_tables(path, records_end)
    }

    fn bad(path: &Path, field: &'static str, value: u64, why: &'static str) -> FormatError {
        FormatError::BadField {
            path: path.to_path_buf(),
            field,
            value,
            why,
        }
    }

    fn overflow(
        &self,
        path: &Path,
        table: &'static str,
        offset: u64,
        len: u64,
        why: &'static str,
    ) -> FormatError {
        FormatError::TableOverflow {
            path: path.to_path_buf(),
            table,
            offset,
            len,
            file_len: self.file_len,
            why,
        }
    }

    /// Stride, payload, alignment, and the records inside `file_len`;
    /// returns the end of the records.
    fn validate_records(&self, path: &Path) -> Result<u64, FormatError> {
        let stride = self.record_stride_bytes;
        if stride == 0 || stride % ALIGN_BYTES != 0 {
            return Err(FormatError::UnalignedStride {
                path: path.to_path_buf(),
                stride,
            });
        }
        if self.payload_bytes == 0 || self.payload_bytes > stride {
            let why = "must be in 1..=record_stride_bytes";
            return Err(Self::bad(path, "payload_bytes", self.payload_bytes, why));
        }
        if self.records_offset < HEADER_BYTES as u64 || self.records_offset % ALIGN_BYTES != 0 {
            let why = "must be a multiple of 4096, at least 4096";
            return Err(Self::bad(path, "records_offset", self.records_offset, why));
        }
        if self.file_len % ALIGN_BYTES != 0 {
            return Err(Self::bad(
                path,
                "file_len",
                self.file_len,
                "must be a multiple of 4096",
            ));
        }
        let records_end = self
            .record_count
            .checked_mul(stride)
            .and_then(|n| n.checked_add(self.records_offset))
            .ok_or_else(|| {
                Self::bad(
                    path,
                    "record_count",
                    self.record_count,
                    "records region overflows u64",
                )
            })?;
        if records_end > self.file_len {
            let len = records_end - self.records_offset;
            return Err(self.overflow(
                path,
                "records",
                self.records_offset,
                len,
                "records end past file_len",
            ));
        }
        Ok(records_end)
    }

    /// The checksum table and the manifest after the records, inside `file_len`.
    fn validate_tables(&self, path: &Path, records_end: u64) -> Result<(), FormatError> {
        if Some(self.checksum_table_len) != self.record_count.checked_mul(8) {
            let why = "must be 8 * record_count";
            return Err(Self::bad(
                path,
                "checksum_table_len",
                self.checksum_table_len,
                why,
            ));
        }
        let (ct_off, ct_len) = (self.checksum_table_offset, self.checksum_table_len);
        if ct_off < records_end {
            return Err(self.overflow(
                path,
                "checksum_table",
                ct_off,
                ct_len,
                "starts inside the records",
            ));
        }
        let ct_end = ct_off.checked_add(ct_len).filter(|&e| e <= self.file_len);
        let Some(ct_end) = ct_end else {
            return Err(self.overflow(
                path,
                "checksum_table",
                ct_off,
                ct_len,
                "ends past file_len",
            ));
        };
        if self.manifest_len == 0 || self.manifest_len > MAX_MANIFEST_BYTES {
            let why = "must be in 1..=268435456";
            return Err(Self::bad(path, "manifest_len", self.manifest_len, why));
        }
        let (m_off, m_len) = (self.manifest_offset, self.manifest_len);
        if m_off < ct_end {
            let why = "starts before the checksum table ends";
            return Err(self.overflow(path, "manifest", m_off, m_len, why));
        }
        if m_off.checked_add(m_len).is_none_or(|e| e > self.file_len) {
            return Err(self.overflow(path, "manifest", m_off, m_len, "ends past file_len"));
        }
        Ok(())
    }

    /// Compare the header's `file_len` with the file's actual length.
    pub fn check_file_len(&self, path: &Path, actual_len: u64) -> Result<(), FormatError> {
        if actual_len < self.file_len {
            return Err(FormatError::Truncated {
                path: path.to_path_buf(),
                field: "file_len",
                expected_len: self.file_len,
                actual_len,
            });
        }
        if actual_len > self.file_len {
            return Err(FormatError::TrailingBytes {
                path: path.to_path_buf(),
                expected_len: self.file_len,
                actual_len,
            });
        }
        Ok(())
    }
}
