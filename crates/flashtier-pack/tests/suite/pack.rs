//! Pack then read: every record's tensors are byte-identical to the source
//! tensors (read back with the independent `safetensors` crate), for every
//! layout family and dtype; bad checkpoints give their typed errors.

use std::collections::HashMap;
use std::path::Path;

use flashtier_engine::checkpoint::files::CheckpointFiles;
use flashtier_engine::store::{PackError, check_pairing, source_name};
use flashtier_format::{Dtype, RecordKey, Store};
use flashtier_pack::pack::{PackOptions, pack_experts};
use flashtier_pack::synth::{SynthArch, SynthSpec, write_checkpoint};
use safetensors::SafeTensors;

/// Every tensor of a checkpoint folder, read with the `safetensors` crate.
fn source_tensors(dir: &Path) -> HashMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = HashMap::new();
    for entry in std::fs::read_dir(dir).expect("dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).expect("read");
            let st = SafeTensors::deserialize(&bytes).expect("parse");
            for (name, view) in st.tensors() {
                let dtype = format!("{:?}", view.dtype());
                out.insert(name, (dtype, view.shape().to_vec(), view.data().to_vec()));
            }
        }
    }
    out
}

fn pack_and_compare(spec: &SynthSpec) {
    pack_and_compare_with(spec, false);
}

fn pack_and_compare_with(spec: &SynthSpec, direct_source: bool) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    write_checkpoint(spec, &model, &mut |_| {}).expect("synth");
    let out = tmp.path().join("experts.ftstore");
    let mut opts = PackOptions::new(&model, &out);
    opts.depth = 2;
    opts.writers = 2;
    opts.direct_source = direct_source;
    let report = pack_experts(&opts, &|_| {}).expect("pack");
    let store = Store::open(&out).expect("open store");
    let moe_layers: Vec<u32> = match spec.arch {
        SynthArch::DeepSeek => (1..spec.layers).collect(),
        _ => (0..spec.layers).collect(),
    };
    assert_eq!(
        store.record_count(),
        (moe_layers.len() as u32 * spec.experts) as u64
    );
    assert_eq!(report.records, store.record_count());
    assert_eq!(store.manifest().dtype, spec.dtype);
    let src = source_tensors(&model);
    let image = std::fs::read(&out).expect("read store");
    let template = store
        .manifest()
        .source
        .as_ref()
        .expect("source")
        .tensor_prefix
        .clone();
    let mut compared = 0;
    for &layer in &moe_layers {
        for e in 0..spec.experts {
            let i = store.index_of(RecordKey::new(layer, e)).expect("key");
            let mut rec = vec![0u8; store.payload_bytes() as usize];
            store
                .read_record(&image[..], i, &mut rec)
                .expect("record verifies");
            for t in store.tensors() {
                let name = source_name(&template, RecordKey::new(layer, e), &t.name);
                let (dtype, shape, data) = &src[&name];
                assert_eq!(dtype.as_str(), t.dtype.name(), "{name}");
                assert_eq!(
                    shape.iter().map(|&d| d as u64).collect::<Vec<_>>(),
                    t.shape,
                    "{name}"
                );
                let got = &rec[t.offset as usize..(t.offset + t.len_bytes) as usize];
                assert!(
                    got == &data[..],
                    "{name}: packed bytes differ from the source"
                );
                compared += 1;
            }
        }
    }
    let per_record = if spec.dtype == Dtype::F8E4M3 { 6 } else { 3 };
    assert_eq!(compared, store.record_count() as usize * per_record);
    // Shared experts and dense MLPs are not in the store.
    assert!(store.tensors().iter().all(|t| !t.name.contains("shared")));
    check_pairing(&store, &CheckpointFiles::open(&model).expect("ckpt")).expect("pairs");
}

fn every_dtype_packs_byte_identical(arch: SynthArch) {
    for dtype in [Dtype::Bf16, Dtype::F16, Dtype::F32, Dtype::F8E4M3] {
        let mut spec = SynthSpec::tiny(arch, dtype, 7);
        spec.layers = 3;
        pack_and_compare(&spec);
    }
}

#[test]
fn qwen3_moe_packs_byte_identical_in_every_dtype() {
    every_dtype_packs_byte_identical(SynthArch::Qwen3Moe);
}

#[test]
fn qwen2_moe_packs_byte_identical_in_every_dtype() {
    every_dtype_packs_byte_identical(SynthArch::Qwen2Moe);
}

