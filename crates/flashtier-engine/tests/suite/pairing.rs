//! `check_pairing` cross-checks every record of a store against the
//! checkpoint's headers: a manifest edited after packing (dtype, shape,
//! tensor name, key, FP8 scale), with every checksum recomputed so that the
//! store itself still opens, is refused naming the record, its key, the
//! record tensor and the checkpoint tensor; per-expert and transformers-5
//! fused checkpoints and low-bit companions pair when untouched.

use std::path::{Path, PathBuf};

use flashtier::experts::lowbit::LowbitSpec;
use flashtier::experts::lowbit_pack::write_companion;
use flashtier_engine::checkpoint::files::CheckpointFiles;
use flashtier_engine::store::{PackError, check_pairing};
use flashtier_format::{Dtype, Manifest, Store, StoreWriterPlan};
use flashtier_pack::pack::{PackOptions, pack_experts};
use flashtier_pack::synth::{SynthArch, SynthSpec, write_checkpoint};

fn pack(model: &Path, out: &Path) -> Store {
    pack_experts(&PackOptions::new(model, out), &|_| {}).expect("pack");
    Store::open(out).expect("open")
}

fn synth(dir: &Path, arch: SynthArch, dtype: Dtype) -> (PathBuf, Store) {
    let model = dir.join("model");
    write_checkpoint(&SynthSpec::tiny(arch, dtype, 11), &model, &mut |_| {}).expect("synth");
    let store = pack(&model, &dir.join("experts.ftstore"));
    (model, store)
}

/// The store at `path` rewritten with its manifest passed through `edit`:
/// same records, every checksum (records, table, manifest, header) valid.
fn rewrite(path: &Path, edit: impl FnOnce(&mut Manifest)) -> Store {
    let store = Store::open(path).expect("open");
    let file =
        flashtier_io::StoreFile::open_read(path, flashtier_io::DirectMode::Off).expect("file");
    let records: Vec<Vec<u8>> = (0..store.record_count())
        .map(|i| {
            let mut r = vec![0u8; store.payload_bytes() as usize];
            store.read_record(file.as_ref(), i, &mut r).expect("record");
            r
        })
        .collect();
    let mut m = store.manifest().clone();
    edit(&mut m);
    let image = StoreWriterPlan::new(m)
        .expect("plan")
        .image(&records)
        .expect("image");
    let out = path.with_extension("edited.ftstore");
    std::fs::write(&out, image).expect("write");
    Store::open(&out).expect("the edited store still opens")
}

fn mismatch(store: &Store, model: &Path) -> (u64, String, String, String, String) {
    let ckpt = CheckpointFiles::open(model).expect("ckpt");
    match check_pairing(store, &ckpt).expect_err("an edited manifest pairs") {
        PackError::RecordMismatch(m) => (m.record, m.key, m.tensor, m.source_tensor, m.why),
        other => panic!("not a record mismatch: {other}"),
    }
}

#[test]
fn an_edited_dtype_shape_or_name_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (model, store) = synth(tmp.path(), SynthArch::Mixtral, Dtype::Bf16);
    check_pairing(&store, &CheckpointFiles::open(&model).expect("ckpt")).expect("untouched pairs");
    let path = store.path().to_path_buf();

    let edited = rewrite(&path, |m| m.record.tensors[1].dtype = Dtype::F16);
    let (record, key, tensor, source, why) = mismatch(&edited, &model);
    assert_eq!((record, key.as_str()), (0, "layer=0 expert=0"));
    assert_eq!(tensor, "w3.weight");
    assert_eq!(
        source,
        "model.layers.0.block_sparse_moe.experts.0.w3.weight"
    );
    assert!(why.contains("F16") && why.contains("BF16"), "{why}");

    let edited = rewrite(&path, |m| m.record.tensors[2].shape.reverse());
    let (_, _, tensor, _, why) = mismatch(&edited, &model);
    assert_eq!(tensor, "w2.weight");
    assert!(why.contains("the manifest says BF16 ["), "{why}");

    let edited = rewrite(&path, |m| m.record.tensors[0].name = "w9.weight".into());
    let (_, _, tensor, _, why) = mismatch(&edited, &model);
    assert_eq!(tensor, "w9.weight");
    assert!(why.contains("w1.weight"), "{why}");

    let edited = rewrite(&path, |m| m.dtype = Dtype::F16);
    let (record, _, _, _, why) = mismatch(&edited, &model);
    assert_eq!(record, 0);
    assert!(why.contains("dtype is F16"), "{why}");
}

