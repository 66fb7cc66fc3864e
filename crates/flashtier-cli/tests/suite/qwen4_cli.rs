//! Qwen4-Exp through the binary: `flashtier run` on the text checkpoint
//! and on the multimodal wrapper, its PLE rows from the row store,
//! `flashtier pack rows --ple`, and the paths `run` refuses to write.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a broken fixture must fail the test loudly"
)]

use crate::common;
#[path = "../../../flashtier-engine/tests/common/rewrite.rs"]
mod rewrite;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use common::{fixture, ids};

/// The `qwen4_exp` fixture's `reference.json`.
fn reference() -> Value {
    common::reference("qwen4_exp")
}

/// `flashtier ARGS` with `cache` as the default store cache.
fn flashtier(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashtier"))
        .args(args)
        .env("FLASHTIER_CACHE", cache)
        .output()
        .unwrap()
}

/// `flashtier run --model MODEL` on the reference prompt, 8 new tokens,
/// with `extra` flags.
fn decode(model: &Path, extra: &[&str], cache: &Path) -> Output {
    let r = reference();
    let prompt = ids(&r, "prompt_ids");
    let base = ["run", "--model", path(model), "--prompt-ids", &prompt];
    flashtier(&[&base[..], &["--max-new", "8"], extra].concat(), cache)
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A successful command's JSON report.
fn ok(out: &Output) -> Value {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A failed command's stderr.
fn refused(out: &Output) -> String {
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Each file below `dir` by path relative to it: inode and bytes (a file
/// packed again gets a new inode: writers rename a temp file into place).
fn files(dir: &Path) -> BTreeMap<PathBuf, (u64, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                let meta = std::fs::metadata(&p).unwrap();
                let rel = p.strip_prefix(dir).unwrap().to_path_buf();
                out.insert(rel, (meta.ino(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out
}

/// Packed into the store cache on first use, then streamed at a budget
/// below all experts on both backings; the greedy ids are transformers',
/// `auto` on a machine without a GPU (CI) says why it stays on the CPU,
/// and the JSON report carries the expert numbers.
#[test]
fn qwen4_exp_decodes_from_the_store_cache_on_both_backings() {
    let r = reference();
    let cache = tempfile::tempdir().unwrap();
    for backing in ["slots", "mapped"] {
        let flags = ["--backing", backing, "--budget", "64K", "--json"];
        let v = ok(&decode(&fixture("qwen4_exp"), &flags, cache.path()));
        assert_eq!(v["generated_ids"], r["greedy_ids"], "{backing}");
        if v["device"] == "cpu" {
            let why = v["device_fallback"].as_str().unwrap();
            assert!(why.contains("CUDA") || why.contains("GPU"), "{why}");
        } else {
            assert_eq!(v["device"], "cuda", "{v}");
        }
        let hit = v["expert_hit_rate"].as_f64().unwrap();
        assert!(hit < 1.0, "{backing}: a 64K budget must miss: {v}");
        if backing == "slots" {
            assert!(v["bytes_read_per_token"].as_f64().unwrap() > 0.0, "{v}");
        }
    }
    let stores = std::fs::read_dir(cache.path().join("stores")).unwrap();
    assert_eq!(stores.count(), 1, "the second run reuses the cached store");
}

/// Text output streams transformers' greedy ids; `--device cuda` runs the
/// GPU decoder where there is a GPU (the same ids), and is a clear error
/// naming what is missing where there is none (CI).
#[test]
fn qwen4_exp_text_output_and_the_gpu_path() {
    let r = reference();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("q4.ftstore");
    let model = fixture("qwen4_exp");
    let out = decode(&model, &["--store", path(&store)], dir.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with(&ids(&r, "greedy_ids").replace(',', " ")),
        "{text}"
    );
    assert!(text.contains("expert hit rate"), "{text}");
    let gpu = decode(
        &model,
        &["--store", path(&store), "--device", "cuda"],
        dir.path(),
    );
    if gpu.status.success() {
        let text = String::from_utf8(gpu.stdout).unwrap();
        assert!(
            text.starts_with(&ids(&r, "greedy_ids").replace(',', " ")),
            "{text}"
        );
    } else {
        let err = refused(&gpu);
        assert!(
            err.contains("no CUDA driver") || err.contains("no CUDA device"),
            "{err}"
        );
    }
}

/// `--rows-budget`: the PLE rows from the row store (shards packed beside
/// the expert store), transformers' greedy ids at a budget of 0 and of all
/// rows, the row numbers in the JSON report; a model without row tables
/// refuses the flag.
#[test]
fn qwen4_exp_rows_from_the_row_store_at_budget_zero_and_all() {
    let r = reference();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("q4.ftstore");
    // With no cache no lookup hits; with every table cached the decode's
    // new n-grams are still read (by the prefetch) once: a hit rate is the
    // share of lookups cached before their step.
    for (budget, hit_rate) in [("0", Some(0.0)), ("1M", None)] {
        let flags = ["--store", path(&store), "--rows-budget", budget, "--json"];
        let v = ok(&decode(&fixture("qwen4_exp"), &flags, dir.path()));
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
    let other = decode(
        &fixture("mixtral"),
        &[
            "--store",
            path(&dir.path().join("m.ftstore")),
            "--rows-budget",
            "0",
        ],
        dir.path(),
    );
    let err = refused(&other);
    assert!(err.contains("no row tables"), "{err}");
}

/// `pack rows --ple` writes every PLE shard where `run` looks for it by
/// default (beside `--store`), and `run` uses those files as they are (the
/// same inodes and bytes: nothing packed again) with the same output as a
/// run that packs its own shards, which are the same files.
#[test]
fn pack_rows_ple_packs_what_run_opens_and_run_reuses_it() {
    let r = reference();
    let model = fixture("qwen4_exp");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("q4.ftstore");
    let packed = ok(&flashtier(
        &[
            "pack",
            "rows",
            "--model",
            path(&model),
            "--ple",
            "--store",
            path(&store),
            "--json",
        ],
        dir.path(),
    ));
    let rows_dir = dir.path().join("q4.ftstore.ple-rows");
    assert_eq!(
        packed["out_dir"].as_str(),
        Some(path(&rows_dir)),
        "{packed}"
    );
    assert_eq!(packed["layers"], 2, "{packed}");
    let shards = packed["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 6, "{packed}");
    let before = files(&rows_dir);
    assert_eq!(before.len(), 6, "{before:?}");
    for s in shards {
        let name = Path::new(s["path"].as_str().unwrap()).file_name().unwrap();
        assert!(before.contains_key(Path::new(name)), "{s}");
    }
    let mut outs = Vec::new();
    for (what, rows) in [("prepacked", &rows_dir), ("own", &dir.path().join("own"))] {
        let logits = dir.path().join(format!("{what}.json"));
        let flags = [
            "--store",
            path(&store),
            "--rows-budget",
            "0",
            "--rows-dir",
            path(rows),
            "--logits-out",
            path(&logits),
            "--json",
        ];
        let v = ok(&decode(&model, &flags, dir.path()));
        assert_eq!(v["generated_ids"], r["greedy_ids"], "{what}");
        outs.push(std::fs::read(&logits).unwrap());
    }
    assert_eq!(files(&rows_dir), before, "run packed the shards again");
    let own = files(&dir.path().join("own"));
    let strip = |m: &BTreeMap<PathBuf, (u64, Vec<u8>)>| -> Vec<(PathBuf, Vec<u8>)> {
        m.iter().map(|(k, v)| (k.clone(), v.1.clone())).collect()
    };
    assert_eq!(strip(&own), strip(&before), "other names or bytes");
    assert_eq!(outs[0], outs[1], "prompt logits differ");
    // With --out-dir (run's --rows-dir), and the text summary.
    let out = flashtier(
        &[
            "pack",
            "rows",
            "--model",
            path(&model),
            "--ple",
            "--out-dir",
            path(&dir.path().join("elsewhere")),
        ],
        dir.path(),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("packed 6 PLE row shards of 2 layers"),
        "{text}"
    );
    assert_eq!(files(&dir.path().join("elsewhere")).len(), 6);
}

/// `pack rows --ple` never writes over its input (a shard path that is a
/// symlink to the checkpoint's file is refused, the file unchanged), and
/// a model that is not Qwen4-Exp is refused.
#[test]
fn pack_rows_ple_refuses_to_write_over_the_checkpoint() {
    let model = rewrite::rewritten(&fixture("qwen4_exp"), |_, _| {});
    let out_dir = tempfile::tempdir().unwrap();
    let pack = |model: &Path| {
        flashtier(
            &[
                "pack",
                "rows",
                "--model",
                path(model),
                "--ple",
                "--out-dir",
                path(out_dir.path()),
                "--json",
            ],
            out_dir.path(),
        )
    };
    let first = ok(&pack(model.path()));
    let shard = PathBuf::from(first["shards"][0]["path"].as_str().unwrap());
    std::fs::remove_file(&shard).unwrap();
    let weights = model.path().join("model.safetensors");
    std::os::unix::fs::symlink(&weights, &shard).unwrap();
    let before = files(model.path());
    let err = refused(&pack(model.path()));
    assert!(
        err.contains("refusing to write") && err.contains("model.safetensors"),
        "{err}"
    );
    assert_eq!(files(model.path()), before, "the checkpoint changed");
    let err = refused(&pack(&fixture("mixtral")));
    assert!(err.contains("not Qwen4-Exp"), "{err}");
}

/// `--logits-out` is refused, naming the path, and nothing is written,
/// when it is the expert store (one still to be packed, or the store
/// cache's), a row shard, the row-shard folder, or a file in it.
#[test]
fn logits_out_refuses_the_store_and_the_row_shards() {
    let model = fixture("qwen4_exp");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("q4.ftstore");
    let flags = |out: &Path| {
        vec![
            "--store".to_string(),
            path(&store).to_string(),
            "--logits-out".to_string(),
            path(out).to_string(),
        ]
    };
    let run = |extra: Vec<String>| {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        decode(&model, &extra, dir.path())
    };
    // A store still to be packed: refused before anything is packed.
    let err = refused(&run(flags(&store)));
    assert!(err.contains(path(&store)), "{err}");
    assert!(!store.exists(), "the store was packed");
    // The store cache's store, its row shards, their folder, a new file in it.
    let cache = dir.path().join("cache");
    let cached = ["--cache", path(&cache), "--rows-budget", "0", "--json"];
    ok(&decode(&model, &cached, dir.path()));
    let before = files(&cache);
    let stored: Vec<&PathBuf> = before
        .keys()
        .filter(|p| p.components().count() == 2)
        .collect();
    assert_eq!(stored.len(), 1, "{:?}", before.keys());
    let cache_store = cache.join(stored[0]);
    let rows_dir = PathBuf::from(format!("{}.ple-rows", cache_store.display()));
    let shard = std::fs::read_dir(&rows_dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    for (out, named) in [
        (cache_store.clone(), cache_store.clone()),
        (shard.clone(), rows_dir.clone()),
        (rows_dir.clone(), rows_dir.clone()),
        (rows_dir.join("logits.json"), rows_dir.clone()),
    ] {
        let v = [&cached[..], &["--logits-out", path(&out)]].concat();
        let err = refused(&decode(&model, &v, dir.path()));
        assert!(
            err.contains("refusing to write") && err.contains(path(&named)),
            "{}: {err}",
            out.display()
        );
        assert_eq!(
            files(&cache),
            before,
            "{}: something was written",
            out.display()
        );
    }
}

/// The multimodal wrapper (`qwen4_exp` with `text_config`, tensors under
/// `model.language_model.`) through the binary: the text checkpoint's
/// greedy ids and prompt logits, with its PLE rows from the checkpoint and
/// from the row store.
#[test]
fn the_wrapper_decodes_the_text_checkpoints_ids() {
    let r = reference();
    let text = rewrite::rewritten(&fixture("qwen4_exp"), |_, _| {});
    let wrapped = rewrite::rewritten(&fixture("qwen4_exp"), rewrite::wrap);
    let dir = tempfile::tempdir().unwrap();
    let mut logits = Vec::new();
    for (what, model) in [("text", text.path()), ("wrapper", wrapped.path())] {
        for rows in [None, Some("0")] {
            let store = dir.path().join(format!("{what}.ftstore"));
            let out = dir
                .path()
                .join(format!("{what}-{}.json", rows.unwrap_or("ckpt")));
            let mut flags = vec![
                "--store",
                path(&store),
                "--json",
                "--logits-out",
                path(&out),
            ];
            if let Some(budget) = rows {
                flags.extend(["--rows-budget", budget]);
            }
            let v = ok(&decode(model, &flags, dir.path()));
            assert_eq!(v["generated_ids"], r["greedy_ids"], "{what} rows {rows:?}");
            logits.push(std::fs::read(&out).unwrap());
        }
    }
    assert!(
        logits.iter().all(|l| *l == logits[0]),
        "the prompt logits differ"
    );
}
