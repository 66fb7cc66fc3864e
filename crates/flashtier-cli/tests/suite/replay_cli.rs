//! `flashtier replay` end to end: a store on disk, a synthetic and a file
//! trace, JSON output with the documented keys.

use std::process::Command;

use flashtier::experts::testing::write_store;
use flashtier::experts::tracegen::{TraceFamily, generate};

#[test]
fn replay_prints_the_documented_json() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("e.ftstore");
    write_store(&store, 4, 16, 4096)?;
    let trace_path = dir.path().join("t.jsonl");
    let trace = generate(&TraceFamily::Local.params(4, 16, 2, 50, 3))?;
    trace.write(std::fs::File::create(&trace_path)?)?;
    for (trace_arg, backing) in [
        ("synth:decode".to_string(), "slots"),
        (trace_path.display().to_string(), "mapped"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_flashtier"))
            .args(["replay", "--store"])
            .arg(&store)
            .args([
                "--trace",
                &trace_arg,
                "--budget",
                "64Ki",
                "--backing",
                backing,
            ])
            .args(["--backend", "posix", "--tokens", "40", "--json"])
            .output()?;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        for key in [
            "hit_rate",
            "lru_hit_rate",
            "belady_hit_rate",
            "bytes_read",
            "bytes_per_sec",
            "stall_ms_per_token",
        ] {
            assert!(
                v.get(key).is_some_and(serde_json::Value::is_number),
                "missing {key}: {v}"
            );
        }
        let rate = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        assert!(rate("hit_rate") <= rate("belady_hit_rate"));
        assert_eq!(v["capacity_records"], 16);
    }
    Ok(())
}

#[test]
fn replay_reports_a_bad_trace_with_its_line() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("e.ftstore");
    write_store(&store, 2, 4, 4096)?;
    let trace_path = dir.path().join("bad.jsonl");
    std::fs::write(
        &trace_path,
        "{\"format\":\"flashtier-trace\",\"version\":1,\"layers\":2,\"experts\":4}\n{\"ids\":[[9],[0]]}\n",
    )?;
    let out = Command::new(env!("CARGO_BIN_EXE_flashtier"))
        .args(["replay", "--store"])
        .arg(&store)
        .arg("--trace")
        .arg(&trace_path)
        .args(["--budget", "1M", "--backend", "posix"])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2") && err.contains("expert 9"), "{err}");
    Ok(())
}

#[test]
fn pack_writes_low_bit_companions_and_replay_reads_the_packed_store() -> anyhow::Result<()> {
    use flashtier_format::{Dtype, Store};
    use flashtier_pack::synth::{SynthArch, SynthSpec, write_checkpoint};
    let dir = tempfile::tempdir()?;
    let model = dir.path().join("model");
    write_checkpoint(
        &SynthSpec::tiny(SynthArch::Mixtral, Dtype::Bf16, 9),
        &model,
        &mut |_| {},
    )?;
    let store = dir.path().join("x.ftstore");
    let out = Command::new(env!("CARGO_BIN_EXE_flashtier"))
        .args(["pack", "experts", "--model"])
        .arg(&model)
        .arg("--out")
        .arg(&store)
        .args(["--lowbit", "3,2", "--json"])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let lowbit = v["lowbit"].as_array().cloned().unwrap_or_default();
    assert_eq!(lowbit.len(), 2, "{v}");
    let exact = Store::open(&store)?;
    for (bits, entry) in [3u64, 2].iter().zip(&lowbit) {
        let path = dir.path().join(format!("x.q{bits}.ftstore"));
        let low = Store::open(&path)?;
        assert_eq!(low.manifest().keys, exact.manifest().keys);
        assert_eq!(low.manifest().extra["lowbit"]["bits"], *bits);
        assert!(low.payload_bytes() < exact.payload_bytes());
        assert_eq!(entry["spec"]["bits"], *bits);
    }
    let out = Command::new(env!("CARGO_BIN_EXE_flashtier"))
        .args(["replay", "--store"])
        .arg(&store)
        .args([
            "--trace",
            "synth:zipf",
            "--tokens",
            "20",
            "--budget",
            "1Gi",
            "--backend",
            "posix",
            "--json",
        ])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(
        r["capacity_records"], 8,
        "budget larger than the store: every record fits"
    );
    Ok(())
}