#[test]
fn mixtral_packs_byte_identical_in_every_dtype() {
    every_dtype_packs_byte_identical(SynthArch::Mixtral);
}

#[test]
fn deepseek_packs_byte_identical_in_every_dtype() {
    every_dtype_packs_byte_identical(SynthArch::DeepSeek);
}

#[test]
fn direct_checkpoint_reads_pack_byte_identical() {
    // Tensors at unaligned offsets, the last one ending at an unaligned end
    // of file: the direct path reads aligned windows and copies them out.
    pack_and_compare_with(
        &SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::F8E4M3, 5),
        true,
    );
    pack_and_compare_with(&SynthSpec::tiny(SynthArch::Mixtral, Dtype::F32, 6), true);
}

#[test]
fn single_file_checkpoints_pack() {
    let mut spec = SynthSpec::tiny(SynthArch::Mixtral, Dtype::Bf16, 3);
    spec.shards = 1;
    pack_and_compare(&spec);
}

#[test]
fn a_store_paired_with_another_checkpoint_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    write_checkpoint(
        &SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::Bf16, 1),
        &a,
        &mut |_| {},
    )
    .expect("a");
    let mut other = SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::Bf16, 1);
    other.vocab = 256;
    write_checkpoint(&other, &b, &mut |_| {}).expect("b");
    let out = tmp.path().join("a.ftstore");
    pack_experts(&PackOptions::new(&a, &out), &|_| {}).expect("pack");
    let store = Store::open(&out).expect("open");
    let err = check_pairing(&store, &CheckpointFiles::open(&b).expect("b")).expect_err("mismatch");
    assert!(matches!(err, PackError::SourceMismatch { .. }), "{err}");
}

/// Write a one-file checkpoint from `(name, dtype, shape)` with zero bytes.
fn raw_checkpoint(
    dir: &Path,
    config: serde_json::Value,
    tensors: &[(&str, safetensors::Dtype, Vec<usize>)],
) {
    std::fs::create_dir_all(dir).expect("dir");
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let datas: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, d, s)| vec![0u8; s.iter().product::<usize>() * d.bitsize() / 8])
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&datas)
        .map(|((n, d, s), data)| {
            (
                n.to_string(),
                safetensors::tensor::TensorView::new(*d, s.clone(), data).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("write");
}

fn qwen_config() -> serde_json::Value {
    serde_json::json!({ "model_type": "qwen3_moe", "num_hidden_layers": 1, "hidden_size": 8, "num_experts": 1 })
}

#[test]
fn unsupported_dtypes_are_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("m");
    use safetensors::Dtype as D;
    raw_checkpoint(
        &dir,
        qwen_config(),
        &[(
            "model.layers.0.mlp.experts.0.gate_proj.weight",
            D::I8,
            vec![4, 8],
        )],
    );
    let err =
        pack_experts(&PackOptions::new(&dir, &tmp.path().join("o")), &|_| {}).expect_err("I8");
    assert!(
        matches!(&err, PackError::UnsupportedDtype { dtype, .. } if dtype == "I8"),
        "{err}"
    );
    assert!(err.to_string().contains("gate_proj.weight"), "{err}");
}

#[test]
fn fp8_without_scales_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("m");
    use safetensors::Dtype as D;
    raw_checkpoint(
        &dir,
        qwen_config(),
        &[(
            "model.layers.0.mlp.experts.0.gate_proj.weight",
            D::F8_E4M3,
            vec![4, 8],
        )],
    );
    let err = pack_experts(&PackOptions::new(&dir, &tmp.path().join("o")), &|_| {})
        .expect_err("no scales");
    assert!(matches!(err, PackError::MissingScale { .. }), "{err}");
}

#[test]
fn inconsistent_experts_and_missing_weights_are_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("m");
    use safetensors::Dtype as D;
    let mut cfg = qwen_config();
    cfg["num_experts"] = 2.into();
    raw_checkpoint(
        &dir,
        cfg,
        &[
            (
                "model.layers.0.mlp.experts.0.gate_proj.weight",
                D::BF16,
                vec![4, 8],
            ),
            (
                "model.layers.0.mlp.experts.1.gate_proj.weight",
                D::BF16,
                vec![5, 8],
            ),
        ],
    );
    let err =
        pack_experts(&PackOptions::new(&dir, &tmp.path().join("o")), &|_| {}).expect_err("shapes");
    assert!(matches!(err, PackError::Inconsistent { .. }), "{err}");
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).expect("dir");
    std::fs::write(empty.join("config.json"), "{}").expect("config");
    let err =
        pack_experts(&PackOptions::new(&empty, &tmp.path().join("o2")), &|_| {}).expect_err("none");
    assert!(err.to_string().contains("no model.safetensors"), "{err}");
}

