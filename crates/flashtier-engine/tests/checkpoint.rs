//! The safetensors reader refuses malformed checkpoints with typed errors.

use std::path::Path;

use flashtier_engine::source::{Checkpoint, CheckpointError};

fn write_st(dir: &Path, name: &str, header: &str, data_len: usize) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + data_len, 0);
    std::fs::write(dir.join(name), bytes).expect("write");
}

fn dir_with(header: &str, data_len: usize) -> tempfile::TempDir {
    let d = tempfile::tempdir().expect("tempdir");
    std::fs::write(d.path().join("config.json"), "{}").expect("config");
    write_st(d.path(), "model.safetensors", header, data_len);
    d
}

#[test]
fn a_well_formed_file_reads_back() {
    let d = dir_with(
        r#"{"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}}"#,
        8,
    );
    let c = Checkpoint::open(d.path()).expect("open");
    let mut buf = [1u8; 8];
    c.read_tensor("a", &mut buf).expect("read");
    assert_eq!(buf, [0u8; 8]);
    assert!(matches!(
        c.read_tensor("a", &mut [0u8; 4]),
        Err(CheckpointError::BufferSize { .. })
    ));
    assert!(matches!(
        c.tensor("b"),
        Err(CheckpointError::MissingTensor { .. })
    ));
}

#[test]
fn offsets_past_the_file_are_refused() {
    let d = dir_with(
        r#"{"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#,
        4,
    );
    let err = Checkpoint::open(d.path()).expect_err("short data");
    assert!(
        matches!(err, CheckpointError::BadTensor { ref tensor, .. } if tensor == "a"),
        "{err}"
    );
}

#[test]
fn a_length_that_disagrees_with_the_shape_is_refused() {
    let d = dir_with(
        r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,8]}}"#,
        8,
    );
    let err = Checkpoint::open(d.path()).expect_err("F32 needs 16 bytes");
    assert!(matches!(err, CheckpointError::BadTensor { .. }), "{err}");
}

#[test]
fn a_header_length_past_the_file_is_refused() {
    let d = tempfile::tempdir().expect("tempdir");
    std::fs::write(d.path().join("config.json"), "{}").expect("config");
    let mut bytes = 1_000_000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(d.path().join("model.safetensors"), bytes).expect("write");
    let err = Checkpoint::open(d.path()).expect_err("header length");
    assert!(matches!(err, CheckpointError::BadTensor { .. }), "{err}");
}

#[test]
fn malformed_json_and_missing_files_are_named() {
    let d = dir_with("{not json", 0);
    assert!(matches!(
        Checkpoint::open(d.path()),
        Err(CheckpointError::Json { .. })
    ));
    let d = tempfile::tempdir().expect("tempdir");
    std::fs::write(d.path().join("config.json"), "{}").expect("config");
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        r#"{"weight_map":{"a":"gone.safetensors"}}"#,
    )
    .expect("index");
    let err = Checkpoint::open(d.path()).expect_err("missing shard");
    assert!(
        matches!(err, CheckpointError::Io { ref path, .. } if path.ends_with("gone.safetensors")),
        "{err}"
    );
    let err = Checkpoint::open(&d.path().join("nowhere")).expect_err("no config");
    assert!(matches!(err, CheckpointError::Io { .. }), "{err}");
}
