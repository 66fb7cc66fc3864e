//! The demo's reports: the human one (one numbered line per step) and the
//! `--json` one.

use flashtier::experts::replay::ReplayReport;
use flashtier::verify::VerifyReport;
use flashtier_pack::demo::{
    Bound, DecodeRun, DemoModel, DemoReport, FAST_DRIVE_BYTES_PER_SEC, RowsPacked,
};
use flashtier_pack::pack::PackReport;
use flashtier_pack::synth::SynthReport;

use super::{RowsVerified, Workspace};
use crate::kit;

/// What the demo's steps gave.
pub(super) struct Done {
    pub(super) synth: SynthReport,
    pub(super) packed: PackReport,
    pub(super) rows: Option<(RowsPacked, RowsVerified)>,
    pub(super) checked: VerifyReport,
    pub(super) replayed: ReplayReport,
    pub(super) decoded: Result<DemoReport, String>,
}

fn mib(b: f64) -> f64 {
    b / f64::from(1 << 20)
}

/// The model line of step 1.
fn model_line(model: &DemoModel) -> String {
    match model {
        DemoModel::Moe(s) => format!(
            "{}: {} layers x {} experts (top-{}), hidden {}, expert intermediate {}, {}",
            s.arch.model_type(),
            s.layers,
            s.experts,
            s.experts_per_token,
            s.hidden,
            s.intermediate,
            s.dtype
        ),
        DemoModel::Qwen4 { spec: s, .. } => format!(
            "qwen4_exp_text: {} layers (GatedDeltaNet, QSA every 4th) x {} experts (top-{}, shared expert), hidden {} x {} streams, expert intermediate {}, PLE on layers {:?} ({} n-gram heads, {:.1} MiB of tables in {} shards each), BF16",
            s.layers,
            s.experts,
            s.experts_per_token,
            s.hidden,
            s.hc_count,
            s.intermediate,
            s.ple_layers,
            s.ngram_heads(),
            mib(s.table_bytes() as f64),
            s.split_parts
        ),
    }
}

pub(super) fn human(model: &DemoModel, ws: &Workspace, d: &Done) {
    println!(
        "1. generated a synthetic {} ({:.1} MiB in {} files)\n   {}",
        model_line(model),
        mib(d.synth.bytes as f64),
        d.synth.files.len(),
        ws.model.display()
    );
    println!("2. {}", kit::pack_line(&d.packed));
    if let Some((p, _)) = &d.rows {
        println!(
            "   packed the PLE tables into {} row shards ({:.1} MiB, a checksum per 4 KiB block) in {}",
            p.files.len(),
            mib(p.file_bytes as f64),
            p.dir.display()
        );
    }
    println!(
        "3. verified all {} records ({:.1} MiB, checksums and padding) and the pairing with the checkpoint",
        d.checked.units,
        mib(d.checked.bytes as f64)
    );
    if let Some((_, v)) = &d.rows {
        println!(
            "   verified all {} row blocks of the {} shards ({:.1} MiB)",
            v.blocks,
            v.files,
            mib(v.bytes as f64)
        );
    }
    let r = &d.replayed;
    println!(
        "4. replayed {} tokens of a synthetic decode trace under a {:.0} MiB budget ({} records, {}):\n   hit rate {:.1}%  (LRU {:.1}%, Belady optimum {:.1}%), read {:.1} MiB at {:.0} MiB/s",
        r.tokens,
        mib(r.budget_bytes as f64),
        r.capacity_records,
        r.policy,
        100.0 * r.hit_rate,
        100.0 * r.lru_hit_rate,
        100.0 * r.belady_hit_rate,
        mib(r.bytes_read as f64),
        mib(r.bytes_per_sec)
    );
    match &d.decoded {
        Ok(x) => human_decode(x),
        Err(why) => println!("5. decode skipped: {why}"),
    }
    if ws.kept() {
        println!(
            "kept: {}  (try `flashtier inspect {}`)",
            ws.root.display(),
            ws.store.display()
        );
    } else {
        println!(
            "removed the temporary folder {} (use --keep or --dir to keep it)",
            ws.root.display()
        );
    }
}

fn where_ran(r: &DecodeRun) -> String {
    match (&r.gpu_name, &r.fallback) {
        (Some(gpu), _) => format!(
            "on the GPU ({gpu}; HBM expert slots under the budget, misses NVMe -> pinned -> HBM)"
        ),
        (None, Some(why)) => format!("on the CPU (no GPU: {why})"),
        (None, None) => "on the CPU".to_owned(),
    }
}

