//! The store subcommands end to end through the built binary: pack experts,
//! inspect (human and --json), verify (good, corrupt, mismatched), demo.

use std::path::Path;
use std::process::{Command, Output};

use flashtier_format::{Dtype, Store};
use flashtier_pack::synth::{SynthArch, SynthSpec, write_checkpoint};

fn flashtier(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashtier"))
        .args(args)
        .output()
        .expect("run flashtier")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn pack_inspect_verify_and_catch_a_flipped_byte() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    write_checkpoint(
        &SynthSpec::tiny(SynthArch::Mixtral, Dtype::Bf16, 9),
        &model,
        &mut |_| {},
    )
    .expect("synth");
    let store = tmp.path().join("x.ftstore");
    let packed = json(&flashtier(&[
        "pack",
        "experts",
        "--model",
        s(&model),
        "--out",
        s(&store),
        "--json",
    ]));
    assert_eq!(packed["records"], 8);
    assert_eq!(packed["layout"], "mixtral");

    let info = json(&flashtier(&["inspect", "--json", s(&store)]));
    for field in [
        "kind",
        "format_version",
        "records",
        "record_stride_bytes",
        "payload_bytes",
        "checksum",
    ] {
        assert!(!info[field].is_null(), "inspect --json lacks {field}");
    }
    assert_eq!(info["kind"], "experts");
    assert_eq!(info["checksum"], "xxh3-64");
    let human = flashtier(&["inspect", s(&store)]);
    let human = String::from_utf8_lossy(&human.stdout);
    let w1 = human
        .lines()
        .find(|l| l.contains("w1.weight"))
        .unwrap_or_else(|| panic!("no w1.weight in {human}"));
    // The shape as plain text (`64x32`), not Rust's `[64, 32]`.
    let shape = w1.split_whitespace().rev().nth(1).unwrap_or_default();
    assert!(!w1.contains('[') && shape.split('x').count() == 2, "{w1}");

    let ok = flashtier(&["verify", s(&store), "--model", s(&model)]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );

    let offset = Store::open(&store)
        .expect("open")
        .record_offset(2)
        .expect("offset");
    let mut bytes = std::fs::read(&store).expect("read");
    bytes[offset as usize + 33] ^= 0x80;
    std::fs::write(&store, &bytes).expect("write");
    let bad = flashtier(&["verify", s(&store)]);
    assert!(!bad.status.success());
    let msg = String::from_utf8_lossy(&bad.stderr);
    assert!(
        msg.contains("first bad record 2") && msg.contains("layer=0 expert=2"),
        "{msg}"
    );
}

#[test]
fn verify_refuses_a_store_with_the_wrong_checkpoint() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    write_checkpoint(
        &SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::F16, 1),
        &a,
        &mut |_| {},
    )
    .expect("a");
    write_checkpoint(
        &SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::F16, 2),
        &b,
        &mut |_| {},
    )
    .expect("b");
    let store = tmp.path().join("a.ftstore");
    json(&flashtier(&[
        "pack",
        "experts",
        "--model",
        s(&a),
        "--out",
        s(&store),
        "--json",
    ]));
    let out = flashtier(&["verify", s(&store), "--model", s(&b)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not belong to checkpoint"));
}

#[test]
fn inspect_names_the_damage() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("junk.ftstore");
    std::fs::write(&path, vec![0u8; 8192]).expect("write");
    let out = flashtier(&["inspect", s(&path)]);
    assert!(!out.status.success());
    let msg = String::from_utf8_lossy(&out.stderr);
    assert!(
        msg.contains("not a flashtier store") && msg.contains("junk.ftstore"),
        "{msg}"
    );
}

#[test]
fn a_tiny_demo_reports_json() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("demo");
    let out = json(&flashtier(&[
        "demo",
        "--size",
        "2MiB",
        "--dir",
        s(&dir),
        "--json",
    ]));
    assert_eq!(out["verify"]["ok"], true);
    assert_eq!(out["kept"], true);
    assert!(dir.join("experts.ftstore").exists());
}

/// `demo --arch qwen4_exp`: experts and PLE rows packed, verified and
/// streamed; the JSON names both tiers.
#[test]
fn a_tiny_qwen4_demo_reports_both_tiers() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("demo");
    let out = json(&flashtier(&[
        "demo",
        "--arch",
        "qwen4_exp",
        "--size",
        "24MiB",
        "--tokens",
        "4",
        "--dir",
        s(&dir),
        "--json",
    ]));
    assert_eq!(out["checkpoint"]["arch"], "qwen4_exp_text");
    assert_eq!(out["verify"]["ok"], true);
    let shards = out["rows"]["shards"].as_u64().unwrap();
    assert!(shards >= 4, "{out}");
    assert_eq!(out["rows"]["verified"]["files"].as_u64(), Some(shards));
    assert_eq!(out["decode"]["same_tokens"], true);
    let streamed = &out["decode"]["streamed"];
    assert!(
        streamed["row_bytes_read_per_token"].as_f64().unwrap() > 0.0,
        "{out}"
    );
    assert!(
        out["decode"]["rows"]["drive_bytes_per_sec"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}

#[test]
fn a_qwen4_demo_in_another_dtype_is_refused() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flashtier"))
        .args([
            "demo",
            "--arch",
            "qwen4_exp",
            "--dtype",
            "F8_E4M3",
            "--tokens",
            "0",
        ])
        .output()
        .expect("run flashtier");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("BF16 only"), "{err}");
}
