//! The expert tier (in progress).

mod list;
pub mod policy;
pub mod sim;
pub mod trace;
pub mod tracegen;
