//! Reading and planning whole store files.
//!
//! [`Store`] is the validated view of a store file that every tier starts
//! from: header, manifest, checksum table and the key → index map, all
//! checked before any record is served. It reads only the header (4096
//! bytes), the checksum table (8 bytes per record) and the manifest (at most
//! 256 MiB, bounded by [`crate::header::MAX_MANIFEST_BYTES`]); records are
//! read by the tiers through `flashtier-io` at [`Store::record_offset`] and
//! checked with [`Store::verify_record`].
//!
//! [`StoreWriterPlan`] is the writer's half: from a manifest it plans the
//! geometry, and from the record checksums it builds the tail (checksum table
//! plus manifest, zero-padded to 4096) and the final header. A writer puts
//! records at `record_offset(i)`, then the tail at `tail_offset()`, then the
//! header at 0 last, so a crash before the end leaves a file with no magic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::checksum::{ChecksumAlgo, decode_table, encode_table};
use crate::error::FormatError;
use crate::header::{HEADER_BYTES, Header, StoreKind};
use crate::manifest::{Manifest, RecordKey, TensorLayout};
use crate::regular::open_regular_read;

/// Something a store can be read from by position: a store image in
/// memory (`[u8]`), or a file handle of `flashtier-io` (its `StoreFile`),
/// which is the only layer that reads a store file's records. [`Store::open`]
/// reads the header and tables of a file through a private adapter.
pub trait ByteSource {
    /// Total length in bytes.
    fn len_bytes(&self) -> std::io::Result<u64>;
    /// Fill `buf` from `offset`; an error when fewer bytes exist.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
}

/// The header and tables of a store file, for [`Store::open`] only (records
/// are read through `flashtier-io`).
struct TableReader(std::fs::File);

impl ByteSource for TableReader {
    fn len_bytes(&self) -> std::io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, buf, offset)
    }
}

impl ByteSource for [u8] {
    fn len_bytes(&self) -> std::io::Result<u64> {
        Ok(self.len() as u64)
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|start| self.get(start..start.checked_add(buf.len())?))
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

/// A validated store file.
#[derive(Debug, Clone)]
pub struct Store {
    path: PathBuf,
    header: Header,
    manifest: Manifest,
    checksums: Vec<u64>,
    index: HashMap<RecordKey, u64>,
}

fn read_region(
    path: &Path,
    src: &(impl ByteSource + ?Sized),
    offset: u64,
    len: u64,
) -> Result<Vec<u8>, FormatError> {
    let io = |source| FormatError::Io {
        path: path.to_path_buf(),
        offset,
        len,
        source,
    };
    let n = usize::try_from(len)
        .map_err(|_| io(std::io::Error::from(std::io::ErrorKind::OutOfMemory)))?;
    let mut buf = vec![0u8; n];
    src.read_exact_at(&mut buf, offset).map_err(io)?;
    Ok(buf)
}

impl Store {
    /// Open and validate the store file at `path` (buffered reads of the
    /// header and tables only). A FIFO, device or directory is refused
    /// before it is opened ([`crate::regular`]).
    pub fn open(path: &Path) -> Result<Self, FormatError> {
        let file = open_regular_read(path)?;
        Self::read_from(path, &TableReader(file))
    }

    /// Validate a whole store image held in memory.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self, FormatError> {
        Self::read_from(path, bytes)
    }

    /// Read and validate a store from `src`; `path` names it in errors.
    pub fn read_from(path: &Path, src: &(impl ByteSource + ?Sized)) -> Result<Self, FormatError> {
        let actual_len = src.len_bytes().map_err(|source| FormatError::Io {
            path: path.to_path_buf(),
            offset: 0,
            len: 0,
            source,
        })?;
        let head = read_region(path, src, 0, actual_len.min(HEADER_BYTES as u64))?;
        let header = Header::decode(path, &head)?;
        header.check_file_len(path, actual_len)?;
        let algo = header.checksum_algo;
        let table = read_region(
            path,
            src,
            header.checksum_table_offset,
            header.checksum_table_len,
        )?;
        check_table(
            path,
            algo,
            "checksum_table",
            header.checksum_table_checksum,
            &table,
        )?;
        let manifest_bytes = read_region(path, src, header.manifest_offset, header.manifest_len)?;
        check_table(
            path,
            algo,
            "manifest",
            header.manifest_checksum,
            &manifest_bytes,
        )?;
        let manifest = Manifest::from_bytes(path, &manifest_bytes)?;
        manifest.check_against(path, &header)?;
        // The header fixed the table length at 8 * record_count.
        let checksums = decode_table(&table);
        let index = manifest
            .keys
            .iter()
            .enumerate()
            .map(|(i, k)| (*k, i as u64))
            .collect();
        Ok(Self {
            path: path.to_path_buf(),
            header,
            manifest,
            checksums,
            index,
        })
    }

