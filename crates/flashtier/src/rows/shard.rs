//! Reading a packed shard's header and checksum table and pinning owned
//! scales, each a single read through the backend
//! ([`crate::verify::read_extent`]): the one-time loads behind
//! `set_range`, `attach_packed` and `open_packed`.

use std::sync::Arc;

use flashtier_format::row_shard::{ROW_SHARD_HEADER_BYTES, RowShardError, RowShardHeader};
use flashtier_io::{StorageBackend, StoreFile};

use crate::rows::RowError;
use crate::rows::backing::{Packed, SourceFiles};
use crate::rows::state::PinnedScales;
use crate::verify::read_extent;

pub(crate) fn read_header(
    backend: &dyn StorageBackend,
    file: &Arc<StoreFile>,
) -> Result<RowShardHeader, RowError> {
    let len = file.len_bytes()?;
    if len < u64::from(ROW_SHARD_HEADER_BYTES) {
        return Err(RowShardError::TooShort {
            path: file.path().to_path_buf(),
            len_bytes: len,
        }
        .into());
    }
    let buf = read_extent(backend, file, 0, ROW_SHARD_HEADER_BYTES as usize)?;
    Ok(RowShardHeader::decode(file.path(), &buf)?)
}

pub(crate) fn load_packed(
    backend: &dyn StorageBackend,
    file: Arc<StoreFile>,
    header: RowShardHeader,
    expected: Option<&RowShardHeader>,
) -> Result<Packed, RowError> {
    if let Some(e) = expected {
        header.expect(file.path(), e)?;
    }
    header.check_len(file.path(), file.len_bytes()?)?;
    let region = usize::try_from(header.checksum_region_bytes())
        .map_err(|_| RowError::Config("checksum table too large".into()))?;
    let checksums = if region == 0 {
        Vec::new()
    } else {
        let buf = read_extent(backend, &file, header.checksum_offset(), region)?;
        header.decode_checksums(file.path(), &buf)?
    };
    Ok(Packed::new(file, header, checksums))
}

/// Read the scales of rows `[lo, hi)` into RAM, in bounded 8 MiB reads.
pub(crate) fn pin_scales(
    backend: &dyn StorageBackend,
    src: &SourceFiles,
    lo: u64,
    hi: u64,
) -> Result<PinnedScales, RowError> {
    const CHUNK_BYTES: u64 = 8 << 20;
    let s = u64::from(src.table().geometry.scale_bytes);
    let start = src.scale_offset(lo);
    let total = (hi - lo) * s;
    let mut out = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
    let mut done = 0u64;
    while done < total {
        let n = (total - done).min(CHUNK_BYTES) as usize;
        let buf = read_extent(backend, src.scales(), start + done, n)?;
        out.extend_from_slice(&buf[..n]);
        done += n as u64;
    }
    Ok(PinnedScales::new(lo, s as usize, out))
}