#[test]
fn config_expert_count_must_match_the_tensors() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("m");
    use safetensors::Dtype as D;
    let mut cfg = qwen_config();
    cfg["num_experts"] = 4.into();
    raw_checkpoint(
        &dir,
        cfg,
        &[(
            "model.layers.0.mlp.experts.0.gate_proj.weight",
            D::BF16,
            vec![4, 8],
        )],
    );
    let err =
        pack_experts(&PackOptions::new(&dir, &tmp.path().join("o")), &|_| {}).expect_err("count");
    assert!(
        matches!(
            err,
            PackError::Config {
                field: "num_experts",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn synthetic_checkpoints_are_deterministic() {
    let spec = SynthSpec::tiny(SynthArch::DeepSeek, Dtype::F8E4M3, 11);
    let name = "model.layers.1.mlp.experts.2.down_proj.weight";
    assert_eq!(spec.tensor_bytes(name), spec.tensor_bytes(name));
    let other = SynthSpec {
        seed: 12,
        ..spec.clone()
    };
    assert_ne!(spec.tensor_bytes(name), other.tensor_bytes(name));
    let sized = SynthSpec::scaled_to(SynthArch::Qwen3Moe, Dtype::Bf16, 64 << 20, 1);
    let total = sized.total_bytes();
    assert!(
        total <= 64 << 20 && total > 16 << 20,
        "{total} bytes for a 64 MiB target: {sized:?}"
    );
}

/// The transformers-5 fixture (`tools/make_fixtures.py`, layout "fused",
/// two shards): every record's gate, up and down are byte-identical to the
/// expert's slices of the layer's `gate_up_proj` and `down_proj`, read with
/// the `safetensors` crate, through buffered and direct checkpoint reads.
#[test]
fn fused_transformers5_checkpoints_pack_byte_identical() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../flashtier-engine/tests/fixtures/engine/qwen3_moe_tied");
    let src = source_tensors(&model);
    for direct_source in [false, true] {
        let tmp = tempfile::tempdir().expect("tempdir");
        let out = tmp.path().join("experts.ftstore");
        let mut opts = PackOptions::new(&model, &out);
        opts.direct_source = direct_source;
        let report = pack_experts(&opts, &|_| {}).expect("pack");
        let store = Store::open(&out).expect("open store");
        let m = store.manifest();
        assert_eq!(m.source.as_ref().expect("source").expert_tensors, "fused");
        let names: Vec<&str> = m.record.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
        );
        let image = std::fs::read(&out).expect("read store");
        let mut compared = 0;
        for (i, key) in m.keys.iter().enumerate() {
            let prefix = format!("model.layers.{}.mlp.experts.", key.layer);
            let (_, gu_shape, gu) = &src[&format!("{prefix}gate_up_proj")];
            let (_, _, down) = &src[&format!("{prefix}down_proj")];
            let (two_i, h) = (gu_shape[1], gu_shape[2]);
            let mat = two_i / 2 * h * 2; // bf16
            let e = key.item as usize;
            let want = [
                &gu[e * 2 * mat..e * 2 * mat + mat],
                &gu[e * 2 * mat + mat..(e + 1) * 2 * mat],
                &down[e * mat..(e + 1) * mat],
            ];
            let mut rec = vec![0u8; store.payload_bytes() as usize];
            store
                .read_record(&image[..], i as u64, &mut rec)
                .expect("record verifies");
            for (t, want) in m.record.tensors.iter().zip(want) {
                let got = &rec[t.offset as usize..(t.offset + t.len_bytes) as usize];
                assert!(got == want, "{key:?} {}: packed bytes differ", t.name);
                compared += 1;
            }
        }
        assert_eq!(compared, 3 * report.records as usize);
        assert!(report.records > 0);
        check_pairing(&store, &CheckpointFiles::open(&model).expect("ckpt")).expect("pairs");
    }
}

fn fused_config(model_type: &str, layers: u64) -> serde_json::Value {
    serde_json::json!({ "model_type": model_type, "num_hidden_layers": layers, "hidden_size": 8, "num_experts": 2 })
}

#[test]
fn fused_layouts_are_checked() {
    use safetensors::Dtype as D;
    let tmp = tempfile::tempdir().expect("tempdir");
    let pack = |name: &str, cfg: serde_json::Value, tensors: &[(&str, D, Vec<usize>)]| {
        let dir = tmp.path().join(name);
        raw_checkpoint(&dir, cfg, tensors);
        pack_experts(
            &PackOptions::new(&dir, &tmp.path().join(format!("{name}.ftstore"))),
            &|_| {},
        )
    };
    let gu = "model.layers.0.mlp.experts.gate_up_proj";
    let down = "model.layers.0.mlp.experts.down_proj";
    // Mixtral spelled under block_sparse_moe: records named w1, w3, w2.
    let ok = pack(
        "mixtral",
        fused_config("mixtral", 1),
        &[
            (
                "model.layers.0.block_sparse_moe.experts.gate_up_proj",
                D::BF16,
                vec![2, 6, 8],
            ),
            (
                "model.layers.0.block_sparse_moe.experts.down_proj",
                D::BF16,
                vec![2, 8, 3],
            ),
        ],
    )
    .expect("mixtral fused");
    assert_eq!(ok.records, 2);
    let m = Store::open(&tmp.path().join("mixtral.ftstore"))
        .expect("store")
        .manifest()
        .clone();
    let names: Vec<&str> = m.record.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["w1.weight", "w3.weight", "w2.weight"]);
    assert_eq!(m.model.expect("model").expert_intermediate_size, 3);
    // Fused and per-expert tensors in one checkpoint.
    let err = pack(
        "mixed",
        fused_config("qwen3_moe", 2),
        &[
            (gu, D::BF16, vec![2, 6, 8]),
            (down, D::BF16, vec![2, 8, 3]),
            (
                "model.layers.1.mlp.experts.0.gate_proj.weight",
                D::BF16,
                vec![3, 8],
            ),
        ],
    )
    .expect_err("mixed");
    assert!(matches!(err, PackError::MixedLayouts { .. }), "{err}");
    // Layers that spell the fused block differently.
    let err = pack(
        "prefixes",
        fused_config("qwen3_moe", 2),
        &[
            (gu, D::BF16, vec![2, 6, 8]),
            (down, D::BF16, vec![2, 8, 3]),
            (
                "model.layers.1.block_sparse_moe.experts.gate_up_proj",
                D::BF16,
                vec![2, 6, 8],
            ),
            (
                "model.layers.1.block_sparse_moe.experts.down_proj",
                D::BF16,
                vec![2, 8, 3],
            ),
        ],
    )
    .expect_err("two prefixes");
    assert!(matches!(err, PackError::MixedLayouts { .. }), "{err}");
    // A layer without its down_proj: named.
    let err = pack(
        "nodown",
        fused_config("qwen3_moe", 1),
        &[(gu, D::BF16, vec![2, 6, 8])],
    )
    .expect_err("no down");
    assert!(err.to_string().contains(down), "{err}");
    // Odd gate_up rows, and a down_proj of the wrong shape.
    let err = pack(
        "odd",
        fused_config("qwen3_moe", 1),
        &[(gu, D::BF16, vec![2, 5, 8]), (down, D::BF16, vec![2, 8, 3])],
    )
    .expect_err("odd");
    assert!(
        matches!(err, PackError::Inconsistent { .. }) && err.to_string().contains(gu),
        "{err}"
    );
    let err = pack(
        "shape",
        fused_config("qwen3_moe", 1),
        &[(gu, D::BF16, vec![2, 6, 8]), (down, D::BF16, vec![2, 3, 8])],
    )
    .expect_err("down shape");
    assert!(err.to_string().contains(down), "{err}");
    // Layers that disagree.
    let err = pack(
        "layers",
        fused_config("qwen3_moe", 2),
        &[
            (gu, D::BF16, vec![2, 6, 8]),
            (down, D::BF16, vec![2, 8, 3]),
            (
                "model.layers.1.mlp.experts.gate_up_proj",
                D::BF16,
                vec![2, 4, 8],
            ),
            (
                "model.layers.1.mlp.experts.down_proj",
                D::BF16,
                vec![2, 8, 2],
            ),
        ],
    )
    .expect_err("layers");
    assert!(err.to_string().contains("layers.1"), "{err}");
    // FP8 fused experts (their scales' layout is not defined): refused by name.
    let err = pack(
        "fp8",
        fused_config("qwen3_moe", 1),
        &[
            (gu, D::F8_E4M3, vec![2, 6, 8]),
            (down, D::F8_E4M3, vec![2, 8, 3]),
        ],
    )
    .expect_err("fp8");
    assert!(matches!(err, PackError::UnsupportedDtype { .. }), "{err}");
}
