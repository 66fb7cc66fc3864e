//! The safetensors reader refuses malformed checkpoints with typed errors.

use std::path::Path;

use flashtier_engine::checkpoint::files::{CheckpointError, CheckpointFiles};
use flashtier_format::OpenError;
use flashtier_io::IoError;

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
    let c = CheckpointFiles::open(d.path()).expect("open");
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
    let err = CheckpointFiles::open(d.path()).expect_err("short data");
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
    let err = CheckpointFiles::open(d.path()).expect_err("F32 needs 16 bytes");
    assert!(matches!(err, CheckpointError::BadTensor { .. }), "{err}");
}

#[test]
fn a_header_length_past_the_file_is_refused() {
    let d = tempfile::tempdir().expect("tempdir");
    std::fs::write(d.path().join("config.json"), "{}").expect("config");
    let mut bytes = 1_000_000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(d.path().join("model.safetensors"), bytes).expect("write");
    let err = CheckpointFiles::open(d.path()).expect_err("header length");
    assert!(matches!(err, CheckpointError::BadTensor { .. }), "{err}");
}

#[test]
fn malformed_json_and_missing_files_are_named() {
    let d = dir_with("{not json", 0);
    assert!(matches!(
        CheckpointFiles::open(d.path()),
        Err(CheckpointError::Json { .. })
    ));
    let d = tempfile::tempdir().expect("tempdir");
    std::fs::write(d.path().join("config.json"), "{}").expect("config");
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        r#"{"weight_map":{"a":"gone.safetensors"}}"#,
    )
    .expect("index");
    let err = CheckpointFiles::open(d.path()).expect_err("missing shard");
    assert!(
        matches!(err, CheckpointError::Storage(IoError::Open { ref path, .. }) if path.ends_with("gone.safetensors")),
        "{err}"
    );
    let err = CheckpointFiles::open(&d.path().join("nowhere")).expect_err("no config");
    assert!(
        matches!(err, CheckpointError::Open(OpenError::Os { ref path, .. }) if path.ends_with("config.json")),
        "{err}"
    );
}

/// `CheckpointFiles::open` on a thread, failing the test if it blocks.
fn open_at_once(dir: &Path) -> Result<CheckpointFiles, CheckpointError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(CheckpointFiles::open(&dir));
    });
    rx.recv_timeout(std::time::Duration::from_secs(5))
        .expect("CheckpointFiles::open blocked")
}

fn mkfifo(path: &Path) {
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        path,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .expect("mkfifo");
}

/// A FIFO given as config.json, as the index or as a safetensors file is
/// refused at once with a typed error naming it (the old reader blocked in
/// `open(2)` until a writer appeared).
#[test]
fn a_fifo_in_the_checkpoint_is_refused_at_once() {
    let header = r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}"#;
    let d = dir_with(header, 4);
    std::fs::remove_file(d.path().join("config.json")).expect("rm");
    mkfifo(&d.path().join("config.json"));
    let err = open_at_once(d.path()).expect_err("config FIFO");
    assert!(
        matches!(err, CheckpointError::Open(OpenError::NotRegular { ref path, what: "a FIFO (named pipe)" }) if path.ends_with("config.json")),
        "{err}"
    );

    let d = dir_with(header, 4);
    std::fs::remove_file(d.path().join("model.safetensors")).expect("rm");
    mkfifo(&d.path().join("model.safetensors"));
    let err = open_at_once(d.path()).expect_err("weights FIFO");
    assert!(
        matches!(err, CheckpointError::Storage(IoError::NotRegular { ref path, .. }) if path.ends_with("model.safetensors")),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("is a FIFO (named pipe), not a regular file"),
        "{err}"
    );

    let d = dir_with(header, 4);
    mkfifo(&d.path().join("model.safetensors.index.json"));
    let err = open_at_once(d.path()).expect_err("index FIFO");
    assert!(
        matches!(err, CheckpointError::Open(OpenError::NotRegular { ref path, .. }) if path.ends_with("model.safetensors.index.json")),
        "{err}"
    );
}

/// The synthesizer asks whether a folder holds its own checkpoint by
/// reading config.json: a FIFO there is no synthetic checkpoint, refused at
/// once (it used to wait for a writer), and the folder is left alone.
#[test]
fn a_fifo_config_is_no_synthetic_checkpoint() {
    let d = tempfile::tempdir().expect("tempdir");
    mkfifo(&d.path().join("config.json"));
    let (tx, rx) = std::sync::mpsc::channel();
    let dir = d.path().to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(flashtier_pack::synth::remove_synthetic(&dir));
    });
    let err = rx
        .recv_timeout(std::time::Duration::from_secs(5))
        .expect("remove_synthetic blocked on a FIFO")
        .expect_err("not synthetic");
    assert!(
        matches!(err, flashtier_pack::synth::SynthError::NotSynthetic { .. }),
        "{err}"
    );
    assert!(d.path().join("config.json").exists());
}

