//! The text model of a multimodal wrapper checkpoint (Qwen4-Exp's
//! `qwen4_exp`: `text_config`, tensors under `model.language_model.`), seen
//! as a text-only checkpoint.
//!
//! Invariants: the view shares the wrapper's files and raw `config.json`
//! bytes (so a store packed from it pairs with the wrapper, checked by the
//! same checksums); its parsed config is `text_config` (its fields named
//! `text_config.<field>` in errors); each tensor under
//! `model.language_model.` is listed as `model.` plus the rest of its name,
//! every other tensor (`lm_head.weight`, the vision tower's) under its own
//! name, each pointing at the same file bytes. A renamed tensor that would
//! collide with one already there is refused, naming both.

use std::collections::BTreeMap;

use super::{CheckpointError, CheckpointFiles, TensorInfo};

/// Where the wrapper keeps its text model's tensors.
pub const WRAPPER_TEXT_PREFIX: &str = "model.language_model.";

/// Where the wrapper keeps its text model's config fields.
pub const WRAPPER_TEXT_SCOPE: &str = "text_config.";

impl CheckpointFiles {
    /// The text part of a multimodal wrapper (a config with a
    /// `text_config` object and tensors under [`WRAPPER_TEXT_PREFIX`]), or
    /// `None` for a text-only checkpoint.
    pub fn text_part(&self) -> Result<Option<Self>, CheckpointError> {
        let Some(text) = self.config.get("text_config").filter(|v| v.is_object()) else {
            return Ok(None);
        };
        if !self
            .tensors
            .keys()
            .any(|n| n.starts_with(WRAPPER_TEXT_PREFIX))
        {
            return Ok(None);
        }
        let mut tensors: BTreeMap<String, TensorInfo> = BTreeMap::new();
        for (name, info) in &self.tensors {
            let renamed = match name.strip_prefix(WRAPPER_TEXT_PREFIX) {
                Some(rest) => format!("model.{rest}"),
                None => name.clone(),
            };
            if tensors.insert(renamed.clone(), info.clone()).is_some() {
                let path = self.files.get(info.file).map(|f| f.path.clone());
                return Err(CheckpointError::BadTensor {
                    path: path.unwrap_or_else(|| self.dir.clone()),
                    tensor: name.clone(),
                    why: format!(
                        "read as the text model's `{renamed}`, which the checkpoint also holds"
                    ),
                });
            }
        }
        Ok(Some(Self {
            dir: self.dir.clone(),
            config: text.clone(),
            config_bytes: self.config_bytes.clone(),
            config_scope: WRAPPER_TEXT_SCOPE,
            files: self.files.clone(),
            tensors,
        }))
    }
}
