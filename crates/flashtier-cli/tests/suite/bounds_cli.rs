//! Sizes from flags and files: one byte-size parser (powers of 1024,
//! overflow refused) for every flag, and limits checked before anything of
//! that size is allocated, each a clear error and never an abort.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

fn flashtier(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashtier"))
        .args(args)
        .env("FLASHTIER_CACHE", cache)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../flashtier-engine/tests/fixtures/engine")
        .join(name)
}

/// A copy of fixture `name` (weights linked) with `field` of its config.json
/// set to `value`.
fn edited(dir: &Path, name: &str, field: &str, value: Value) -> PathBuf {
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let src = fixture(name);
    let text = std::fs::read_to_string(src.join("config.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&text).unwrap();
    cfg[field] = value;
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    std::os::unix::fs::symlink(
        src.join("model.safetensors"),
        model.join("model.safetensors"),
    )
    .unwrap();
    model
}

#[test]
fn replay_budget_suffixes_are_powers_of_1024() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("e.ftstore");
    flashtier::experts::testing::write_store(&store, 2, 8, 4096).unwrap();
    let out = flashtier(
        &[
            "replay",
            "--store",
            store.to_str().unwrap(),
            "--trace",
            "synth:decode",
            "--tokens",
            "8",
            "--budget",
            "1M",
            "--backend",
            "posix",
            "--json",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["budget_bytes"], 1_048_576, "{v}");
}

#[test]
fn a_byte_count_past_u64_is_refused_not_wrapped() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("r.rows");
    let out = flashtier(
        &[
            "bench",
            "rows",
            "--store",
            store.to_str().unwrap(),
            "--rows",
            "4096",
            "--cache",
            "17179869184G",
            "--hit-path-only",
            "--dram-pool",
            "64",
            "--json",
        ],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("more than 2^64 bytes"),
        "{}",
        stderr(&out)
    );
    assert!(!store.exists(), "nothing may run on a refused flag");
}

#[test]
fn run_accepts_a_budget_in_tebibytes() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("mixtral");
    let out = flashtier(
        &[
            "run",
            "--model",
            model.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
            "--max-new",
            "2",
            "--budget",
            "1T",
            "--json",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["budget_bytes"], 1u64 << 40, "{v}");
}

#[test]
fn bench_kv_flags_past_their_limits_are_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    for (flag, value, limit) in [
        ("--layers", "4000000000", "4096 layers"),
        ("--block-tokens", "1000000", "4096 tokens"),
        ("--head-dim", "4000000000", "16777216 bytes"),
        ("--ring", "100000000", "17179869184 bytes"),
    ] {
        let out = flashtier(
            &["bench", "kv", "--dir", d, flag, value, "--json"],
            dir.path(),
        );
        let text = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{flag}: {text}");
        assert!(
            text.contains(flag) && text.contains(limit),
            "{flag}: {text}"
        );
    }
}

#[test]
fn run_refuses_a_config_the_checkpoint_contradicts_without_aborting() {
    for (field, value, want) in [
        (
            "num_hidden_layers",
            json!(1_000_000_000_000u64),
            "over the limit",
        ),
        ("num_hidden_layers", json!(4), "3 layers"),
        ("num_local_experts", json!(1u64 << 62), "over the limit"),
        ("vocab_size", json!(1_000_000), "model.embed_tokens.weight"),
        (
            "max_position_embeddings",
            json!(1_000_000_000_000u64),
            "over the limit",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let model = edited(dir.path(), "mixtral", field, value);
        let store = dir.path().join("experts.ftstore");
        // From the store cache, and with a --store to pack first.
        for store_args in [&[][..], &["--store", store.to_str().unwrap()][..]] {
            let mut args = vec!["run", "--model", model.to_str().unwrap()];
            args.extend(["--prompt-ids", "1,2", "--max-new", "2"]);
            args.extend(store_args);
            let out = flashtier(&args, dir.path());
            let text = stderr(&out);
            assert_eq!(out.status.code(), Some(1), "{field}: {text}");
            assert!(
                text.contains(field) && text.contains(want),
                "{field}: {text}"
            );
            assert!(!store.exists(), "{field}: nothing may be packed");
            assert!(
                !dir.path().join("stores").exists(),
                "{field}: nothing may be packed"
            );
        }
    }
}

#[test]
fn a_field_of_the_wrong_type_is_not_called_missing() {
    let dir = tempfile::tempdir().unwrap();
    let model = edited(dir.path(), "qwen3_moe", "hidden_size", json!("64"));
    let out = flashtier(
        &[
            "run",
            "--model",
            model.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
            "--max-new",
            "1",
        ],
        dir.path(),
    );
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("hidden_size") && text.contains("is not a count"),
        "{text}"
    );
    assert!(!text.contains("missing"), "{text}");
}