/// Tensor reads go through flashtier-io: a file truncated after it was
/// opened ends a read with a `ShortRead` naming the file, the tensor's
/// offset and length and the bytes that were there, buffered and direct.
#[test]
fn a_tensor_cut_short_after_opening_is_a_short_read_naming_the_range() {
    let header = r#"{"a":{"dtype":"U8","shape":[5000],"data_offsets":[0,5000]},"b":{"dtype":"U8","shape":[3000],"data_offsets":[5000,8000]}}"#;
    let d = dir_with(header, 8000);
    let c = CheckpointFiles::open(d.path()).expect("open");
    let b = c.tensor("b").expect("b").clone();
    let st = d.path().join("model.safetensors");
    let len = std::fs::metadata(&st).expect("meta").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&st)
        .and_then(|f| f.set_len(len - 1000))
        .expect("truncate");
    let mut dst = vec![0u8; 3000];
    let mut staging = flashtier_io::AlignedBuf::zeroed(0);
    let errs = [
        c.read_tensor("b", &mut dst).expect_err("buffered"),
        c.read_tensor_part_direct("b", 0, &mut dst, &mut staging)
            .expect_err("direct"),
    ];
    for err in errs {
        match err {
            CheckpointError::Storage(IoError::ShortRead {
                path,
                offset,
                len,
                got,
            }) => {
                assert!(path.ends_with("model.safetensors"));
                assert_eq!((offset, len, got), (b.offset, 3000, 2000));
            }
            other => panic!("expected a short read, got {other}"),
        }
    }
    // Bytes before the cut still read exactly, at any alignment.
    let mut part = vec![1u8; 1999];
    c.read_tensor_part_direct("b", 1, &mut part, &mut staging)
        .expect("direct part");
    assert!(part.iter().all(|&v| v == 0));
}

#[test]
fn overlapping_tensors_are_refused_naming_both() {
    // An expert tensor aliasing lm_head: bytes [8, 16) belong to both.
    let d = dir_with(
        r#"{"lm_head.weight":{"dtype":"BF16","shape":[2,4],"data_offsets":[0,16]},
            "model.layers.0.mlp.experts.0.down_proj.weight":{"dtype":"BF16","shape":[2,2],"data_offsets":[8,16]}}"#,
        16,
    );
    let err = CheckpointFiles::open(d.path()).expect_err("overlap");
    match &err {
        CheckpointError::OverlappingTensors {
            path,
            first,
            first_begin,
            first_end,
            second,
            second_begin,
            second_end,
        } => {
            assert!(path.ends_with("model.safetensors"));
            assert_eq!(
                (first.as_str(), *first_begin, *first_end),
                ("lm_head.weight", 0, 16)
            );
            assert_eq!(
                (second.as_str(), *second_begin, *second_end),
                ("model.layers.0.mlp.experts.0.down_proj.weight", 8, 16)
            );
        }
        other => panic!("not an overlap error: {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("lm_head.weight") && msg.contains("[0, 16)") && msg.contains("[8, 16)"),
        "{msg}"
    );
    // The same bytes claimed twice, in either header order.
    let d = dir_with(
        r#"{"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
        4,
    );
    let err = CheckpointFiles::open(d.path()).expect_err("same range twice");
    assert!(
        matches!(err, CheckpointError::OverlappingTensors { .. }),
        "{err}"
    );
}

#[test]
fn a_gap_between_tensors_is_refused() {
    // Four bytes of slack between two tensors: no safetensors writer leaves
    // them (the data section starts 8-aligned and tensors follow each other).
    let d = dir_with(
        r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]}}"#,
        12,
    );
    let err = CheckpointFiles::open(d.path()).expect_err("gap");
    match &err {
        CheckpointError::DataGap {
            before,
            after,
            begin,
            end,
            ..
        } => {
            assert_eq!((before.as_str(), after.as_str()), ("tensor a", "b"));
            assert_eq!((*begin, *end), (4, 8));
        }
        other => panic!("not a gap error: {other}"),
    }
    // A data section that does not start with a tensor.
    let d = dir_with(
        r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]}}"#,
        12,
    );
    let err = CheckpointFiles::open(d.path()).expect_err("leading gap");
    assert!(
        matches!(
            err,
            CheckpointError::DataGap {
                begin: 0,
                end: 8,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn trailing_bytes_after_the_last_tensor_are_refused() {
    let d = dir_with(
        r#"{"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#,
        16,
    );
    let err = CheckpointFiles::open(d.path()).expect_err("trailing");
    assert!(
        matches!(
            err,
            CheckpointError::TrailingData {
                covered: 8,
                data_len: 16,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn empty_tensors_on_a_boundary_and_any_header_order_are_accepted() {
    let d = dir_with(
        r#"{"z":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
        8,
    );
    let c = CheckpointFiles::open(d.path()).expect("open");
    assert_eq!(c.tensors().len(), 3);
    assert_eq!(c.tensor("e").expect("e").len_bytes, 0);
}

/// Every checkpoint transformers wrote for the fixtures (one of them in two
/// shards) and every synthetic family still opens under the tiling rule.
#[test]
fn real_fixtures_and_synthetic_checkpoints_open() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/engine");
    let mut opened = 0;
    for entry in std::fs::read_dir(&root).expect("fixtures") {
        let dir = entry.expect("entry").path();
        if dir.join("config.json").exists() {
            let c =
                CheckpointFiles::open(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            assert!(!c.tensors().is_empty());
            opened += 1;
        }
    }
    assert!(opened >= 7, "only {opened} fixtures found");
    use flashtier_format::Dtype;
    use flashtier_pack::synth::{SynthArch, SynthSpec, write_checkpoint};
    for arch in [
        SynthArch::Qwen3Moe,
        SynthArch::Qwen2Moe,
        SynthArch::Mixtral,
        SynthArch::DeepSeek,
    ] {
        for dtype in [Dtype::Bf16, Dtype::F8E4M3] {
            let tmp = tempfile::tempdir().expect("tempdir");
            let model = tmp.path().join("m");
            write_checkpoint(&SynthSpec::tiny(arch, dtype, 3), &model, &mut |_| {}).expect("synth");
            CheckpointFiles::open(&model).unwrap_or_else(|e| panic!("{arch:?} {dtype}: {e}"));
        }
    }
}
