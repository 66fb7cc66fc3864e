//! The house rules over the workspace's own crates: no file-level import
//! cycle, no source file past the length limit.

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
