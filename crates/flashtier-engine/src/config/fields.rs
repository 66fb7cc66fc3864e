//! Typed access to the fields of `config.json`, each error naming the
//! field: a count is a non-negative integer of at most
//! [`bounds::MAX_CONFIG_COUNT`], "missing" means absent or null, and a
//! value of the wrong type says so.

use serde_json::{Map, Value};

use super::{Arch, bounds};
use crate::error::EngineError;

/// Typed access to the fields of one JSON object.
pub(super) struct Fields<'a>(pub(super) &'a Map<String, Value>);

impl Fields<'_> {
    pub(super) fn get(&self, field: &str) -> Option<&Value> {
        self.0.get(field).filter(|v| !v.is_null())
    }

    pub(super) fn str(&self, field: &str) -> Result<&str, EngineError> {
        self.get(field)
            .ok_or_else(|| EngineError::config(field, "missing"))?
            .as_str()
            .ok_or_else(|| EngineError::config(field, "not a string"))
    }

    /// A count: a non-negative integer of at most
    /// [`bounds::MAX_CONFIG_COUNT`].
    pub(super) fn opt_usize(&self, field: &str) -> Result<Option<usize>, EngineError> {
        let Some(v) = self.get(field) else {
            return Ok(None);
        };
        let n = v
            .as_u64()
            .ok_or_else(|| EngineError::config(field, format!("{v} is not a count")))?;
        if n > bounds::MAX_CONFIG_COUNT {
            return Err(EngineError::config(
                field,
                format!(
                    "{n} is over the limit of {} for a count",
                    bounds::MAX_CONFIG_COUNT
                ),
            ));
        }
        usize::try_from(n)
            .map(Some)
            .map_err(|_| EngineError::config(field, format!("{n} overflows this machine's sizes")))
    }

    pub(super) fn opt_positive(&self, field: &str) -> Result<Option<usize>, EngineError> {
        match self.opt_usize(field)? {
            Some(0) => Err(EngineError::config(field, "must be positive")),
            other => Ok(other),
        }
    }

    pub(super) fn positive(&self, field: &str) -> Result<usize, EngineError> {
        self.opt_positive(field)?
            .ok_or_else(|| EngineError::config(field, "missing"))
    }

    pub(super) fn opt_bool(&self, field: &str) -> Result<Option<bool>, EngineError> {
        self.get(field)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| EngineError::config(field, "not a boolean"))
            })
            .transpose()
    }

    pub(super) fn float(&self, field: &str) -> Result<f64, EngineError> {
        self.get(field)
            .ok_or_else(|| EngineError::config(field, "missing"))?
            .as_f64()
            .filter(|f| f.is_finite() && *f > 0.0)
            .ok_or_else(|| EngineError::config(field, "not a positive number"))
    }

    /// Fields whose presence would change the computation in ways the engine
    /// does not implement.
    pub(super) fn check_supported(&self, arch: Arch) -> Result<(), EngineError> {
        if let Some(act) = self.get("hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(EngineError::config(
                    "hidden_act",
                    format!("{act} is not supported (silu)"),
                ));
            }
        }
        if self.opt_bool("attention_bias")? == Some(true) {
            return Err(EngineError::config(
                "attention_bias",
                "true is not supported",
            ));
        }
        if arch != Arch::Mixtral && self.opt_bool("use_sliding_window")? == Some(true) {
            return Err(EngineError::config(
                "use_sliding_window",
                "true is not supported",
            ));
        }

        for field in ["n_shared_experts", "shared_expert_intermediate_size"] {
            let shared_ok = match field {
                "n_shared_experts" => arch == Arch::DeepseekV3,
                _ => arch == Arch::Qwen2Moe,
            };
            if shared_ok {
                continue;
            }
            if self.opt_usize(field)?.is_some_and(|n| n > 0) {
                return Err(EngineError::config(
                    field,
                    "shared experts are not supported",
                ));
            }
        }
        Ok(())
    }
}
