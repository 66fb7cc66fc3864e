//! Source checks that `cargo test` runs over the workspace.
//!
//! **Import cycles between files.** A crate's files are the nodes; file A
//! has an edge to file B when a path in A (a `use`, or a path in code)
//! resolves, through any re-exports, to an item B defines. Not edges: `mod`
//! declarations and re-exports (`pub use`), which shape a module's
//! interface; a module's file and its own descendants' files (a `mod.rs`
//! and the files of its folder are one unit); code under `#[cfg(test)]`,
//! which may reach into any file. A strongly connected set of two or more
//! files is a cycle ([`cycles`]); the house rule is none. The same edges
//! ([`imports`]) carry layering rules, e.g. the engine's model families
//! use the CPU device only through its public face.
//!
//! The module tree is read as rustc reads it ([`tree::ModuleTree`]): from
//! `src/lib.rs` and `src/main.rs`, through `mod name;` to `name.rs` or
//! `name/mod.rs` (or a `#[path]`), with inline `mod name { .. }` blocks
//! keeping their file. Paths inside macro invocations are not seen (the
//! compiler would not resolve them at this stage either).

mod graph;
mod refs;
mod scope;
pub mod tree;

use std::path::{Path, PathBuf};

pub use graph::strongly_connected;
pub use tree::ModuleTree;

/// What can stop a check from reading a crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ArchError {
    /// A source file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A source file is not valid Rust.
    #[error("parsing {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// syn's message.
        message: String,
    },
    /// A `mod name;` names a file that is not there.
    #[error("{path}: `mod {name};` has no file (looked for {tried:?})")]
    MissingModule {
        /// The declaring file.
        path: PathBuf,
        /// The module's name.
        name: String,
        /// The candidates looked for.
        tried: Vec<PathBuf>,
    },
    /// The crate has neither `src/lib.rs` nor `src/main.rs`.
    #[error("{0}: no src/lib.rs or src/main.rs")]
    NoRoot(PathBuf),
}

/// A file-level import cycle: its files and the edges among them.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cycle {
    /// The files (relative to the crate folder, sorted).
    pub files: Vec<PathBuf>,
    /// Each edge between two of them: (the file that names, the file that
    /// defines), sorted.
    pub edges: Vec<(PathBuf, PathBuf)>,
}

/// The file-level import cycles of the crate at `crate_dir`, sorted.
pub fn cycles(crate_dir: &Path) -> Result<Vec<Cycle>, ArchError> {
    let tree = ModuleTree::read(crate_dir)?;
    let edges = refs::file_edges(&tree);
    let name = |i: usize| relative(crate_dir, &tree.files()[i]);
    let mut found: Vec<Cycle> = strongly_connected(tree.files().len(), &edges)
        .into_iter()
        .filter(|set| set.len() > 1)
        .map(|set| {
            let mut files: Vec<PathBuf> = set.iter().map(|&i| name(i)).collect();
            files.sort();
            let mut inner: Vec<(PathBuf, PathBuf)> = edges
                .iter()
                .filter(|(a, b)| set.contains(a) && set.contains(b))
                .map(|&(a, b)| (name(a), name(b)))
                .collect();
            inner.sort();
            Cycle {
                files,
                edges: inner,
            }
        })
        .collect();
    found.sort();
    Ok(found)
}

/// Every file-level edge of the crate at `crate_dir` (as [`cycles`] counts
/// them): (the file that names, the file that defines), relative to the
/// crate folder, sorted. Layering rules ("no file under A names a file
/// under B") are checks over this list.
pub fn imports(crate_dir: &Path) -> Result<Vec<(PathBuf, PathBuf)>, ArchError> {
    let tree = ModuleTree::read(crate_dir)?;
    let name = |i: usize| relative(crate_dir, &tree.files()[i]);
    let mut found: Vec<(PathBuf, PathBuf)> = refs::file_edges(&tree)
        .into_iter()
        .map(|(a, b)| (name(a), name(b)))
        .collect();
    found.sort();
    Ok(found)
}

fn read(path: &Path) -> Result<String, ArchError> {
    std::fs::read_to_string(path).map_err(|source| ArchError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn relative(base: &Path, path: &Path) -> PathBuf {
    path.strip_prefix(base).unwrap_or(path).to_path_buf()
}
