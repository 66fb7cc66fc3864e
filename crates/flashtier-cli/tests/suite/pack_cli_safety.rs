//! `flashtier pack` and `flashtier run --store` never cost the user a file:
//! an output that is an input or a file of another kind is refused with the
//! file named, concurrent processes writing one store end with one whole
//! store, and no temp or lock file is left behind.
#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed setup step must fail the test loudly"
)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use flashtier_format::Dtype;
use flashtier_pack::synth::{SynthArch, SynthSpec, write_checkpoint};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../flashtier-engine/tests/fixtures/engine")
        .join(name)
}

/// A copy of an engine fixture (never run a pack against the checked-in one).
fn fixture_copy(name: &str, root: &Path) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    dir
}

/// A synthetic checkpoint whose pack (32 records of 192 KiB) lasts long
/// enough for two processes to overlap.
fn synthetic(root: &Path, name: &str) -> PathBuf {
    let dir = root.join(name);
    let mut spec = SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::Bf16, 21);
    (spec.layers, spec.experts, spec.hidden, spec.intermediate) = (4, 8, 256, 128);
    write_checkpoint(&spec, &dir, &mut |_| {}).unwrap();
    dir
}

fn flashtier(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flashtier"));
    c.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

fn spawn(args: &[&str]) -> Child {
    flashtier(args).spawn().unwrap()
}

fn finish(child: Child) -> Output {
    child.wait_with_output().unwrap()
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

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

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn pack_experts(model: &Path, out: &Path) -> Output {
    finish(spawn(&[
        "pack",
        "experts",
        "--model",
        path(model),
        "--out",
        path(out),
        "--json",
    ]))
}

#[test]
fn pack_experts_refuses_the_models_own_files_and_leaves_them_intact() {
    let tmp = tempfile::tempdir().unwrap();
    let m = fixture_copy("qwen3_moe", tmp.path());
    let link = tmp.path().join("link.ftstore");
    std::os::unix::fs::symlink(m.join("model.safetensors"), &link).unwrap();
    let hard = tmp.path().join("hard.ftstore");
    std::fs::hard_link(m.join("model.safetensors"), &hard).unwrap();
    let before = snapshot(&m);
    for (out, named) in [
        (m.join("model.safetensors"), "model.safetensors"),
        (m.join("config.json"), "config.json"),
        (link.clone(), "model.safetensors"),
        (hard.clone(), "model.safetensors"),
    ] {
        let run = pack_experts(&m, &out);
        assert!(!run.status.success(), "packed over {}", out.display());
        assert!(stderr(&run).contains(named), "{}", stderr(&run));
        assert!(stderr(&run).contains("refusing"), "{}", stderr(&run));
        assert_eq!(snapshot(&m), before, "the model changed");
    }
    assert_eq!(
        names(tmp.path()),
        ["hard.ftstore", "link.ftstore", "qwen3_moe"]
    );
}

#[test]
fn pack_experts_replaces_an_older_store_but_not_a_text_file() {
    let tmp = tempfile::tempdir().unwrap();
    let m = fixture_copy("qwen3_moe", tmp.path());
    let out = tmp.path().join("experts.ftstore");
    std::fs::write(&out, "notes\n").unwrap();
    let run = pack_experts(&m, &out);
    assert!(!run.status.success());
    assert!(stderr(&run).contains("experts.ftstore"), "{}", stderr(&run));
    assert_eq!(std::fs::read(&out).unwrap(), b"notes\n");
    std::fs::remove_file(&out).unwrap();
    ok(&pack_experts(&m, &out));
    let first = std::fs::read(&out).unwrap();
    ok(&pack_experts(&m, &out));
    assert_eq!(std::fs::read(&out).unwrap(), first);
    ok(&finish(spawn(&["verify", path(&out)])));
    assert_eq!(names(tmp.path()), ["experts.ftstore", "qwen3_moe"]);
}

#[test]
fn pack_rows_refuses_its_own_table() {
    let tmp = tempfile::tempdir().unwrap();
    let table = tmp.path().join("table.bin");
    let bytes: Vec<u8> = (0..100 * 264u32).map(|i| (i * 7) as u8).collect();
    std::fs::write(&table, &bytes).unwrap();
    let run = finish(spawn(&[
        "pack",
        "rows",
        "--table",
        path(&table),
        "--rows",
        "100",
        "--out",
        path(&table),
    ]));
    assert!(!run.status.success(), "packed over its own table");
    assert!(stderr(&run).contains("table.bin"), "{}", stderr(&run));
    assert_eq!(std::fs::read(&table).unwrap(), bytes);
    assert_eq!(names(tmp.path()), ["table.bin"]);
}

#[test]
fn two_pack_processes_of_one_store_end_with_a_single_packs_store() {
    let tmp = tempfile::tempdir().unwrap();
    let m = synthetic(tmp.path(), "m");
    let single = tmp.path().join("single.ftstore");
    ok(&pack_experts(&m, &single));
    let out = tmp.path().join("experts.ftstore");
    let args = [
        "pack",
        "experts",
        "--model",
        path(&m),
        "--out",
        path(&out),
        "--json",
    ];
    let children: Vec<Child> = (0..3).map(|_| spawn(&args)).collect();
    for c in children {
        ok(&finish(c));
    }
    assert!(std::fs::read(&out).unwrap() == std::fs::read(&single).unwrap());
    ok(&finish(spawn(&["verify", path(&out)])));
    assert_eq!(
        names(tmp.path()),
        ["experts.ftstore", "m", "single.ftstore"]
    );
}

#[test]
fn no_wait_fails_at_once_while_another_process_writes_the_store() {
    let tmp = tempfile::tempdir().unwrap();
    let m = fixture_copy("qwen3_moe", tmp.path());
    let out = tmp.path().join("experts.ftstore");
    let held = flashtier_io::Output::lock(&out, flashtier_io::Wait::Block).unwrap();
    let run = finish(spawn(&[
        "pack",
        "experts",
        "--model",
        path(&m),
        "--out",
        path(&out),
        "--no-wait",
    ]));
    assert!(!run.status.success());
    assert!(stderr(&run).contains("another writer"), "{}", stderr(&run));
    assert!(!out.exists());
    drop(held);
    assert_eq!(names(tmp.path()), ["qwen3_moe"]);
}

/// The prompt ids of a fixture copy's reference, and its greedy tokens.
fn reference_prompt(m: &Path) -> (String, Value) {
    let reference: Value =
        serde_json::from_slice(&std::fs::read(m.join("reference.json")).unwrap()).unwrap();
    let ids: Vec<String> = reference["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(Value::to_string)
        .collect();
    (ids.join(","), reference["greedy_ids"].clone())
}

/// Three `run`s at once with `store_args`: all succeed with the reference
/// tokens.
fn three_runs_agree(m: &Path, store_args: &[&str]) {
    let (ids, want) = reference_prompt(m);
    let mut args = vec!["run", "--model", path(m), "--prompt-ids", &ids];
    args.extend_from_slice(store_args);
    args.extend_from_slice(&["--max-new", "8", "--json"]);
    let children: Vec<Child> = (0..3).map(|_| spawn(&args)).collect();
    for out in children.into_iter().map(finish) {
        ok(&out);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["generated_ids"], want);
    }
}

#[test]
fn two_runs_that_auto_pack_one_store_both_use_one_complete_store() {
    let tmp = tempfile::tempdir().unwrap();
    let m = fixture_copy("qwen3_moe", tmp.path());
    let store = tmp.path().join("experts.ftstore");
    three_runs_agree(&m, &["--store", path(&store)]);
    ok(&finish(spawn(&["verify", path(&store)])));
    assert_eq!(names(tmp.path()), ["experts.ftstore", "qwen3_moe"]);
}

#[test]
fn two_runs_that_fill_the_store_cache_both_use_one_complete_store() {
    let tmp = tempfile::tempdir().unwrap();
    let m = fixture_copy("qwen3_moe", tmp.path());
    let cache = tmp.path().join("cache");
    three_runs_agree(&m, &["--cache", path(&cache)]);
    let stores = names(&cache.join("stores"));
    assert_eq!(stores.len(), 1, "{stores:?}");
    assert!(stores[0].ends_with(".ftstore"), "{stores:?}");
    ok(&finish(spawn(&[
        "verify",
        path(&cache.join("stores").join(&stores[0])),
    ])));
}

#[test]
fn logits_out_refuses_the_models_files() {
    let tmp = tempfile::tempdir().unwrap();
    let m = fixture_copy("qwen3_moe", tmp.path());
    let before = snapshot(&m);
    for name in ["config.json", "model.safetensors"] {
        let run = finish(spawn(&[
            "run",
            "--model",
            path(&m),
            "--prompt-ids",
            "1,2",
            "--max-new",
            "1",
            "--logits-out",
            path(&m.join(name)),
        ]));
        assert!(!run.status.success(), "wrote logits over {name}");
        assert!(stderr(&run).contains(name), "{}", stderr(&run));
        assert_eq!(snapshot(&m), before, "the model changed");
    }
}
