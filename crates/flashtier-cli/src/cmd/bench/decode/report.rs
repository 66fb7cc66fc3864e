//! The report of `bench decode`: one [`Run`] per mode, the bounds they are
//! held against, transformers' runs on the same checkpoint
//! ([`hf_runs`]) and the speed-ups over them; printed as text or JSON.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use flashtier_engine::Model;
use flashtier_engine::device::cuda::CudaDevice;
use flashtier_format::Store;
use serde::Serialize;

use super::Args;
use super::measure::{Limits, Roofline, Run, Streamed};

/// The whole report, as `--json` prints it.
#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub(super) model: PathBuf,
    pub(super) layers: usize,
    pub(super) experts: usize,
    pub(super) top_k: usize,
    pub(super) record_bytes: u64,
    pub(super) expert_bytes: u64,
    pub(super) resident_weight_bytes: u64,
    pub(super) limits: Limits,
    pub(super) runs: Vec<Run>,
    pub(super) roofline: Option<Roofline>,
    pub(super) prefill_tokens: usize,
    pub(super) prefill_tokens_per_sec: Option<f64>,
    /// Device time per kernel class over one profiled prefill (seconds per
    /// prompt token).
    pub(super) prefill_classes: Option<Vec<super::measure::ClassRow>>,
    pub(super) streamed: Option<Streamed>,
    pub(super) ram_h2d_share: Option<f64>,
    pub(super) kv: Option<super::kv::KvBench>,
    pub(super) hf: Vec<serde_json::Value>,
    pub(super) speedups: serde_json::Value,
}

impl Report {
    /// A report with no run yet, over the store `opened`.
    pub(super) fn new(args: &Args, opened: &Store, weights: u64, limits: Limits) -> Self {
        let stride = opened.stride_bytes();
        Self {
            model: args.model.clone(),
            layers: 0,
            experts: 0,
            top_k: 0,
            record_bytes: stride,
            expert_bytes: stride * opened.record_count(),
            resident_weight_bytes: weights,
            limits,
            runs: Vec::new(),
            roofline: None,
            prefill_tokens: args.prefill,
            prefill_tokens_per_sec: None,
            prefill_classes: None,
            streamed: None,
            ram_h2d_share: None,
            kv: None,
            hf: Vec::new(),
            speedups: serde_json::Value::Null,
        }
    }
}

/// The run of one mode from its generation `out` under budgets `hbm`, `ram`.
pub(super) fn mode_run(
    out: &flashtier_engine::Generation,
    m: &Model<CudaDevice>,
    hbm: u64,
    ram: u64,
) -> Run {
    let steps = out.decode_steps.max(1) as f64;
    let e = out.decode_experts;
    let tiers = m.experts().tier_stats();
    Run {
        mode: String::new(),
        budget_hbm_bytes: hbm,
        budget_ram_bytes: ram,
        tokens_per_sec: out.tokens_per_sec(),
        decode_steps: out.decode_steps,
        expert_hit_rate: e.hit_rate(),
        miss_bytes_per_token: e.bytes_read as f64 / steps,
        h2d_bytes_per_token: tiers.h2d_bytes as f64
            / (out.decode_steps + out.prompt_tokens as u64).max(1) as f64,
        stall_fraction: if out.decode_secs > 0.0 {
            e.stall_ns as f64 / 1e9 / out.decode_secs
        } else {
            0.0
        },
        issue_fraction: out.decode_issue_secs.map(|s| s / out.decode_secs.max(1e-9)),
        tiers: Some(tiers),
        generated_ids: out.generated_ids.clone(),
        step_kernels: None,
    }
}