#[test]
fn a_swapped_key_is_refused_naming_its_record() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (model, store) = synth(tmp.path(), SynthArch::Qwen3Moe, Dtype::F16);
    let edited = rewrite(store.path(), |m| m.keys.swap(2, 3));
    let (record, key, _, source, why) = mismatch(&edited, &model);
    assert_eq!((record, key.as_str()), (2, "layer=0 expert=3"));
    assert!(why.contains("layer=0 expert=2"), "{why}");
    assert!(
        source.starts_with("model.layers.0.mlp.experts.2."),
        "{source}"
    );
}

#[test]
fn an_edited_fp8_scale_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (model, store) = synth(tmp.path(), SynthArch::DeepSeek, Dtype::F8E4M3);
    check_pairing(&store, &CheckpointFiles::open(&model).expect("ckpt")).expect("untouched pairs");
    let scale = store
        .manifest()
        .record
        .tensors
        .iter()
        .position(|t| t.name.contains("scale"))
        .expect("an FP8 record has scales");
    // Same bytes, another meaning: F32 [r, c] read as BF16 [r, 2c].
    let edited = rewrite(store.path(), |m| {
        let t = &mut m.record.tensors[scale];
        t.dtype = Dtype::Bf16;
        if let Some(last) = t.shape.last_mut() {
            *last *= 2;
        }
    });
    let (_, _, tensor, source, why) = mismatch(&edited, &model);
    assert!(tensor.contains("scale"), "{tensor}");
    assert!(source.ends_with(&tensor), "{source}");
    assert!(why.contains("F32"), "{why}");
}

#[test]
fn fused_records_are_checked_as_slices_of_the_fused_tensors() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/engine/qwen3_moe_tied");
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = pack(&model, &tmp.path().join("fused.ftstore"));
    check_pairing(&store, &CheckpointFiles::open(&model).expect("ckpt")).expect("untouched pairs");
    let edited = rewrite(store.path(), |m| m.record.tensors[2].shape.reverse());
    let (record, _, tensor, source, _) = mismatch(&edited, &model);
    assert_eq!((record, tensor.as_str()), (0, "down_proj.weight"));
    assert!(source.ends_with("mlp.experts.down_proj"), "{source}");
    // Packed as per-expert tensors: the layout itself differs.
    let edited = rewrite(store.path(), |m| {
        if let Some(s) = m.source.as_mut() {
            s.expert_tensors = "split".into();
        }
    });
    let err = check_pairing(&edited, &CheckpointFiles::open(&model).expect("ckpt"))
        .expect_err("split claimed for a fused checkpoint");
    assert!(matches!(err, PackError::SourceMismatch { .. }), "{err}");
}

#[test]
fn a_lowbit_companion_pairs_and_its_edits_are_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (model, store) = synth(tmp.path(), SynthArch::Qwen2Moe, Dtype::Bf16);
    let q2 = tmp.path().join("experts.q2.ftstore");
    let spec = LowbitSpec::new(2, 32).expect("spec");
    write_companion(store.path(), &q2, spec, &mut |_, _| {}).expect("companion");
    let companion = Store::open(&q2).expect("open");
    check_pairing(&companion, &CheckpointFiles::open(&model).expect("ckpt")).expect("pairs");
    let edited = rewrite(&q2, |m| {
        let t = m
            .record
            .tensors
            .iter_mut()
            .find(|t| t.name.ends_with(".q2.codes"))
            .expect("codes");
        t.name = t.name.replace(".q2.", ".q3.");
    });
    let (_, _, tensor, source, _) = mismatch(&edited, &model);
    assert!(tensor.ends_with(".q3.codes"), "{tensor}");
    assert!(source.starts_with("model.layers."), "{source}");
}
