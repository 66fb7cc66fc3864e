//! The config's counts against the checkpoint, before any expert is laid
//! out.
//!
//! `num_hidden_layers` is a count and the checkpoint's `model.layers.N.*`
//! tensors name exactly layers `0..num_hidden_layers` (DeepSeek's
//! `num_nextn_predict_layers` may follow), so the manifest never records a
//! layer count the checkpoint does not have; every other count the manifest
//! takes from the config ([`COUNT_FIELDS`]) is a count when present (a field
//! of the wrong type is named as such, not as missing).

use crate::checkpoint::files::CheckpointFiles as Checkpoint;
use crate::config::bounds::{checkpoint_layers, layer_mismatch};
use crate::store::PackError;

/// The config fields the manifest takes counts from.
const COUNT_FIELDS: [&str; 9] = [
    "num_hidden_layers",
    "num_nextn_predict_layers",
    "hidden_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "intermediate_size",
];

/// The config's counts against the checkpoint (see the module docs).
pub fn check_config_counts(ckpt: &Checkpoint) -> Result<(), PackError> {
    let err = |field: &'static str, why: String| PackError::Config {
        path: ckpt.dir().join("config.json"),
        scope: ckpt.config_scope(),
        field,
        why,
    };
    let count = |field: &'static str| match ckpt.config().get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| err(field, format!("{v} is not a count"))),
    };
    for field in COUNT_FIELDS {
        count(field)?;
    }
    let layers =
        count("num_hidden_layers")?.ok_or_else(|| err("num_hidden_layers", "missing".into()))?;
    let extra = count("num_nextn_predict_layers")?.unwrap_or(0);
    let present = checkpoint_layers(ckpt.tensors().keys().map(String::as_str));
    match layer_mismatch(layers, extra, &present) {
        Some(found) => Err(err("num_hidden_layers", format!("{layers}, but {found}"))),
        None => Ok(()),
    }
}