/// transformers' runs of `modes` (`tools/hf_decode_bench.py`), each
/// tagged `when` (before or after flashtier's modes) unless it is empty.
pub(super) fn hf_runs(
    script: &Path,
    args: &Args,
    modes: &[String],
    when: &str,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for mode in modes {
        let gpu_mem = format!("{}MiB", args.ram_hbm >> 20);
        let tokens = if mode == "gpu" {
            args.tokens
        } else {
            args.hf_tokens
        };
        let prefill = if mode == "gpu" { args.prefill } else { 0 };
        let o = Command::new("python3")
            .arg(script)
            .args([
                "--model",
                &args.model.to_string_lossy(),
                "--mode",
                mode,
                "--gpu-mem",
                &gpu_mem,
            ])
            .args([
                "--prompt-len",
                &args.prompt_len.to_string(),
                "--tokens",
                &tokens.to_string(),
            ])
            .args([
                "--prefill",
                &prefill.to_string(),
                "--reps",
                if mode == "gpu" { "5" } else { "1" },
            ])
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        let text = String::from_utf8_lossy(&o.stdout);
        let mut v = match text
            .lines()
            .last()
            .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        {
            Some(v) if o.status.success() => v,
            _ => serde_json::json!({
                "mode": mode,
                "error": String::from_utf8_lossy(&o.stderr).lines().rev().take(8).collect::<Vec<_>>(),
            }),
        };
        if !when.is_empty()
            && let Some(m) = v.as_object_mut()
        {
            m.insert("when".to_owned(), when.into());
        }
        out.push(v);
    }
    Ok(out)
}

pub(super) fn speedups(r: &Report) -> serde_json::Value {
    let ours: Vec<(&str, f64)> = r
        .runs
        .iter()
        .map(|x| (x.mode.as_str(), x.tokens_per_sec))
        .collect();
    speedups_of(&ours, r.prefill_tokens_per_sec, &r.hf)
}

/// Our tokens/s (by mode) and prefill over transformers' runs: where
/// transformers ran a mode more than once (`--hf-bracket`), over its
/// fastest run.
fn speedups_of(
    ours: &[(&str, f64)],
    prefill: Option<f64>,
    hf_runs: &[serde_json::Value],
) -> serde_json::Value {
    let ours = |mode: &str| ours.iter().find(|x| x.0 == mode).map(|x| x.1);
    let hf = |mode: &str, key: &str| {
        hf_runs
            .iter()
            .filter(|v| v["mode"] == mode)
            .filter_map(|v| v[key].as_f64())
            .reduce(f64::max)
    };
    let div = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
    serde_json::json!({
        "resident_vs_transformers_gpu": div(ours("resident"), hf("gpu", "decode_tokens_per_sec")),
        "ram_vs_transformers_offload": div(ours("ram"), hf("offload", "decode_tokens_per_sec")),
        "prefill_vs_transformers_gpu": div(prefill, hf("gpu", "prefill_tokens_per_sec")),
    })
}

/// Write `r` as JSON to `--json-out`, and print it with `--json`; whether
/// it was printed (the text report is then left out).
pub(super) fn emit_json(args: &Args, r: &impl Serialize) -> anyhow::Result<bool> {
    let text = serde_json::to_string_pretty(r)?;
    if let Some(path) = &args.json_out {
        flashtier_io::persist::write_file(path, text.as_bytes(), flashtier_io::Wait::Block)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{text}");
    }
    Ok(args.json)
}

