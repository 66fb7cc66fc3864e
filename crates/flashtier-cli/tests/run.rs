//! `flashtier run` end to end on the engine fixtures.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../flashtier-engine/tests/fixtures/engine")
        .join(name)
}

fn reference(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

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
    let ids: Vec<String> = r["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let out = run(&[
        "--model",
        fixture("mixtral").to_str().unwrap(),
        "--prompt-ids",
        &ids.join(","),
        "--max-new",
        "8",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let want: Vec<String> = r["greedy_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    assert!(text.starts_with(&want.join(" ")), "{text}");
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
    let ids: Vec<String> = r["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
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
            &ids.join(","),
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

/// The fixture's prompt ids, comma-separated.
fn prompt_ids(r: &Value) -> String {
    let ids: Vec<String> = r["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    ids.join(",")
}

/// Qwen4-Exp through the binary: packed into the store cache on first use,
/// then streamed at a budget below all experts on both backings; the
/// greedy ids are transformers', `auto` says why it stays on the CPU, and
/// the JSON report carries the expert numbers.
#[test]
fn qwen4_exp_decodes_from_the_store_cache_on_both_backings() {
    let r = reference("qwen4_exp");
    let model = fixture("qwen4_exp");
    let cache = tempfile::tempdir().unwrap();
    for backing in ["slots", "mapped"] {
        let out = Command::new(env!("CARGO_BIN_EXE_flashtier"))
            .arg("run")
            .args(["--model", model.to_str().unwrap()])
            .args(["--cache", cache.path().to_str().unwrap()])
            .args(["--backing", backing, "--budget", "64K", "--json"])
            .args(["--prompt-ids", &prompt_ids(&r), "--max-new", "8"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{backing}: {err}");
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["generated_ids"], r["greedy_ids"], "{backing}");
        assert_eq!(v["device"], "cpu");
        assert!(
            v["device_fallback"]
                .as_str()
                .unwrap()
                .contains("no GPU decoder")
        );
        let hit = v["expert_hit_rate"].as_f64().unwrap();
        assert!(hit < 1.0, "{backing}: a 64K budget must miss: {v}");
        if backing == "slots" {
            assert!(v["bytes_read_per_token"].as_f64().unwrap() > 0.0, "{v}");
        }
    }
    let stores = std::fs::read_dir(cache.path().join("stores")).unwrap();
    assert_eq!(stores.count(), 1, "the second run reuses the cached store");
}

/// Text output streams transformers' greedy ids; an explicit GPU is a
/// clear error naming the way out.
#[test]
fn qwen4_exp_text_output_and_no_gpu_path() {
    let r = reference("qwen4_exp");
    let model = fixture("qwen4_exp");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("q4.ftstore");
    let base = [
        "--model",
        model.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
    ];
    let ids = prompt_ids(&r);
    let out = run(&[&base[..], &["--prompt-ids", &ids, "--max-new", "8"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let want: Vec<String> = r["greedy_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    assert!(text.starts_with(&want.join(" ")), "{text}");
    assert!(text.contains("expert hit rate"), "{text}");
    let gpu = run(&[&base[..], &["--prompt-ids", "1,2", "--device", "cuda"]].concat());
    assert!(!gpu.status.success());
    let err = String::from_utf8_lossy(&gpu.stderr);
    assert!(
        err.contains("Qwen4-Exp has no cuda:0 decoder yet") && err.contains("--device cpu"),
        "{err}"
    );
}

/// `--rows-budget`: Qwen4-Exp's PLE rows from the row store (shards packed
/// beside the expert store), transformers' greedy ids at a budget of 0 and
/// of all rows, the row numbers in the JSON report; a model without row
/// tables refuses the flag.
#[test]
fn qwen4_exp_rows_from_the_row_store_at_budget_zero_and_all() {
    let r = reference("qwen4_exp");
    let model = fixture("qwen4_exp");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("q4.ftstore");
    let ids = prompt_ids(&r);
    // With no cache no lookup hits; with every table cached the decode's
    // new n-grams are still read (by the prefetch) once: a hit rate is the
    // share of lookups cached before their step.
    for (budget, hit_rate) in [("0", Some(0.0)), ("1M", None)] {
        let out = run(&[
            "--model",
            model.to_str().unwrap(),
            "--store",
            store.to_str().unwrap(),
            "--rows-budget",
            budget,
            "--prompt-ids",
            &ids,
            "--max-new",
            "8",
            "--json",
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{budget}: {err}");
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["generated_ids"], r["greedy_ids"], "{budget}");
        let hit = v["row_hit_rate"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit), "{v}");
        if let Some(want) = hit_rate {
            assert_eq!(hit, want, "{v}");
        }
        assert!(v["row_bytes_read_per_token"].as_f64().unwrap() > 0.0, "{v}");
        assert!(v["row_stall_fraction"].as_f64().is_some(), "{v}");
    }
    let shards = std::fs::read_dir(dir.path().join("q4.ftstore.ple-rows")).unwrap();
    assert_eq!(shards.count(), 6);
    let other = run(&[
        "--model",
        fixture("mixtral").to_str().unwrap(),
        "--store",
        dir.path().join("m.ftstore").to_str().unwrap(),
        "--rows-budget",
        "0",
        "--prompt-ids",
        "1,2",
    ]);
    assert!(!other.status.success());
    let err = String::from_utf8_lossy(&other.stderr);
    assert!(err.contains("no row tables"), "{err}");
}
