//! The persist module's guarantees on a real file system: one writer at a
//! time per output, readers never see a partial file, and no temp or lock
//! file survives a commit, an error, a panic or a failed rename.
#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed setup step must fail the test loudly"
)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use flashtier_io::persist::{
    Existing, FileKind, Output, PersistError, Wait, refuse_inputs, write_file,
};

const KIND: FileKind = FileKind {
    name: "test file",
    magic: b"TESTMAG1",
};

/// Names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn write_via(out: &mut Output, bytes: &[u8]) -> PathBuf {
    let tmp = out.create_temp().unwrap().to_path_buf();
    std::fs::write(&tmp, bytes).unwrap();
    tmp
}

#[test]
fn concurrent_writers_run_one_at_a_time_and_the_output_is_one_of_them_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.bin");
    let inside = AtomicUsize::new(0);
    let most = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for w in 0u8..4 {
            let (path, inside, most) = (&path, &inside, &most);
            s.spawn(move || {
                let mut out = Output::lock(path, Wait::Block).unwrap();
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                out.existing(KIND).unwrap();
                let tmp = out.create_temp().unwrap().to_path_buf();
                let mut f = std::fs::OpenOptions::new().write(true).open(&tmp).unwrap();
                f.write_all(b"TESTMAG1").unwrap();
                std::thread::sleep(Duration::from_millis(20));
                f.write_all(&[w; 4096]).unwrap();
                drop(f);
                inside.fetch_sub(1, Ordering::SeqCst);
                out.commit().unwrap();
            });
        }
    });
    assert_eq!(most.load(Ordering::SeqCst), 1, "two writers held the lock");
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len(), 8 + 4096);
    assert!(bytes[8..].iter().all(|&b| b == bytes[8]), "interleaved");
    assert_eq!(names(dir.path()), ["out.bin"]);
}

#[test]
fn a_writer_that_asks_not_to_wait_gets_busy() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.bin");
    let held = Output::lock(&path, Wait::Block).unwrap();
    let err = Output::lock(&path, Wait::Fail).unwrap_err();
    assert!(matches!(err, PersistError::Busy { .. }), "{err}");
    assert!(err.to_string().contains("out.bin"), "{err}");
    drop(held);
    let again = Output::lock(&path, Wait::Fail).unwrap();
    drop(again);
    assert!(names(dir.path()).is_empty());
}

#[test]
fn an_output_dropped_or_unwound_before_commit_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.bin");
    let mut out = Output::lock(&path, Wait::Block).unwrap();
    let tmp = write_via(&mut out, b"TESTMAG1 partial");
    assert!(tmp.exists());
    drop(out);
    assert!(names(dir.path()).is_empty());
    let unwound = std::panic::catch_unwind(|| {
        let mut out = Output::lock(&path, Wait::Block).unwrap();
        write_via(&mut out, b"TESTMAG1 partial");
        panic!("writer failed midway");
    });
    assert!(unwound.is_err());
    assert!(names(dir.path()).is_empty(), "{:?}", names(dir.path()));
}

#[test]
fn a_failed_rename_removes_the_temp_file_and_keeps_what_was_there() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.bin");
    let mut out = Output::lock(&path, Wait::Block).unwrap();
    write_via(&mut out, b"TESTMAG1 new");
    // Something else puts a non-empty folder at the output: rename fails.
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("keep"), b"x").unwrap();
    let err = out.commit().unwrap_err();
    assert!(matches!(err, PersistError::Rename { .. }), "{err}");
    assert_eq!(names(dir.path()), ["out.bin"]);
    assert_eq!(names(&path), ["keep"]);
}