    /// The file this store was read from.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated header.
    #[must_use]
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The validated manifest.
    #[must_use]
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// What the records hold.
    #[must_use]
    pub fn kind(&self) -> StoreKind {
        self.header.kind
    }

    /// Refuse a store of another kind.
    pub fn expect_kind(&self, kind: StoreKind) -> Result<(), FormatError> {
        if self.header.kind == kind {
            return Ok(());
        }
        Err(FormatError::WrongKind {
            path: self.path.clone(),
            found: self.header.kind.name(),
            expected: kind.name(),
        })
    }

    /// Number of records.
    #[must_use]
    pub fn record_count(&self) -> u64 {
        self.header.record_count
    }

    /// Distance between record starts (a non-zero multiple of 4096).
    #[must_use]
    pub fn stride_bytes(&self) -> u64 {
        self.header.record_stride_bytes
    }

    /// Meaningful bytes per record.
    #[must_use]
    pub fn payload_bytes(&self) -> u64 {
        self.header.payload_bytes
    }

    /// The tensors of one record, in offset order.
    #[must_use]
    pub fn tensors(&self) -> &[TensorLayout] {
        &self.manifest.record.tensors
    }

    fn out_of_range(&self, index: u64) -> FormatError {
        FormatError::RecordOutOfRange {
            path: self.path.clone(),
            index,
            count: self.header.record_count,
        }
    }

    /// File offset of record `index` (4096-aligned).
    pub fn record_offset(&self, index: u64) -> Result<u64, FormatError> {
        self.header
            .record_offset(index)
            .ok_or_else(|| self.out_of_range(index))
    }

    /// Stored checksum of record `index`'s payload.
    pub fn checksum(&self, index: u64) -> Result<u64, FormatError> {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.checksums.get(i))
            .copied()
            .ok_or_else(|| self.out_of_range(index))
    }

    /// Key of record `index`.
    pub fn key_of(&self, index: u64) -> Result<RecordKey, FormatError> {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.manifest.keys.get(i))
            .copied()
            .ok_or_else(|| self.out_of_range(index))
    }

    /// Index of the record with `key`.
    pub fn index_of(&self, key: RecordKey) -> Result<u64, FormatError> {
        self.index
            .get(&key)
            .copied()
            .ok_or_else(|| FormatError::KeyNotFound {
                path: self.path.clone(),
                key: self.manifest.key_name(key),
            })
    }

    /// The key → record index map.
    #[must_use]
    pub fn key_index(&self) -> &HashMap<RecordKey, u64> {
        &self.index
    }

    /// Check `payload` (exactly `payload_bytes` long) against record
    /// `index`'s checksum. The error names the file, the index and the key.
    pub fn verify_record(&self, index: u64, payload: &[u8]) -> Result<(), FormatError> {
        let expected = self.checksum(index)?;
        let key = || {
            self.key_of(index)
                .map(|k| self.manifest.key_name(k))
                .unwrap_or_default()
        };
        if payload.len() as u64 != self.header.payload_bytes {
            return Err(FormatError::RecordLength {
                path: self.path.clone(),
                index,
                key: key(),
                expected: self.header.payload_bytes,
                got: payload.len() as u64,
            });
        }
        let actual = self.header.checksum_algo.digest(payload);
        if actual != expected {
            return Err(FormatError::RecordChecksum {
                path: self.path.clone(),
                index,
                key: key(),
                expected,
                actual,
            });
        }
        Ok(())
    }

    /// Read record `index`'s payload from `src` into `buf` (exactly
    /// `payload_bytes` long) and verify it: from an image in memory, or a
    /// `flashtier-io` `StoreFile`. The tiers read through a `StorageBackend`
    /// and call [`Store::verify_record`].
    pub fn read_record(
        &self,
        src: &(impl ByteSource + ?Sized),
        index: u64,
        buf: &mut [u8],
    ) -> Result<(), FormatError> {
        let offset = self.record_offset(index)?;
        if buf.len() as u64 != self.header.payload_bytes {
            return self.verify_record(index, buf);
        }
        src.read_exact_at(buf, offset)
            .map_err(|source| FormatError::Io {
                path: self.path.clone(),
                offset,
                len: buf.len() as u64,
                source,
            })?;
        self.verify_record(index, buf)
    }
}

