//! The expert packer's output can never cost the user a file: it refuses
//! outputs that are the checkpoint's own files (by path, symlink or hard
//! link) and files that are not expert stores, concurrent packs of one
//! output serialise into one whole store, and a failed pack leaves neither
//! a temp file nor an output.
#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed setup step must fail the test loudly"
)]

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use flashtier::experts::lowbit::LowbitSpec;
use flashtier::experts::lowbit_pack::write_companion;
use flashtier_engine::store::PackError;
use flashtier_format::{Dtype, Store};
use flashtier_io::persist::{Output, Wait};
use flashtier_io::{DirectMode, PersistError};
use flashtier_pack::pack::{PackOptions, PackReport, pack_experts};
use flashtier_pack::synth::{SynthArch, SynthSpec, write_checkpoint};

/// Every file of `dir` (not recursing) with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect()
}

/// Names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn model(root: &Path, name: &str, seed: u64) -> PathBuf {
    let dir = root.join(name);
    let spec = SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::Bf16, seed);
    write_checkpoint(&spec, &dir, &mut |_| {}).unwrap();
    dir
}

/// A model whose pack takes long enough (32 records of 192 KiB) for
/// concurrent packs to overlap.
fn larger_model(root: &Path, name: &str, seed: u64) -> PathBuf {
    let dir = root.join(name);
    let mut spec = SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::Bf16, seed);
    (spec.layers, spec.experts, spec.hidden, spec.intermediate) = (4, 8, 256, 128);
    write_checkpoint(&spec, &dir, &mut |_| {}).unwrap();
    dir
}

fn opts(model: &Path, out: &Path) -> PackOptions {
    let mut o = PackOptions::new(model, out);
    o.depth = 2;
    o.writers = 2;
    o
}

fn pack(model: &Path, out: &Path) -> Result<PackReport, PackError> {
    pack_experts(&opts(model, out), &|_| {})
}

/// Every record of the store at `path` verifies against its checksum.
fn verify_all(path: &Path) {
    let store = Store::open(path).unwrap();
    let file = flashtier_io::StoreFile::open_read(path, flashtier_io::DirectMode::Off).unwrap();
    let mut buf = vec![0u8; store.payload_bytes() as usize];
    for i in 0..store.record_count() {
        store.read_record(file.as_ref(), i, &mut buf).unwrap();
        store.verify_record(i, &buf).unwrap();
    }
}

#[test]
fn outputs_that_are_checkpoint_files_are_refused_and_the_checkpoint_is_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path(), "m", 1);
    let shard = m.join("model-00001-of-00002.safetensors");
    let sym = tmp.path().join("sym.ftstore");
    std::os::unix::fs::symlink(&shard, &sym).unwrap();
    let hard = tmp.path().join("hard.ftstore");
    std::fs::hard_link(m.join("config.json"), &hard).unwrap();
    let before = snapshot(&m);
    let cases = [
        (shard.clone(), "model-00001-of-00002.safetensors"),
        (m.join("model-00002-of-00002.safetensors"), "00002"),
        (m.join("config.json"), "config.json"),
        (m.join("model.safetensors.index.json"), "index.json"),
        (sym.clone(), "model-00001-of-00002.safetensors"),
        (hard.clone(), "config.json"),
    ];
    for (out, named) in &cases {
        let err = pack(&m, out).expect_err("an input as output must be refused");
        assert!(
            matches!(err, PackError::Persist(PersistError::OutputIsInput { .. })),
            "{err}"
        );
        let msg = err.to_string();
        assert!(msg.contains(named), "{msg}");
        assert_eq!(snapshot(&m), before, "the checkpoint changed");
    }
    assert!(sym.symlink_metadata().unwrap().is_symlink());
    assert_eq!(names(tmp.path()), ["hard.ftstore", "m", "sym.ftstore"]);
}