fn human_decode(x: &DemoReport) {
    let s = &x.streamed;
    let what = if x.rows.is_some() {
        "experts and PLE rows"
    } else {
        "experts"
    };
    println!(
        "5. decoded {} tokens {} with {what} streamed; experts under a {:.0} MiB budget ({:.0} MiB of experts):\n   {:.1} tok/s, expert hit rate {:.1}%, {:.1} MiB read per token, stall {:.0}%",
        s.steps,
        where_ran(s),
        mib(x.budget_bytes as f64),
        mib(x.expert_bytes as f64),
        s.tokens_per_sec,
        100.0 * s.expert_hit_rate,
        mib(s.miss_bytes_per_token),
        100.0 * s.stall_fraction
    );
    if let (Some(r), Some(hit), Some(bytes), Some(stall)) = (
        &x.rows,
        s.row_hit_rate,
        s.row_bytes_read_per_token,
        s.row_stall_fraction,
    ) {
        println!(
            "   PLE rows under a {:.1} MiB budget ({:.0}% of {:.1} MiB of tables), prefetched as each token is known: hit rate {:.1}%, {:.0} KiB read per token, row stall {:.1}% of step time",
            mib(r.budget_bytes as f64),
            100.0 * r.budget_bytes as f64 / r.table_bytes.max(1) as f64,
            mib(r.table_bytes as f64),
            100.0 * hit,
            bytes / 1024.0,
            100.0 * stall
        );
    }
    let mut drive = format!(
        "the drive read records of the same size at the same queue depth at {:.0} MiB/s",
        mib(x.drive_bytes_per_sec)
    );
    if let Some(r) = &x.rows {
        drive.push_str(&format!(
            " and 4 KiB row blocks {} at a time at {:.0} MiB/s",
            r.queue_depth,
            mib(r.drive_bytes_per_sec)
        ));
    }
    drive.push_str(" in this run");
    match x.bound {
        Bound::Measured { fraction } => println!(
            "   I/O bound {:.1} tok/s ({drive}): {:.0}% of the bound",
            x.io_bound_tokens_per_sec,
            100.0 * fraction
        ),
        Bound::Unmeasurable { ratio } => println!(
            "   no drive bound on this machine: the decode ran {ratio:.1}x faster than {drive}, so memory (a virtual disk's host cache) served some reads; replaying the decode's own reads gave {:.0} MiB/s",
            mib(x.replay_bytes_per_sec)
        ),
        Bound::NoReads => println!("   every expert use hit memory: nothing read, no I/O bound"),
    }
    let p = &x.projection;
    println!(
        "   on a {:.0} GB/s drive (a projection: {:.2} ms/token not waiting for reads, the same reads in {:.2} ms there): {:.1} tok/s",
        FAST_DRIVE_BYTES_PER_SEC / 1e9,
        1e3 * p.compute_secs_per_token,
        1e3 * p.drive_secs_per_token,
        p.tokens_per_sec
    );
    if let (Some(busy), Some(depth)) = (s.drive_busy_share, s.reads_in_flight_while_busy) {
        println!(
            "   expert reads in flight {:.0}% of the decode ({depth:.1} on average while any were; the drive probes keep {})",
            100.0 * busy,
            x.queue_depth
        );
    }
    let rows = if x.rows.is_some() {
        ", rows from the checkpoint"
    } else {
        ""
    };
    println!(
        "   CPU reference (mapped page-cache backing{rows}): {:.1} tok/s, hit rate {:.1}%; same tokens: {}",
        x.mapped.tokens_per_sec,
        100.0 * x.mapped.expert_hit_rate,
        if x.same_tokens { "yes" } else { "NO" }
    );
}

fn checkpoint_json(model: &DemoModel, ws: &Workspace, d: &Done) -> serde_json::Value {
    let mut c = match model {
        DemoModel::Moe(s) => serde_json::json!({
            "arch": s.arch.model_type(), "dtype": s.dtype.name(), "layers": s.layers,
            "experts": s.experts, "experts_per_token": s.experts_per_token, "hidden": s.hidden,
            "expert_intermediate": s.intermediate, "seed": s.seed,
        }),
        DemoModel::Qwen4 { spec: s, .. } => serde_json::json!({
            "arch": "qwen4_exp_text", "dtype": "BF16", "layers": s.layers,
            "experts": s.experts, "experts_per_token": s.experts_per_token, "hidden": s.hidden,
            "expert_intermediate": s.intermediate, "hc_count": s.hc_count, "ple_layer_ids": s.ple_layers,
            "ngram_heads": s.ngram_heads(), "table_bytes": s.table_bytes(), "split_ngram_parts": s.split_parts,
            "seed": s.seed,
        }),
    };
    if let Some(o) = c.as_object_mut() {
        o.insert("path".into(), serde_json::json!(ws.model));
        o.insert("bytes".into(), serde_json::json!(d.synth.bytes));
        o.insert("files".into(), serde_json::json!(d.synth.files.len()));
    }
    c
}

pub(super) fn to_json(model: &DemoModel, ws: &Workspace, d: &Done) -> serde_json::Value {
    serde_json::json!({
        "dir": ws.root,
        "kept": ws.kept(),
        "checkpoint": checkpoint_json(model, ws, d),
        "pack": kit::pack_json(&d.packed),
        "rows": d.rows.as_ref().map(|(p, v)| serde_json::json!({
            "dir": p.dir, "shards": p.files.len(), "bytes": p.file_bytes, "table_bytes": p.table_bytes,
            "verified": v,
        })),
        "verify": d.checked.to_json(),
        "replay": d.replayed,
        "decode": match &d.decoded {
            Ok(x) => serde_json::to_value(x).unwrap_or(serde_json::Value::Null),
            Err(why) => serde_json::json!({ "skipped": why }),
        },
    })
}
