//! Bad models and bad requests give typed errors naming what is at fault,
//! never a panic and never wrong output.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use crate::common;

use flashtier::experts::ExpertsError;
use flashtier_engine::checkpoint::Checkpoint;
use flashtier_engine::device::cpu::CpuDevice;
use flashtier_engine::load::{LoadOptions, cpu_experts};
use flashtier_engine::{EngineError, Model, ModelConfig};
use safetensors::tensor::{Dtype, TensorView};

use common::fixture;

/// Load `dir` with a throwaway store cache.
fn load(dir: &std::path::Path) -> Result<Model<CpuDevice>, EngineError> {
    let cache = tempfile::tempdir().unwrap();
    common::load(dir, cache.path())
}

/// A copy of the mixtral fixture whose tensors `edit` may change or drop.
fn edited_mixtral(
    mut edit: impl FnMut(&str, &mut Dtype, &mut Vec<usize>, &mut Vec<u8>) -> bool,
) -> tempfile::TempDir {
    let src = fixture("mixtral");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned = Vec::new();
    for (name, view) in st.iter() {
        let (mut dt, mut shape, mut data) =
            (view.dtype(), view.shape().to_vec(), view.data().to_vec());
        if edit(name, &mut dt, &mut shape, &mut data) {
            owned.push((name.to_string(), dt, shape, data));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(n, dt, s, d)| (n.clone(), TensorView::new(*dt, s.clone(), d).unwrap()))
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), out).unwrap();
    dir
}

#[test]
fn missing_tensor_is_named() {
    let dir = edited_mixtral(|n, _, _, _| n != "model.layers.1.self_attn.k_proj.weight");
    match load(dir.path()).unwrap_err() {
        EngineError::MissingTensor { name } => {
            assert_eq!(name, "model.layers.1.self_attn.k_proj.weight")
        }
        other => panic!("{other}"),
    }
    let dir =
        edited_mixtral(|n, _, _, _| n != "model.layers.2.block_sparse_moe.experts.5.w2.weight");
    // A missing expert tensor stops the packing of the store cache, naming it.
    match load(dir.path()).unwrap_err() {
        EngineError::Pack(e) => {
            let text = e.to_string();
            assert!(
                text.contains("block_sparse_moe.experts.5.w2.weight"),
                "{text}"
            );
        }
        other => panic!("{other}"),
    }
}

#[test]
fn wrong_shape_and_dtype_are_named() {
    let dir = edited_mixtral(|n, _, shape, _| {
        if n == "model.norm.weight" {
            *shape = vec![32, 2];
        }
        true
    });
    match load(dir.path()).unwrap_err() {
        EngineError::TensorShape { name, got, want } => {
            assert_eq!(
                (name.as_str(), got, want),
                ("model.norm.weight", vec![32u64, 2], vec![64u64])
            );
        }
        other => panic!("{other}"),
    }
    let dir = edited_mixtral(|n, dt, shape, data| {
        if n == "model.norm.weight" {
            *dt = Dtype::I16;
            *shape = vec![64];
            data.truncate(128);
        }
        true
    });
    match load(dir.path()).unwrap_err() {
        EngineError::TensorDtype { name, dtype } => {
            assert_eq!(
                (name.as_str(), dtype.as_str()),
                ("model.norm.weight", "I16")
            );
        }
        other => panic!("{other}"),
    }
}