#[test]
fn files_that_are_not_exact_expert_stores_are_not_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path(), "m", 2);
    let out = tmp.path().join("experts.ftstore");
    std::fs::write(&out, "my notes\n").unwrap();
    let err = pack(&m, &out).expect_err("a text file must not be replaced");
    assert!(
        matches!(err, PackError::Persist(PersistError::NotReplaceable { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("experts.ftstore"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), b"my notes\n");
    // A low-bit companion is a store, but not of the kind `pack experts` writes.
    std::fs::remove_file(&out).unwrap();
    let exact = tmp.path().join("exact.ftstore");
    pack(&m, &exact).unwrap();
    let spec = LowbitSpec::new(3, 64).unwrap();
    write_companion(&exact, &out, spec, &mut |_, _| {}).unwrap();
    let companion = std::fs::read(&out).unwrap();
    let err = pack(&m, &out).expect_err("a companion must not be replaced");
    assert!(err.to_string().contains("low-bit companion"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), companion);
    // A folder at the output is refused before anything is written.
    let folder = tmp.path().join("folder.ftstore");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("inside"), b"x").unwrap();
    let err = pack(&m, &folder).expect_err("a folder must not be replaced");
    assert!(err.to_string().contains("directory"), "{err}");
    assert_eq!(
        names(tmp.path()),
        ["exact.ftstore", "experts.ftstore", "folder.ftstore", "m"]
    );
}

#[test]
fn an_older_store_is_replaced_by_the_same_bytes_as_a_fresh_pack() {
    let tmp = tempfile::tempdir().unwrap();
    let a = model(tmp.path(), "a", 3);
    let b = model(tmp.path(), "b", 4);
    let out = tmp.path().join("experts.ftstore");
    let fresh = tmp.path().join("fresh.ftstore");
    pack(&a, &out).unwrap();
    pack(&b, &fresh).unwrap();
    let report = pack(&b, &out).unwrap();
    assert!(!report.reused);
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&fresh).unwrap());
    assert_eq!(
        names(tmp.path()),
        ["a", "b", "experts.ftstore", "fresh.ftstore"]
    );
}

#[test]
fn concurrent_packs_of_one_output_end_with_one_whole_verified_store() {
    let tmp = tempfile::tempdir().unwrap();
    let a = larger_model(tmp.path(), "a", 5);
    let b = larger_model(tmp.path(), "b", 6);
    let (ref_a, ref_b) = (tmp.path().join("ref_a"), tmp.path().join("ref_b"));
    pack(&a, &ref_a).unwrap();
    pack(&b, &ref_b).unwrap();
    let (want_a, want_b) = (
        std::fs::read(&ref_a).unwrap(),
        std::fs::read(&ref_b).unwrap(),
    );
    let out = tmp.path().join("experts.ftstore");
    // The same checkpoint four times at once: every pack succeeds and the
    // store is exactly a single pack's.
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(|| pack(&a, &out))).collect();
        for h in handles {
            h.join().unwrap().unwrap();
        }
    });
    assert!(
        std::fs::read(&out).unwrap() == want_a,
        "not a single pack's store"
    );
    verify_all(&out);
    // Two checkpoints at once: each success is whole; the last one stays.
    std::thread::scope(|s| {
        let handles: Vec<_> = [&a, &b, &a, &b]
            .into_iter()
            .map(|m| s.spawn(|| pack(m, &out)))
            .collect();
        for h in handles {
            h.join().unwrap().unwrap();
        }
    });
    let got = std::fs::read(&out).unwrap();
    assert!(got == want_a || got == want_b, "a mix of two packs");
    verify_all(&out);
    assert_eq!(
        names(tmp.path()),
        ["a", "b", "experts.ftstore", "ref_a", "ref_b"]
    );
}

