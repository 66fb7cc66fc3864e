//! `flashtier run` end to end on the engine fixtures (Qwen4-Exp in
//! `qwen4_cli.rs`).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use crate::common;

use std::process::Command;

use serde_json::Value;

use common::{fixture, ids, reference};

/// `flashtier run ARGS` with a store cache of its own (runs without
/// `--store` pack the fixture there).
fn run(args: &[&str]) -> std::process::Output {
    let cache = tempfile::tempdir().unwrap();
    Command::new(env!("CARGO_BIN_EXE_flashtier"))
        .arg("run")
        .args(args)
        .env("FLASHTIER_CACHE", cache.path())
        .output()
        .unwrap()
}

#[test]
fn prompt_text_json_and_logits_match_the_reference() {
    let r = reference("qwen3_moe");
    let dir = tempfile::tempdir().unwrap();
    let logits = dir.path().join("logits.json");
    let out = run(&[
        "--model",
        fixture("qwen3_moe").to_str().unwrap(),
        "--prompt",
        r["prompt_text"].as_str().unwrap(),
        "--max-new",
        "8",
        "--budget",
        "64K",
        "--json",
        "--logits-out",
        logits.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["generated_ids"], r["greedy_ids"]);
    for key in [
        "tokens_per_sec",
        "expert_hit_rate",
        "bytes_read_per_token",
        "stall_fraction",
    ] {
        assert!(v[key].as_f64().is_some(), "{key} missing from {v}");
    }
    let l: Value = serde_json::from_str(&std::fs::read_to_string(&logits).unwrap()).unwrap();
    let got = l["prompt_logits"].as_array().unwrap();
    let want = r["prompt_logits"].as_array().unwrap();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        for (a, b) in g.as_array().unwrap().iter().zip(w.as_array().unwrap()) {
            assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() <= 1e-3);
        }
    }
}

#[test]
fn text_output_streams_tokens_then_a_summary() {
    let r = reference("mixtral");
    let out = run(&[
        "--model",
        fixture("mixtral").to_str().unwrap(),
        "--prompt-ids",
        &ids(&r, "prompt_ids"),
        "--max-new",
        "8",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let want = ids(&r, "greedy_ids").replace(',', " ");
    assert!(text.starts_with(&want), "{text}");
    assert!(
        text.contains("tok/s") && text.contains("expert hit rate"),
        "{text}"
    );
}

#[test]
fn prompt_text_without_tokenizer_is_a_clear_error() {
    let out = run(&[
        "--model",
        fixture("mixtral").to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("tokenizer.json"));
}

#[test]
fn store_is_packed_on_first_use_then_reused_on_both_backings() {
    let r = reference("mixtral");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("experts.ftstore");
    for backing in ["slots", "mapped", "slots"] {
        let out = run(&[
            "--model",
            fixture("mixtral").to_str().unwrap(),
            "--store",
            store.to_str().unwrap(),
            "--backing",
            backing,
            "--budget",
            "48K",
            "--prompt-ids",
            &ids(&r, "prompt_ids"),
            "--max-new",
            "8",
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["generated_ids"], r["greedy_ids"], "{backing}");
        assert!(store.exists());
    }
    // A store packed from another checkpoint is refused.
    let other = run(&[
        "--model",
        fixture("qwen3_moe").to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-new",
        "1",
    ]);
    assert!(!other.status.success());
    assert!(String::from_utf8_lossy(&other.stderr).contains("does not belong"));
}

/// A KV budget needs the GPU: on the CPU it is refused before anything is
/// packed, and `auto` without a GPU (CI) refuses it too instead of
/// dropping it.
#[test]
fn a_kv_budget_on_the_cpu_is_a_clear_error() {
    let model = fixture("qwen3_moe");
    let out = run(&[
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--device",
        "cpu",
        "--kv-budget-hbm",
        "1M",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs the CUDA device"), "{err}");
    if flashtier_cuda::driver_present() {
        return;
    }
    let out = run(&[
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--kv-budget-hbm",
        "1M",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs the CUDA device") && err.contains("no GPU"),
        "{err}"
    );
}