#[test]
fn truncated_or_garbled_files_are_errors() {
    let src = fixture("mixtral");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let path = dir.path().join("model.safetensors");
    for cut in [4, 100, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = load(dir.path()).unwrap_err();
        assert!(
            matches!(err, EngineError::Checkpoint(_)),
            "cut {cut}: {err}"
        );
        assert!(err.to_string().contains("model.safetensors"), "{err}");
    }
    let mut garbled = bytes.clone();
    garbled[8] = b'[';
    std::fs::write(&path, &garbled).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(matches!(err, EngineError::Checkpoint(_)), "{err}");
    std::fs::remove_file(&path).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(matches!(err, EngineError::Checkpoint(_)), "{err}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}

/// Device shape errors spell the operands as plain text (the RoPE and
/// head-copy specs used to print as `RopeSpec { heads: 2, .. }`), and a
/// precision by its name.
#[test]
fn device_errors_carry_no_debug_text() {
    use flashtier_engine::device::{Device, HeadCopy, KvPrecision, KvSpec, RopeSpec};
    let dev = CpuDevice;
    let mut x = dev.zeros(2, 8).unwrap();
    let table = dev.rope_table(&[1.0, 0.5], 1.0, 16).unwrap();
    let spec = RopeSpec {
        heads: 2,
        head_stride: 4,
        offset: 0,
        dims: 6,
        interleaved: false,
    };
    let err = dev.rope(&mut x, &table, spec, 0).unwrap_err().to_string();
    assert_eq!(
        err,
        "rope: operands do not fit: 2 groups of 6 rotated columns (first at 0, 4 columns \
         apart) over 8 columns and 2 frequencies"
    );
    let src = dev.zeros(2, 8).unwrap();
    let mut dst = dev.zeros(3, 8).unwrap();
    let copy = HeadCopy {
        heads: 1,
        len: 4,
        src_stride: 0,
        src_offset: 0,
        dst_stride: 0,
        dst_offset: 2,
        scale: 1.0,
    };
    let err = dev
        .copy_heads(&mut dst, &src, copy)
        .unwrap_err()
        .to_string();
    assert!(
        err.ends_with(
            "1 heads of 4 columns (source from column 0 every 0, destination from column 2 \
             every 0) from 2x8 to 3x8"
        ),
        "{err}"
    );
    let kv = KvSpec {
        layers: 1,
        q_heads: 1,
        kv_heads: 1,
        head_dim: flashtier::kv::attention::MAX_HEAD_DIM,
        capacity: 4,
        precision: KvPrecision::Bf16x2,
    };
    let err = dev.kv_cache(&kv).unwrap_err().to_string();
    assert!(err.contains("stored as BF16 hi/lo pairs is"), "{err}");
    let err = EngineError::LowBitRecord {
        record: 3,
        precision: flashtier::experts::Precision::Q3,
    };
    assert!(
        err.to_string().starts_with("record 3 is a 3-bit copy"),
        "{err}"
    );
}

/// A FIFO as `config.json` fails the load at once, naming it (the config
/// reader used to block until a writer opened the pipe).
#[test]
fn a_fifo_config_fails_the_load_at_once() {
    let src = fixture("mixtral");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        src.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        dir.path().join("config.json"),
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let model = dir.path().to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(load(&model).map(|_| ()).map_err(|e| e.to_string()));
    });
    let err = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the load blocked on a FIFO config.json")
        .unwrap_err();
    assert!(err.contains("config.json is a FIFO (named pipe)"), "{err}");
}

#[test]
fn bad_requests_are_typed_errors() {
    let dir = fixture("mixtral");
    let mut model = load(&dir).unwrap();
    match model.forward(&[320], false).unwrap_err() {
        EngineError::TokenOutOfRange { id, vocab } => assert_eq!((id, vocab), (320, 320)),
        other => panic!("{other}"),
    }
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let report = common::pack(&dir, tmp.path());
    // One record fits, a step needs two: the pool says so.
    let opts = LoadOptions::store(&report.out).budget(2 * report.stride_bytes - 1);
    let experts = cpu_experts(&cfg, &ckpt, &report.out, &opts).unwrap();
    let mut m = Model::new(CpuDevice, &cfg, &ckpt, experts).unwrap();
    match m.forward(&[5], false).unwrap_err() {
        EngineError::Pool(ExpertsError::PoolTooSmall { capacity, needed }) => {
            assert_eq!((capacity, needed), (1, 2))
        }
        other => panic!("{other}"),
    }
    // The context limit is checked for the whole request, up front.
    let mut small = cfg.clone();
    small.max_positions = 3;
    let experts =
        cpu_experts(&small, &ckpt, &report.out, &LoadOptions::store(&report.out)).unwrap();
    let mut m = Model::new(CpuDevice, &small, &ckpt, experts).unwrap();
    let before = m.expert_stats();
    let err = m.generate(&[1, 2, 3], 4, &[], false, |_| {}).unwrap_err();
    assert!(
        matches!(err, EngineError::ContextFull { len: 6, max: 3 }),
        "{err}"
    );
    assert_eq!(m.expert_stats(), before, "nothing ran before the refusal");
    // Exactly at the limit it runs: 3 prompt tokens, 1 new token.
    let ok = m.generate(&[1, 2, 3], 1, &[], false, |_| {}).unwrap();
    assert_eq!(ok.generated_ids.len(), 1);
}

/// `ModelConfig::from_file` called directly (not behind a checkpoint open)
/// refuses a FIFO at once instead of waiting for a writer.
#[test]
fn config_from_a_fifo_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &path,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(
            flashtier_engine::config::ModelConfig::from_file(&path)
                .map(|_| ())
                .map_err(|e| e.to_string()),
        );
    });
    let err = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("from_file blocked on a FIFO")
        .unwrap_err();
    assert!(err.contains("is a FIFO (named pipe)"), "{err}");
}
