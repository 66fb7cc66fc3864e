//! Packing the MoE experts of a Hugging Face checkpoint into an expert store.
//!
//! `pack_experts` opens the checkpoint ([`flashtier_engine::checkpoint::files`]), recognises
//! its expert tensors ([`layout`]), plans a store with one record per
//! (layer, expert), and streams the records through a bounded pipeline
//! ([`write`]): memory stays at `depth` records whatever the checkpoint's
//! size.
//!
//! The output goes through [`flashtier_io::persist`]: `OUT` may not be, or
//! link to, a file of the checkpoint (config.json, the safetensors files,
//! the index); a lock beside `OUT` makes a second pack of the same `OUT`
//! wait ([`PackOptions::wait`]); under it, an existing `OUT` is replaced only
//! when it is an exact expert store (or a damaged file with the store
//! magic), and with [`PackOptions::reuse_existing`] a complete store of the
//! same plan already there is kept instead of packed again. The store is
//! written to a unique temp file in `OUT`'s folder, synced and renamed over
//! `OUT` only when complete; a failed pack removes it.
//!
//! A multimodal wrapper (a `text_config`, the text model's tensors under
//! `model.language_model.`, as Qwen4-Exp's `qwen4_exp` saves it) is packed
//! from its text part ([`CheckpointFiles::text_part`]): the counts come
//! from `text_config` (errors name the field `text_config.<field>`), the
//! manifest's source names are the text model's
//! (`model.layers.…`), and the pairing checksums are the wrapper's files'.
//!
//! Non-expert tensors (embeddings, attention, norms, routers, shared experts,
//! dense layers) stay in the original safetensors files: duplicating them
//! would double the disk footprint for tensors that are read once at start.
//! The manifest records the checkpoint's path, the checksum of its
//! `config.json` and each safetensors file's length and header checksum, so
//! [`check_pairing`](flashtier_engine::store::check_pairing) detects a store used with a checkpoint it was not
//! packed from.
//!
//! ```
//! use flashtier_pack::pack::{PackOptions, pack_experts};
//! use flashtier_pack::synth::{SynthArch, SynthSpec, write_checkpoint};
//! use flashtier_format::{Dtype, RecordKey, Store};
//! use flashtier_io::{DirectMode, StoreFile};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let model = dir.path().join("model");
//! let spec = SynthSpec::tiny(SynthArch::Qwen3Moe, Dtype::Bf16, 42);
//! write_checkpoint(&spec, &model, &mut |_| {})?;
//! let out = dir.path().join("experts.ftstore");
//! let report = pack_experts(&PackOptions::new(&model, &out), &|_bytes| {})?;
//! let store = Store::open(&out)?;
//! assert_eq!(store.record_count(), report.records);
//! let i = store.index_of(RecordKey::new(1, 3))?; // layer 1, expert 3
//! let mut record = vec![0u8; store.payload_bytes() as usize];
//! // Records are read through flashtier-io, then checked against their checksum.
//! let file = StoreFile::open_read(&out, DirectMode::Off)?;
//! store.read_record(file.as_ref(), i, &mut record)?;
//! let gate = store.manifest().record.tensor("gate_proj.weight").expect("gate");
//! let source = spec.tensor_bytes("model.layers.1.mlp.experts.3.gate_proj.weight").expect("tensor");
//! assert_eq!(&record[gate.offset as usize..][..gate.len_bytes as usize], &source[..]);
//! # Ok(()) }
//! ```

mod write;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use flashtier_format::manifest::hex_u64;
use flashtier_format::text;
use flashtier_format::{
    Dtype, FORMAT_VERSION, Manifest, ModelInfo, RecordLayout, SourceCheckpoint, SourceFile,
    StoreKind, StoreWriterPlan, xxh3_64,
};
use flashtier_io::DirectMode;
use flashtier_io::persist::{Output, Wait, refuse_inputs};

use flashtier_engine::store::{
    ExpertFamily, ExpertLayout, ExpertTensors, PackError, expert_layout,
};

use flashtier::experts::lowbit_pack::existing_store;
use flashtier_engine::checkpoint::files::CheckpointFiles;

/// Options of [`pack_experts`].
#[derive(Clone, Debug)]
pub struct PackOptions {
    /// Checkpoint folder (config.json + safetensors).
    pub model_dir: PathBuf,
    /// Store file to write.
    pub out: PathBuf,
    /// O_DIRECT policy for the store file.
    pub direct: DirectMode,
    /// Record buffers in the pipeline (memory bound: `depth * stride`).
    pub depth: usize,
    /// Reader threads (copying tensors into records and checksumming them).
    pub readers: usize,
    /// Read the checkpoint with direct I/O (bypassing the page cache, so a
    /// checkpoint larger than memory does not evict everything else). Off by
    /// default: the page cache's read-ahead keeps the drive busier than
    /// 2 readers' direct reads, and packing measured 3x slower with it here.
    pub direct_source: bool,
    /// Writer threads.
    pub writers: usize,
    /// Whether to wait for another writer of `out` (or fail at once).
    pub wait: Wait,
    /// Keep a complete store at `out` whose manifest is the one this pack
    /// would write (another writer packed it meanwhile) instead of packing
    /// again. Off by default: an explicit pack rewrites its output.
    pub reuse_existing: bool,
}