#[test]
fn only_absent_outputs_and_files_of_the_kind_may_be_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.bin");
    let out = Output::lock(&path, Wait::Block).unwrap();
    assert_eq!(out.existing(KIND).unwrap(), Existing::Absent);
    std::fs::write(&path, b"TESTMAG1 older").unwrap();
    assert_eq!(out.existing(KIND).unwrap(), Existing::SameKind);
    for bytes in [&b"notes, not a test file"[..], b"TEST", b""] {
        std::fs::write(&path, bytes).unwrap();
        let err = out.existing(KIND).unwrap_err();
        assert!(matches!(err, PersistError::NotReplaceable { .. }), "{err}");
        assert!(err.to_string().contains("out.bin"), "{err}");
        assert!(err.to_string().contains("TESTMAG1"), "{err}");
    }
    drop(out);
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    let out = Output::lock(&path, Wait::Block).unwrap();
    let err = out.existing(KIND).unwrap_err();
    assert!(err.to_string().contains("directory"), "{err}");
}

#[test]
fn outputs_that_resolve_to_an_input_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("model.safetensors");
    std::fs::write(&input, b"weights").unwrap();
    let inputs = [input.clone()];
    let sym = dir.path().join("sym");
    std::os::unix::fs::symlink(&input, &sym).unwrap();
    let hard = dir.path().join("hard");
    std::fs::hard_link(&input, &hard).unwrap();
    let dotted = dir.path().join(".").join("model.safetensors");
    for (out, how) in [
        (&input, "it is /"),
        (&dotted, "it is /"),
        (&sym, "it is a symlink to"),
        (&hard, "it is a hard link to"),
    ] {
        let err = refuse_inputs(out, &inputs).unwrap_err();
        assert!(matches!(err, PersistError::OutputIsInput { .. }), "{err}");
        assert!(err.to_string().contains(how), "{err}");
        assert!(err.to_string().contains("model.safetensors"), "{err}");
    }
    refuse_inputs(&dir.path().join("experts.ftstore"), &inputs).unwrap();
    assert_eq!(std::fs::read(&input).unwrap(), b"weights");
}

#[test]
fn a_symlinked_output_is_written_at_its_target() {
    let dir = tempfile::tempdir().unwrap();
    let far = dir.path().join("far");
    std::fs::create_dir(&far).unwrap();
    let link = dir.path().join("out.bin");
    std::os::unix::fs::symlink(far.join("real.bin"), &link).unwrap();
    let err = Output::lock(&link, Wait::Block).unwrap_err();
    assert!(
        matches!(err, PersistError::Resolve { .. }),
        "dangling: {err}"
    );
    std::fs::write(far.join("real.bin"), b"TESTMAG1 old").unwrap();
    let mut out = Output::lock(&link, Wait::Block).unwrap();
    assert_eq!(out.target(), far.join("real.bin").canonicalize().unwrap());
    write_via(&mut out, b"TESTMAG1 new");
    out.commit().unwrap();
    assert!(link.symlink_metadata().unwrap().is_symlink());
    assert_eq!(std::fs::read(&link).unwrap(), b"TESTMAG1 new");
    assert_eq!(names(&far), ["real.bin"]);
}

#[test]
fn stale_temp_files_of_killed_writers_are_removed_under_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.bin");
    for name in [
        ".out.bin.aB3xY9.tmp",
        ".out.bin.x.aB3xY9.tmp",
        "out.bin.tmp",
    ] {
        std::fs::write(dir.path().join(name), b"stale").unwrap();
    }
    let out = Output::lock(&path, Wait::Block).unwrap();
    drop(out);
    // Only the exact temp pattern of this output is touched.
    assert_eq!(names(dir.path()), [".out.bin.x.aB3xY9.tmp", "out.bin.tmp"]);
}

#[test]
fn commit_without_a_temp_file_is_an_error_not_an_empty_output() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.bin");
    let out = Output::lock(&path, Wait::Block).unwrap();
    let err = out.commit().unwrap_err();
    assert!(matches!(err, PersistError::NoTemp { .. }), "{err}");
    assert!(names(dir.path()).is_empty());
}

#[test]
fn write_file_replaces_the_whole_file_and_leaves_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("logits.json");
    write_file(&path, b"{\"a\": 1}", Wait::Block).unwrap();
    write_file(&path, b"{}", Wait::Block).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"{}");
    assert_eq!(names(dir.path()), ["logits.json"]);
    let err = write_file(&dir.path().join("missing/x.json"), b"{}", Wait::Block).unwrap_err();
    assert!(matches!(err, PersistError::Resolve { .. }), "{err}");
}
