//! `flashtier inspect`: a human summary of a store file, or JSON.

use std::collections::BTreeMap;
use std::path::PathBuf;

use flashtier_format::{FORMAT_VERSION, Store};

/// Options of `flashtier inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Store file.
    pub file: PathBuf,
    /// Print JSON on stdout (kind, format_version, records,
    /// record_stride_bytes, payload_bytes, checksum, and the manifest).
    #[arg(long)]
    pub json: bool,
}

/// The JSON summary of an opened store.
pub fn store_json(store: &Store) -> serde_json::Value {
    let h = store.header();
    serde_json::json!({
        "file": store.path(),
        "kind": h.kind.name(),
        "format_version": FORMAT_VERSION,
        "records": h.record_count,
        "record_stride_bytes": h.record_stride_bytes,
        "payload_bytes": h.payload_bytes,
        "checksum": h.checksum_algo.name(),
        "file_len_bytes": h.file_len,
        "records_offset": h.records_offset,
        "checksum_table_offset": h.checksum_table_offset,
        "manifest_offset": h.manifest_offset,
        "manifest_len": h.manifest_len,
        "manifest": store.manifest(),
    })
}

fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1 << 20)
}

/// The human summary of an opened store.
pub fn store_summary(store: &Store) -> String {
    let h = store.header();
    let m = store.manifest();
    let mut s = format!(
        "{}\n  kind {} · format v{FORMAT_VERSION} · checksum {}\n  {} records · stride {} B · payload {} B ({:.2} MiB) · file {:.1} MiB\n  dtype {}\n",
        store.path().display(),
        h.kind,
        h.checksum_algo.name(),
        h.record_count,
        h.record_stride_bytes,
        h.payload_bytes,
        mib(h.payload_bytes),
        mib(h.file_len),
        m.dtype,
    );
    s.push_str("  record layout:\n");
    for t in &m.record.tensors {
        s.push_str(&format!(
            "    @{:>10}  {:>10} B  {:<8} {:?}  {}\n",
            t.offset,
            t.len_bytes,
            t.dtype.name(),
            t.shape,
            t.name
        ));
    }
    let mut per_layer: BTreeMap<u32, usize> = BTreeMap::new();
    for k in &m.keys {
        *per_layer.entry(k.layer).or_default() += 1;
    }
    if let (Some((first, n)), Some(last)) = (per_layer.iter().next(), per_layer.keys().last()) {
        s.push_str(&format!(
            "  keys ({}, {}): {} layers ({first}..={last}), {n} per layer in layer {first}\n",
            m.key_fields[0],
            m.key_fields[1],
            per_layer.len()
        ));
    }
    if let Some(model) = &m.model {
        s.push_str(&format!(
            "  model: {} ({}), layout {}, {} layers, {} experts (top-{}), hidden {}, expert intermediate {}\n",
            model.architecture,
            model.model_type,
            model.layout,
            model.num_layers,
            model.num_experts,
            model.experts_per_token.map_or_else(|| "?".into(), |k| k.to_string()),
            model.hidden_size,
            model.expert_intermediate_size
        ));
    }
    if let Some(src) = &m.source {
        s.push_str(&format!(
            "  source: {} ({} safetensors files, {} expert tensors under {}; non-expert tensors are read from there)\n",
            src.path,
            src.files.len(),
            src.expert_tensors,
            src.tensor_prefix
        ));
    }
    s
}

/// Run `flashtier inspect`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let store = Store::open(&args.file)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&store_json(&store))?);
    } else {
        print!("{}", store_summary(&store));
    }
    Ok(())
}
