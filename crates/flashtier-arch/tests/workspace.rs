//! The house rules over the workspace's own crates: no file-level import
//! cycle, and the engine's families written over the device seam.

use std::path::{Path, PathBuf};

fn crates() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("crates folder")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("Cargo.toml").is_file() && p.join("src").is_dir())
        .collect();
    found.sort();
    assert!(found.len() >= 9, "found only {found:?}");
    found
}

#[test]
fn no_crate_has_a_file_level_import_cycle() {
    let mut report = String::new();
    for dir in crates() {
        for cycle in flashtier_arch::cycles(&dir).expect("readable crate") {
            let files: Vec<String> = cycle
                .files
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            report.push_str(&format!("{}: {}\n", dir.display(), files.join(" <-> ")));
            for (from, to) in &cycle.edges {
                report.push_str(&format!("    {} -> {}\n", from.display(), to.display()));
            }
        }
    }
    assert!(report.is_empty(), "import cycles between files:\n{report}");
}

/// A model family is written once over the `Device` trait: its files may
/// name the CPU device itself (`device/cpu/mod.rs`, e.g. as a default type
/// parameter) but none of the CPU device's kernels or internals, which the
/// GPU path would then not share.
#[test]
fn no_family_file_reaches_into_the_cpu_device() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../flashtier-engine");
    let edges = flashtier_arch::imports(&dir).expect("readable crate");
    assert!(
        edges.iter().any(|(from, _)| from.starts_with("src/family")),
        "the engine's family files name nothing: the edge reader is broken"
    );
    let bad: Vec<String> = edges
        .iter()
        .filter(|(from, to)| {
            from.starts_with("src/family")
                && to.starts_with("src/device/cpu")
                && to != Path::new("src/device/cpu/mod.rs")
        })
        .map(|(from, to)| format!("{} -> {}", from.display(), to.display()))
        .collect();
    assert!(
        bad.is_empty(),
        "family files using CPU internals:\n{}",
        bad.join("\n")
    );
}
