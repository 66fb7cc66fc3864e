//! Helpers shared by the CLI's tests of `flashtier run`.
#![allow(dead_code, reason = "each test binary uses its own subset")]
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use std::path::{Path, PathBuf};

use serde_json::Value;

/// An engine fixture folder.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../flashtier-engine/tests/fixtures/engine")
        .join(name)
}

/// The fixture's `reference.json`.
pub fn reference(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

/// The ids of `key` in `r`, comma-separated.
pub fn ids(r: &Value, key: &str) -> String {
    let ids: Vec<String> = r[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    ids.join(",")
}
