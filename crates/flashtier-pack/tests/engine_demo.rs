//! The decode demo end to end on a tiny synthetic model (no timing asserted).
#![allow(clippy::unwrap_used, reason = "test")]

use flashtier_format::Dtype;
use flashtier_pack::demo::{Bound, DemoModel, DemoOptions, DemoPhase, run_decode_demo};
use flashtier_pack::synth::{SynthArch, SynthSpec};

#[test]
fn tiny_demo_streams_and_maps_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = DemoOptions::new(dir.path());
    let mut spec = SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::Bf16, 3);
    spec.experts = 8;
    opts.model = DemoModel::Moe(spec);
    opts.tokens = 6;
    opts.probe_records = 4;
    opts.reps = 2;
    let phases = std::sync::Mutex::new(Vec::new());
    let report = run_decode_demo(&opts, &|p| {
        let mut seen = phases.lock().unwrap();
        if seen.last() != Some(&p.phase) {
            seen.push(p.phase);
        }
        assert!(p.done <= p.total, "{p:?}");
    })
    .unwrap();
    assert!(report.same_tokens);
    assert_eq!(report.streamed.generated_ids.len(), 6);
    assert_eq!(report.streamed.steps, 5);
    // 25% of 16 records: the budget holds 4, so the experts are 4x the budget.
    assert!(report.budget_bytes * 4 <= report.expert_bytes + 4 * 4096 * 16);
    assert!(report.streamed.miss_bytes_per_token > 0.0);
    assert!(report.drive_bytes_per_sec > 0.0 && report.io_bound_tokens_per_sec > 0.0);
    // Either a share of the bound, or the report says the machine served
    // reads from memory: never a "fraction" above the bound.
    match report.bound {
        Bound::Measured { fraction } => assert!(fraction > 0.0 && fraction <= 1.1),
        Bound::Unmeasurable { ratio } => assert!(ratio > 1.1),
        Bound::NoReads => panic!(
            "the streamed decode read {} B/token",
            report.streamed.miss_bytes_per_token
        ),
    }
    // The reference is the CPU engine on the mapped backing; the streamed
    // decode ran where `auto` put it and says why when that was the CPU.
    assert_eq!(
        (
            report.mapped.device.as_str(),
            report.mapped.backing.as_str()
        ),
        ("cpu", "mapped")
    );
    match report.streamed.device.as_str() {
        "cuda" => assert!(report.streamed.gpu_name.is_some()),
        "cpu" => assert!(report.streamed.fallback.is_some()),
        other => panic!("device {other}"),
    }
    assert_eq!(report.drive_probes_bytes_per_sec.len(), 3);
    assert_eq!(report.fractions_of_io_bound.len(), 2);
    assert!(report.replay_bytes_per_sec > 0.0);
    let seen = phases.into_inner().unwrap();
    for phase in [
        DemoPhase::Generate,
        DemoPhase::Pack,
        DemoPhase::Streamed,
        DemoPhase::Mapped,
    ] {
        assert!(seen.contains(&phase), "{phase:?} missing from {seen:?}");
    }
}

/// The synthetic DeepSeek-V3 (latent attention, routing bias, shared
/// expert) in the hub's FP8 blocks: packed, streamed and mapped decodes
/// agree with each other and with the checkpoint source.
#[test]
fn tiny_fp8_deepseek_streams_and_maps_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = DemoOptions::new(dir.path());
    let mut spec = SynthSpec::tiny(SynthArch::DeepSeek, Dtype::F8E4M3, 5);
    spec.experts = 8;
    opts.model = DemoModel::Moe(spec);
    opts.tokens = 5;
    opts.probe_records = 4;
    opts.reps = 1;
    let report = run_decode_demo(&opts, &|_| {}).unwrap();
    assert!(report.same_tokens);
    assert_eq!(report.streamed.generated_ids.len(), 5);
    // A fresh load of the demo's store (dense FP8 weights from the
    // checkpoint, experts with their block scales) decodes the same tokens.
    let model_dir = dir.path().join("model");
    let store = dir.path().join("experts.ftstore");
    let load = flashtier_engine::load::LoadOptions::store(&store);
    let mut m = flashtier_engine::load::load_cpu(&model_dir, &load).unwrap();
    // The demo's prompt (see `run_decode_demo`).
    let vocab = m.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..opts.prompt_len as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let out = m.generate(&prompt, 5, &[], false, |_| {}).unwrap();
    assert_eq!(out.generated_ids, report.streamed.generated_ids);
}

/// The Qwen4-Exp demo: experts through the pool and PLE rows through the
/// row store at 10% of the tables, the same tokens as the mapped reference
/// reading its rows from the checkpoint; both tiers read and are reported.
#[test]
fn tiny_qwen4_demo_streams_experts_and_rows() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = DemoOptions::new(dir.path());
    opts.model = DemoModel::qwen4(24 << 20, 3);
    let DemoModel::Qwen4 { spec, .. } = opts.model.clone() else {
        unreachable!()
    };
    opts.tokens = 5;
    opts.probe_records = 4;
    opts.reps = 2;
    let phases = std::sync::Mutex::new(Vec::new());
    let report = run_decode_demo(&opts, &|p| {
        let mut seen = phases.lock().unwrap();
        if seen.last() != Some(&p.phase) {
            seen.push(p.phase);
        }
    })
    .unwrap();
    assert!(report.same_tokens);
    assert_eq!(report.streamed.generated_ids.len(), 5);
    let rows = report.rows.as_ref().expect("the row report");
    let shards = spec.ple_layers.len() * spec.split_parts as usize;
    assert_eq!(rows.shard_files, shards);
    assert_eq!(rows.table_bytes, spec.table_bytes());
    assert_eq!(rows.budget_bytes, spec.table_bytes() / 10);
    assert!(rows.shard_bytes > rows.table_bytes);
    assert_eq!(rows.drive_probes_bytes_per_sec.len(), 3);
    let s = &report.streamed;
    assert!(s.row_bytes_read_per_token.unwrap() > 0.0, "{s:?}");
    assert!((0.0..=1.0).contains(&s.row_hit_rate.unwrap()));
    assert!((0.0..1.0).contains(&s.row_stall_fraction.unwrap()));
    assert!(s.miss_bytes_per_token > 0.0);
    assert_eq!(report.mapped.row_hit_rate, None);
    // `auto` takes the GPU where there is one, and says why it did not.
    if s.device == "cpu" {
        assert!(s.fallback.as_deref().unwrap().contains("CUDA"), "{s:?}");
    } else {
        assert_eq!(s.device, "cuda");
    }
    assert!(report.io_bound_tokens_per_sec.is_finite());
    // The posix backend meters the decode's expert reads: some time busy,
    // never more reads in flight than the queue depth.
    let busy = s.drive_busy_share.expect("posix meters its reads");
    assert!(busy > 0.0 && busy <= 1.0, "{s:?}");
    let depth = s.reads_in_flight_while_busy.unwrap();
    assert!(
        (1.0..=report.queue_depth as f64 + 1e-9).contains(&depth),
        "{s:?}"
    );
    // The mapped reference reads through the page cache: its backend's
    // meter has at most nothing to show.
    assert!(
        report.mapped.drive_busy_share.is_none_or(|b| b <= 1.0),
        "{:?}",
        report.mapped
    );
    let seen = phases.into_inner().unwrap();
    assert!(seen.contains(&DemoPhase::PackRows), "{seen:?}");
}