pub(super) fn emit(args: &Args, r: &Report) -> anyhow::Result<()> {
    if emit_json(args, r)? {
        return Ok(());
    }
    let gb = |b: f64| b / 1e9;
    println!(
        "{}: HBM read {:.0} GB/s, d2d copy {:.0} GB/s, pinned h2d {:.1} GB/s",
        r.limits.gpu,
        gb(r.limits.hbm_read_bytes_per_sec),
        gb(r.limits.d2d_copy_bytes_per_sec),
        gb(r.limits.h2d_pinned_bytes_per_sec)
    );
    for x in &r.runs {
        println!(
            "{:>9}: {:7.1} tok/s, hit rate {:.3}, {:.1} MB read/token, {:.1} MB h2d/token, stall {:.0}%",
            x.mode,
            x.tokens_per_sec,
            x.expert_hit_rate,
            x.miss_bytes_per_token / 1e6,
            x.h2d_bytes_per_token / 1e6,
            100.0 * x.stall_fraction
        );
        if let Some(f) = x.issue_fraction {
            println!(
                "{:>9}  host issuing the steps {:.0}% of the decode time, waiting on their tokens {:.0}%",
                "",
                100.0 * f,
                100.0 * (1.0 - f)
            );
        }
        if let Some(k) = x.step_kernels {
            println!(
                "{:>9}  {} kernels a step, {} of them in {} graph launches",
                "", k.kernels, k.in_graphs, k.graph_launches
            );
        }
    }
    if let Some(rf) = &r.roofline {
        println!(
            "roofline: {:.1}% of the HBM read bound ({:.2} GB/token)",
            100.0 * rf.fraction,
            gb(rf.bytes_per_token)
        );
        for c in &rf.classes {
            println!(
                "  {:>12?}: {:8.1} us/token, {:5.1}% of read bandwidth",
                c.time.class,
                c.secs_per_token * 1e6,
                100.0 * c.fraction_of_read_bandwidth
            );
        }
    }
    if let Some(classes) = &r.prefill_classes {
        println!(
            "prefill of {} tokens: {:.0} tok/s; per class (a profiled pass):",
            r.prefill_tokens,
            r.prefill_tokens_per_sec.unwrap_or(0.0)
        );
        for c in classes {
            println!(
                "  {:>12?}: {:8.2} us/token, {:8.2} ms in all, {:5.1}% of read bandwidth",
                c.time.class,
                c.secs_per_token * 1e6,
                c.time.secs * 1e3,
                100.0 * c.fraction_of_read_bandwidth
            );
        }
    }
    if let Some(s) = &r.streamed {
        println!(
            "streamed: drive {:.2} GB/s (probes before / after the decode: {:.2} / {:.2}), I/O bound {:.2} tok/s, {:.0}% of it; at 14 GB/s: {:.1} tok/s",
            gb(s.drive_bytes_per_sec),
            gb(s.drive_before_bytes_per_sec),
            gb(s.drive_after_bytes_per_sec),
            s.io_bound_tokens_per_sec,
            100.0 * s.fraction_of_io_bound,
            s.projected_tokens_per_sec_at_14gbps
        );
        if s.fraction_of_io_bound > 1.1 {
            println!(
                "  (above the bound: the decode's reads went faster than the probes' {} fresh records each before and after it, so the drive varied; read the fraction as 100%, not more)",
                s.drive_probe_reads
            );
        }
    }
    if let Some(k) = &r.kv {
        super::kv::print(k);
    }
    println!("speed-ups: {}", r.speedups);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::speedups_of;

    #[test]
    fn speedups_divide_by_transformers_fastest_run() {
        let hf = vec![
            serde_json::json!({"mode": "gpu", "when": "before", "decode_tokens_per_sec": 50.0,
                "prefill_tokens_per_sec": 2000.0}),
            serde_json::json!({"mode": "gpu", "when": "after", "decode_tokens_per_sec": 25.0,
                "prefill_tokens_per_sec": 4000.0}),
            serde_json::json!({"mode": "offload", "error": ["out of memory"]}),
        ];
        let s = speedups_of(&[("resident", 1000.0), ("ram", 50.0)], Some(1000.0), &hf);
        assert_eq!(s["resident_vs_transformers_gpu"].as_f64(), Some(20.0));
        assert_eq!(s["prefill_vs_transformers_gpu"].as_f64(), Some(0.25));
        // A mode whose run failed has no speed-up.
        assert!(s["ram_vs_transformers_offload"].is_null());
        // One run: divided by it.
        let s = speedups_of(&[("resident", 1000.0)], None, &hf[1..2]);
        assert_eq!(s["resident_vs_transformers_gpu"].as_f64(), Some(40.0));
        assert!(s["prefill_vs_transformers_gpu"].is_null());
    }
}