fn check_table(
    path: &Path,
    algo: ChecksumAlgo,
    table: &'static str,
    stored: u64,
    bytes: &[u8],
) -> Result<(), FormatError> {
    let computed = algo.digest(bytes);
    if computed != stored {
        return Err(FormatError::TableChecksum {
            path: path.to_path_buf(),
            table,
            stored,
            computed,
        });
    }
    Ok(())
}

/// A writer's plan of a new store: geometry from the manifest, then the tail
/// and header once the record checksums are known.
#[derive(Debug, Clone)]
pub struct StoreWriterPlan {
    manifest: Manifest,
    manifest_bytes: Vec<u8>,
    header: Header,
}

impl StoreWriterPlan {
    /// Plan a store for `manifest` (validated here).
    pub fn new(manifest: Manifest) -> Result<Self, FormatError> {
        let path = Path::new("<new store>");
        manifest.validate(path)?;
        let manifest_bytes = manifest.to_bytes();
        let count = manifest.keys.len() as u64;
        let header = Header::plan(
            manifest.kind,
            count,
            manifest.record.payload_bytes,
            manifest_bytes.len() as u64,
        )
        .ok_or_else(|| FormatError::BadField {
            path: path.to_path_buf(),
            field: "record_count",
            value: count,
            why: "the store's size overflows u64",
        })?;
        header.validate_geometry(path)?;
        Ok(Self {
            manifest,
            manifest_bytes,
            header,
        })
    }

    /// The planned header (checksums of the tables not yet filled in).
    #[must_use]
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The manifest.
    #[must_use]
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Offset of record `index`, `None` when out of range.
    #[must_use]
    pub fn record_offset(&self, index: u64) -> Option<u64> {
        self.header.record_offset(index)
    }

    /// Where the tail (checksum table, manifest, padding) starts; 4096-aligned.
    #[must_use]
    pub fn tail_offset(&self) -> u64 {
        self.header.checksum_table_offset
    }

    /// Final length of the file.
    #[must_use]
    pub fn file_len(&self) -> u64 {
        self.header.file_len
    }

    fn check_sums(&self, sums: &[u64]) -> Result<(), FormatError> {
        if sums.len() as u64 == self.header.record_count {
            return Ok(());
        }
        Err(FormatError::ManifestMismatch {
            path: PathBuf::from("<new store>"),
            field: "keys",
            manifest: format!("{} keys", self.header.record_count),
            header: format!("{} record checksums", sums.len()),
        })
    }

    /// The tail bytes for record checksums `sums` (one per record, in order),
    /// zero-padded so that tail offset + length = file length.
    pub fn tail_bytes(&self, sums: &[u64]) -> Result<Vec<u8>, FormatError> {
        self.check_sums(sums)?;
        let mut tail = encode_table(sums);
        tail.extend_from_slice(&self.manifest_bytes);
        let len = self.header.file_len - self.tail_offset();
        tail.resize(usize::try_from(len).unwrap_or(usize::MAX), 0);
        Ok(tail)
    }

    /// The final header bytes for record checksums `sums`.
    pub fn header_bytes(&self, sums: &[u64]) -> Result<[u8; HEADER_BYTES], FormatError> {
        self.check_sums(sums)?;
        let mut h = self.header.clone();
        h.checksum_table_checksum = h.checksum_algo.digest(&encode_table(sums));
        h.manifest_checksum = h.checksum_algo.digest(&self.manifest_bytes);
        Ok(h.encode())
    }

    /// A whole store image in memory (tests, fixtures, small stores): each
    /// record's payload must be exactly `payload_bytes` long.
    pub fn image(&self, records: &[impl AsRef<[u8]>]) -> Result<Vec<u8>, FormatError> {
        let payload = self.header.payload_bytes;
        let mut sums = Vec::with_capacity(records.len());
        let mut out = vec![0u8; usize::try_from(self.tail_offset()).unwrap_or(usize::MAX)];
        for (i, r) in records.iter().enumerate() {
            let r = r.as_ref();
            let bad_len = r.len() as u64 != payload;
            let at = self.record_offset(i as u64).filter(|_| !bad_len);
            let Some(at) = at.and_then(|a| usize::try_from(a).ok()) else {
                return Err(FormatError::RecordLength {
                    path: PathBuf::from("<new store>"),
                    index: i as u64,
                    key: String::new(),
                    expected: payload,
                    got: r.len() as u64,
                });
            };
            out[at..at + r.len()].copy_from_slice(r);
            sums.push(self.header.checksum_algo.digest(r));
        }
        out.extend_from_slice(&self.tail_bytes(&sums)?);
        out[..HEADER_BYTES].copy_from_slice(&self.header_bytes(&sums)?);
        Ok(out)
    }
}
