//! The cycle check on small crates written for the purpose: what is a
//! cycle, and what the house rule lets pass.

use std::path::{Path, PathBuf};

fn write_crate(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for (path, text) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    }
    dir
}

fn cycles(dir: &Path) -> Vec<Vec<PathBuf>> {
    flashtier_arch::cycles(dir)
        .expect("readable")
        .into_iter()
        .map(|c| c.files)
        .collect()
}

#[test]
fn two_siblings_naming_each_other_are_a_cycle() {
    let dir = write_crate(&[
        ("src/lib.rs", "mod a;\nmod b;\n"),
        ("src/a.rs", "use crate::b::B;\npub struct A(B);\n"),
        (
            "src/b.rs",
            "pub struct B;\npub fn f() -> crate::a::A { todo!() }\n",
        ),
    ]);
    assert_eq!(
        cycles(dir.path()),
        vec![vec![PathBuf::from("src/a.rs"), PathBuf::from("src/b.rs")]]
    );
}

#[test]
fn a_path_through_a_reexport_reaches_the_defining_file() {
    // a -> (kv re-exports header's H) -> header -> a: a cycle through the
    // folder's mod.rs, which itself is not part of it.
    let dir = write_crate(&[
        ("src/lib.rs", "mod a;\nmod kv;\n"),
        (
            "src/a.rs",
            "use crate::kv::H;\npub struct A;\nfn g(_: H) {}\n",
        ),
        ("src/kv/mod.rs", "mod header;\npub use header::H;\n"),
        ("src/kv/header.rs", "pub struct H(crate::a::A);\n"),
    ]);
    assert_eq!(
        cycles(dir.path()),
        vec![vec![
            PathBuf::from("src/a.rs"),
            PathBuf::from("src/kv/header.rs")
        ]]
    );
}

#[test]
fn a_module_and_its_own_files_tests_and_other_crates_pass() {
    let dir = write_crate(&[
        (
            "src/lib.rs",
            "mod kv;\nmod b;\nuse std::fmt;\n#[cfg(test)]\nmod tests { use crate::b::*; }\n",
        ),
        (
            "src/kv/mod.rs",
            "mod group;\npub struct Geometry;\nfn f(_: group::G) {}\n",
        ),
        ("src/kv/group.rs", "pub struct G(super::Geometry);\n"),
        (
            "src/b.rs",
            "pub struct B;\n#[cfg(test)]\nmod tests { use crate::kv::Geometry; }\n",
        ),
    ]);
    assert!(cycles(dir.path()).is_empty());
}

#[test]
fn a_missing_module_file_is_named() {
    let dir = write_crate(&[("src/lib.rs", "mod gone;\n")]);
    let err = flashtier_arch::cycles(dir.path()).unwrap_err();
    assert!(err.to_string().contains("mod gone;"), "{err}");
}
