//! On-disk formats of flashtier.
//!
//! Everything here is pure: no `unsafe`, no syscalls beyond opening a
//! regular file ([`regular`]: never a FIFO or a device) and `std::fs` reads
//! of a store's header and tables, and every on-disk integer is fixed-width
//! little-endian. Parsers validate every field before any byte of a record is
//! served, and each failure is its own typed error naming the file and the
//! field. The store format v1 is documented byte by byte in `docs/format.md`.
//!
//! ```
//! use flashtier_format::{Dtype, Manifest, RecordKey, StoreKind, StoreWriterPlan, Store};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Plan a two-record expert store, write it to memory, read it back.
//! let manifest = Manifest::single_tensor(StoreKind::Experts, Dtype::U8, 100, vec![RecordKey::new(0, 0), RecordKey::new(0, 1)]);
//! let plan = StoreWriterPlan::new(manifest)?;
//! let records = [vec![1u8; 100], vec![2u8; 100]];
//! let image = plan.image(&records)?;
//! let store = Store::from_bytes("mem.ftstore".as_ref(), &image)?;
//! let i = store.index_of(RecordKey::new(0, 1))?;
//! let off = store.record_offset(i)? as usize;
//! let payload = &image[off..off + store.payload_bytes() as usize];
//! store.verify_record(i, payload)?;
//! assert_eq!(payload, &records[1][..]);
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub mod checksum;
pub mod error;
pub mod fp8;
pub mod header;
pub mod kind;
pub mod kv;
mod le;
pub mod manifest;
pub mod regular;
pub mod row_shard;
pub mod safetensors;
pub mod splitmix;
pub mod store;
pub mod text;
pub mod widen;

pub use checksum::{ChecksumAlgo, Xxh3Stream, xxh3_64};
pub use error::FormatError;
pub use header::{ALIGN_BYTES, FORMAT_VERSION, HEADER_BYTES, Header, MAGIC, StoreKind};
pub use kind::{FileKind, UnknownKind};
pub use manifest::{
    Dtype, Manifest, ModelInfo, RecordKey, RecordLayout, SourceCheckpoint, SourceFile, TensorLayout,
};
pub use regular::{OpenError, open_regular, open_regular_read};
pub use store::{ByteSource, Store, StoreWriterPlan};