impl PackOptions {
    /// Defaults: O_DIRECT preferred for the store, buffered checkpoint reads,
    /// 8 record buffers, 2 readers, 4 writers
    /// (queue depth 4, as fio's reference run); wait for another writer of
    /// `out`; always pack.
    #[must_use]
    pub fn new(model_dir: &Path, out: &Path) -> Self {
        Self {
            model_dir: model_dir.to_path_buf(),
            out: out.to_path_buf(),
            direct: DirectMode::Prefer,
            depth: 8,
            readers: 2,
            direct_source: false,
            writers: 4,
            wait: Wait::Block,
            reuse_existing: false,
        }
    }
}

/// What [`pack_experts`] did.
#[derive(Clone, Debug)]
pub struct PackReport {
    /// The store written.
    pub out: PathBuf,
    /// Layout family recognised.
    pub family: ExpertFamily,
    /// Element type of the matrices.
    pub dtype: Dtype,
    /// Records (experts) written.
    pub records: u64,
    /// Payload bytes per record.
    pub payload_bytes: u64,
    /// Record stride in bytes.
    pub stride_bytes: u64,
    /// Length of the store file.
    pub file_len_bytes: u64,
    /// Whether the store was written with O_DIRECT.
    pub direct: bool,
    /// Whether a complete store already at `out` was kept
    /// ([`PackOptions::reuse_existing`]) instead of packing.
    pub reused: bool,
    /// Wall time of the whole pack.
    pub elapsed: Duration,
}

