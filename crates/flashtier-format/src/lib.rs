//! On-disk formats of flashtier.
//!
//! Everything here is pure: no `unsafe`, no syscalls, and every on-disk
//! integer is fixed-width little-endian. Parsers validate every field before
//! any byte of a record is served, and each failure is its own typed error
//! naming the file and the field.
#![forbid(unsafe_code)]

pub mod checksum;
pub mod error;
pub mod group;
pub mod header;
pub mod kv_header;
pub mod manifest;
pub mod row_shard;
pub mod store;