#[test]
fn a_pack_that_must_not_wait_fails_while_another_writer_holds_the_output() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path(), "m", 7);
    let out = tmp.path().join("experts.ftstore");
    let held = Output::lock(&out, Wait::Block).unwrap();
    let mut o = opts(&m, &out);
    o.wait = Wait::Fail;
    let err = pack_experts(&o, &|_| {}).expect_err("busy");
    assert!(
        matches!(err, PackError::Persist(PersistError::Busy { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("experts.ftstore"), "{err}");
    drop(held);
    pack_experts(&o, &|_| {}).unwrap();
    verify_all(&out);
}

#[test]
fn reuse_keeps_a_complete_store_of_the_same_plan_and_repacks_any_other() {
    let tmp = tempfile::tempdir().unwrap();
    let a = model(tmp.path(), "a", 8);
    let b = model(tmp.path(), "b", 9);
    let out = tmp.path().join("experts.ftstore");
    pack(&a, &out).unwrap();
    let inode = std::fs::metadata(&out).unwrap().ino();
    let mut o = opts(&a, &out);
    o.reuse_existing = true;
    let report = pack_experts(&o, &|_| {}).unwrap();
    assert!(report.reused);
    assert_eq!(std::fs::metadata(&out).unwrap().ino(), inode, "repacked");
    assert_eq!(report.records, Store::open(&out).unwrap().record_count());
    let mut o = opts(&b, &out);
    o.reuse_existing = true;
    let report = pack_experts(&o, &|_| {}).unwrap();
    assert!(!report.reused, "a store of another checkpoint was reused");
    assert_ne!(std::fs::metadata(&out).unwrap().ino(), inode);
}

#[test]
fn a_pack_failing_midway_leaves_no_temp_file_and_no_output() {
    let tmp = tempfile::tempdir().unwrap();
    let m = larger_model(tmp.path(), "m", 10);
    let out_dir = tmp.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let out = out_dir.join("experts.ftstore");
    // The checkpoint shrinks under the packer after its first record: the
    // later tensors' reads come up short.
    let shard = m.join("model-00002-of-00002.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    let mut o = opts(&m, &out);
    o.direct = DirectMode::Off;
    o.readers = 1;
    let err = pack_experts(&o, &|_| {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&shard)
            .unwrap();
        f.set_len(len / 2).unwrap();
    })
    .expect_err("a truncated checkpoint must fail the pack");
    assert!(err.to_string().contains("00002"), "{err}");
    assert!(names(&out_dir).is_empty(), "{:?}", names(&out_dir));
    // A packing thread that panics fails the pack the same way.
    let err = pack_experts(&opts(&larger_model(tmp.path(), "n", 11), &out), &|_| {
        panic!("progress callback failed")
    })
    .expect_err("a panicking thread must fail the pack");
    assert!(matches!(err, PackError::Thread(_)), "{err}");
    assert!(names(&out_dir).is_empty(), "{:?}", names(&out_dir));
}

/// A folder that holds anything but a synthetic checkpoint (a user's real
/// model, say) is never written over or removed by the synthesizer; an
/// older synthetic checkpoint is replaced.
#[test]
fn the_synthesizer_never_replaces_a_real_model() {
    use flashtier_pack::synth::{SynthError, remove_synthetic};
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(model.join("config.json"), br#"{"model_type":"qwen3_moe"}"#).unwrap();
    std::fs::write(model.join("model.safetensors"), b"the user's weights").unwrap();
    let before = snapshot(&model);
    let spec = SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::Bf16, 1);
    let err = write_checkpoint(&spec, &model, &mut |_| {}).unwrap_err();
    assert!(matches!(err, SynthError::NotSynthetic { .. }), "{err}");
    assert!(
        err.to_string().contains(&model.display().to_string()),
        "{err}"
    );
    assert!(matches!(
        remove_synthetic(&model),
        Err(SynthError::NotSynthetic { .. })
    ));
    assert_eq!(snapshot(&model), before);
    // A synthetic checkpoint in its place is rewritten and removable.
    let fresh = dir.path().join("synth");
    write_checkpoint(&spec, &fresh, &mut |_| {}).unwrap();
    write_checkpoint(&spec, &fresh, &mut |_| {}).unwrap();
    remove_synthetic(&fresh).unwrap();
    assert!(!fresh.exists());
    remove_synthetic(&fresh).unwrap();
}