fn config_u64(ckpt: &CheckpointFiles, names: &[&'static str]) -> Option<u64> {
    names
        .iter()
        .find_map(|n| ckpt.config().get(*n).and_then(serde_json::Value::as_u64))
}

fn config_err(ckpt: &CheckpointFiles, field: &'static str, why: String) -> PackError {
    PackError::Config {
        path: ckpt.dir().join("config.json"),
        scope: ckpt.config_scope(),
        field,
        why,
    }
}

/// Experts per layer: every expert layer holds experts `0..n` for one `n`,
/// inside `num_layers`. Returns the layers and `n`.
fn expert_layers(
    ckpt: &CheckpointFiles,
    layout: &ExpertLayout,
    num_layers: u64,
) -> Result<(BTreeMap<u32, BTreeSet<u32>>, u64), PackError> {
    let mut per_layer: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
    for k in &layout.keys {
        per_layer.entry(k.layer).or_default().insert(k.item);
    }
    let found = per_layer.values().next().map_or(0, BTreeSet::len) as u64;
    for (layer, experts) in &per_layer {
        let contiguous = experts.iter().copied().eq(0..experts.len() as u32);
        if !contiguous || experts.len() as u64 != found {
            return Err(PackError::Inconsistent {
                tensor: format!("model.layers.{layer} experts"),
                why: format!(
                    "layer has {} experts from {}; every expert layer must hold experts 0..{found}",
                    experts.len(),
                    experts.first().map_or(0, |e| *e)
                ),
            });
        }
        if u64::from(*layer) >= num_layers {
            return Err(config_err(
                ckpt,
                "num_hidden_layers",
                format!(
                    "{num_layers} layers (with multi-token-prediction layers), but experts exist in layer {layer}"
                ),
            ));
        }
    }
    Ok((per_layer, found))
}

/// Model facts from config.json, cross-checked against the expert tensors.
fn model_info(ckpt: &CheckpointFiles, layout: &ExpertLayout) -> Result<ModelInfo, PackError> {
    let num_layers = config_u64(ckpt, &["num_hidden_layers"])
        .ok_or_else(|| config_err(ckpt, "num_hidden_layers", "missing".into()))?;
    let hidden = config_u64(ckpt, &["hidden_size"])
        .ok_or_else(|| config_err(ckpt, "hidden_size", "missing".into()))?;
    // DeepSeek-V3 ships its multi-token-prediction layers after the decoder
    // layers (layer 61 of 61), with experts of their own.
    let mtp_layers = config_u64(ckpt, &["num_nextn_predict_layers"]).unwrap_or(0);
    let (per_layer, found) = expert_layers(ckpt, layout, num_layers.saturating_add(mtp_layers))?;
    let configured = config_u64(
        ckpt,
        &["num_experts", "num_local_experts", "n_routed_experts"],
    );
    if let Some(n) = configured.filter(|&n| n != found) {
        return Err(config_err(
            ckpt,
            "num_experts",
            format!("config says {n} experts per layer, the tensors hold {found}"),
        ));
    }
    let gate = layout.tensors.iter().find(|t| {
        (t.name.starts_with("gate_proj.") || t.name.starts_with("w1."))
            && !t.name.contains("scale")
            && t.shape.len() == 2
    });
    if let Some(g) = gate.filter(|g| g.shape[1] != hidden) {
        return Err(config_err(
            ckpt,
            "hidden_size",
            format!(
                "{hidden}, but {} has shape {}",
                g.name,
                text::shape(&g.shape)
            ),
        ));
    }
    let inter = gate
        .map(|g| g.shape[0])
        .or_else(|| config_u64(ckpt, &["moe_intermediate_size", "intermediate_size"]));
    let text = |k: &str| {
        ckpt.config()
            .get(k)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    let architecture = ckpt
        .config()
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    let to_u32 = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    Ok(ModelInfo {
        layout: layout.family.name().to_string(),
        model_type: text("model_type"),
        architecture,
        num_layers: to_u32(num_layers),
        num_experts: to_u32(found),
        experts_per_token: config_u64(ckpt, &["num_experts_per_tok"]).map(to_u32),
        hidden_size: hidden,
        expert_intermediate_size: inter.unwrap_or(0),
        expert_layers: per_layer.keys().copied().collect(),
    })
}

/// The source-checkpoint record of the manifest.
fn source_info(ckpt: &CheckpointFiles, layout: &ExpertLayout) -> SourceCheckpoint {
    let path = std::fs::canonicalize(ckpt.dir()).unwrap_or_else(|_| ckpt.dir().to_path_buf());
    SourceCheckpoint {
        path: path.display().to_string(),
        config_xxh3: hex_u64(xxh3_64(ckpt.config_bytes())),
        files: ckpt
            .files()
            .iter()
            .map(|f| SourceFile {
                name: f.name.clone(),
                len_bytes: f.len_bytes,
                header_xxh3: hex_u64(xxh3_64(&f.header)),
            })
            .collect(),
        tensor_prefix: match layout.source {
            ExpertTensors::Split => layout.family.prefix_template(),
            ExpertTensors::Fused { prefix } => prefix,
        }
        .to_string(),
        expert_tensors: layout.source.name().to_string(),
    }
}

/// Recognise the experts of `ckpt` and build the store's manifest.
/// A multimodal wrapper is planned from its text part
/// ([`CheckpointFiles::text_part`]: counts from `text_config`, tensors
/// under `model.language_model.`).
pub fn plan_experts(ckpt: &CheckpointFiles) -> Result<(ExpertLayout, Manifest), PackError> {
    let text = ckpt.text_part()?;
    let ckpt = text.as_ref().unwrap_or(ckpt);
    let layout = expert_layout(ckpt)?;
    let model = model_info(ckpt, &layout)?;
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        kind: StoreKind::Experts,
        key_fields: ["layer".into(), "expert".into()],
        dtype: layout.dtype,
        record: RecordLayout {
            payload_bytes: layout.payload_bytes,
            tensors: layout.tensors.clone(),
        },
        keys: layout.keys.clone(),
        source: Some(source_info(ckpt, &layout)),
        model: Some(model),
        extra: BTreeMap::new(),
    };
    Ok((layout, manifest))
}

/// Payload bytes the pack of `ckpt` will write (for progress bars).
pub fn planned_bytes(manifest: &Manifest) -> u64 {
    manifest
        .record
        .payload_bytes
        .saturating_mul(manifest.keys.len() as u64)
}

/// Pack the experts of `opts.model_dir` into `opts.out`. `progress` is
/// called with the payload bytes of each record as it is written.
pub fn pack_experts(
    opts: &PackOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<PackReport, PackError> {
    let t0 = Instant::now();
    let opened = CheckpointFiles::open(&opts.model_dir)?;
    // A wrapper's records are read from its text part, under the names the
    // plan gives them.
    let ckpt = match opened.text_part()? {
        Some(text) => text,
        None => opened,
    };
    refuse_inputs(&opts.out, &ckpt.input_paths())?;
    let (layout, manifest) = plan_experts(&ckpt)?;
    let plan = StoreWriterPlan::new(manifest)?;
    let mut output = Output::lock(&opts.out, opts.wait)?;
    let existing = existing_store(output.target(), false)?;
    let report = |h: &flashtier_format::Header, direct: bool, reused: bool| PackReport {
        out: opts.out.clone(),
        family: layout.family,
        dtype: layout.dtype,
        records: h.record_count,
        payload_bytes: h.payload_bytes,
        stride_bytes: h.record_stride_bytes,
        file_len_bytes: h.file_len,
        direct,
        reused,
        elapsed: t0.elapsed(),
    };
    if let Some(store) = existing.filter(|s| opts.reuse_existing && s.manifest() == plan.manifest())
    {
        return Ok(report(store.header(), false, true));
    }
    let tmp = output.create_temp()?.to_path_buf();
    let src = write::RecordSource {
        ckpt: &ckpt,
        layout: &layout,
        direct: opts.direct_source,
    };
    let shape = write::PipelineShape {
        readers: opts.readers,
        depth: opts.depth,
        writers: opts.writers,
    };
    let direct = write::write_store(&src, &plan, &tmp, opts.direct, shape, progress)?;
    output.commit()?;
    Ok(report(plan.header(), direct, false))
}
