//! Experts fused per layer (transformers 5): one pair per layer,
//! `model.layers.L.mlp.experts.gate_up_proj [E, 2I, H]` (each expert's gate
//! rows, then its up rows) and `...experts.down_proj [E, H, I]`
//! (`block_sparse_moe.experts.` is accepted too).
//!
//! Invariants of an accepted checkpoint: every layer with a fused tensor has
//! both, under one prefix; no per-expert tensor sits beside them; every
//! layer has the same dtype (BF16, F16 or F32: no FP8, which needs scales
//! the fused layout does not carry) and the same `[E, I, H]`, all nonzero.
//! A record's gate, up and down are then contiguous byte ranges of the pair
//! ([`super::ExpertLayout::source_of`]), of `I x H` elements each.

use std::collections::BTreeMap;

use flashtier_format::{Dtype, RecordKey, TensorLayout};

use super::{ExpertFamily, ExpertLayout, ExpertTensors, check_dtype, split::parse_expert_name};
use crate::checkpoint::files::CheckpointFiles as Checkpoint;
use crate::error::dims;
use crate::store::PackError;

/// The two fused-tensor prefixes transformers 5 writes.
const FUSED_PREFIXES: [&str; 2] = [
    "model.layers.{layer}.mlp.experts.",
    "model.layers.{layer}.block_sparse_moe.experts.",
];

/// A fused expert tensor's (prefix template, layer, which): `which` is
/// `gate_up_proj` or `down_proj`.
fn parse_fused_name(name: &str) -> Option<(&'static str, u32, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (prefix, which) = if let Some(w) = rest.strip_prefix("mlp.experts.") {
        (FUSED_PREFIXES[0], w)
    } else {
        (
            FUSED_PREFIXES[1],
            rest.strip_prefix("block_sparse_moe.experts.")?,
        )
    };
    matches!(which, "gate_up_proj" | "down_proj").then_some(())?;
    Some((prefix, layer.parse().ok()?, which))
}

/// Name of fused tensor `which` of `layer` under `prefix`.
fn fused_name(prefix: &str, layer: u32, which: &str) -> String {
    format!("{}{which}", prefix.replace("{layer}", &layer.to_string()))
}

/// Per layer: (prefix template, gate_up tensor name, down tensor name).
type FusedLayers<'a> = BTreeMap<u32, (&'static str, Option<&'a str>, Option<&'a str>)>;

/// The fused tensors of `ckpt` by layer, and their one prefix; `None` when
/// it has none. Two prefixes, or per-expert tensors beside fused ones, are
/// [`PackError::MixedLayouts`].
fn scan_fused(ckpt: &Checkpoint) -> Result<Option<(&'static str, FusedLayers<'_>)>, PackError> {
    let mut layers = FusedLayers::new();
    let mut split: Option<&str> = None;
    for name in ckpt.tensors().keys() {
        if split.is_none() && parse_expert_name(name).is_some() {
            split = Some(name);
        }
        let Some((prefix, layer, which)) = parse_fused_name(name) else {
            continue;
        };
        let entry = layers.entry(layer).or_insert((prefix, None, None));
        if entry.0 != prefix {
            return Err(PackError::MixedLayouts {
                first: entry.1.or(entry.2).unwrap_or_default().to_string(),
                second: name.clone(),
            });
        }
        if which == "gate_up_proj" {
            entry.1 = Some(name);
        } else {
            entry.2 = Some(name);
        }
    }
    let Some(&(prefix, _, _)) = layers.values().next() else {
        return Ok(None);
    };
    let first_fused = || {
        layers
            .values()
            .find_map(|(_, g, d)| g.or(*d))
            .unwrap_or_default()
            .to_string()
    };
    if let Some(&(_, g, d)) = layers.values().find(|(p, _, _)| *p != prefix) {
        return Err(PackError::MixedLayouts {
            first: first_fused(),
            second: g.or(d).unwrap_or_default().to_string(),
        });
    }
    if let Some(split) = split {
        return Err(PackError::MixedLayouts {
            first: first_fused(),
            second: split.to_string(),
        });
    }
    Ok(Some((prefix, layers)))
}

/// `(experts, intermediate, hidden, dtype)` of a layer's fused pair.
type FusedDims = (u64, u64, u64, Dtype);

/// One layer's fused pair, checked, and held against the `first` layer's
/// when there is one.
fn layer_shape(
    ckpt: &Checkpoint,
    prefix: &str,
    layer: u32,
    (gate_up, down): (Option<&str>, Option<&str>),
    first: Option<(u32, FusedDims)>,
) -> Result<FusedDims, PackError> {
    let (Some(gate_up), Some(down)) = (gate_up, down) else {
        let have = gate_up.or(down).unwrap_or_default();
        let missing = if gate_up.is_none() {
            "gate_up_proj"
        } else {
            "down_proj"
        };
        return Err(PackError::Inconsistent {
            tensor: fused_name(prefix, layer, missing),
            why: format!("missing, while {have} is present"),
        });
    };
    let gu = ckpt.tensor(gate_up)?;
    let dn = ckpt.tensor(down)?;
    let d = check_dtype(gate_up, gu, "gate_up_proj")?;
    if d == Dtype::F8E4M3 {
        return Err(PackError::UnsupportedDtype {
            tensor: gate_up.to_string(),
            dtype: gu.dtype.clone(),
            role: "fused matrice",
            supported: "BF16, F16, F32",
        });
    }
    let bad = |tensor: &str, why: String| PackError::Inconsistent {
        tensor: tensor.to_string(),
        why,
    };
    let bad_shape = || {
        let why = format!(
            "shape {}, expected [experts, 2 * intermediate, hidden]",
            dims(&gu.shape)
        );
        bad(gate_up, why)
    };
    let [e, two_i, h] = gu.shape[..] else {
        return Err(bad_shape());
    };
    if two_i == 0 || two_i % 2 != 0 || e == 0 || h == 0 {
        return Err(bad_shape());
    }
    let i = two_i / 2;
    if dn.shape != [e, h, i] || dn.dtype != gu.dtype {
        return Err(bad(
            down,
            format!(
                "{} {}, but {gate_up} is {} {}: expected {} [{e}, {h}, {i}]",
                dn.dtype,
                dims(&dn.shape),
                gu.dtype,
                dims(&gu.shape),
                gu.dtype
            ),
        ));
    }
    match first {
        Some((first_layer, (experts, inter, hidden, dtype)))
            if (e, i, h, d) != (experts, inter, hidden, dtype) =>
        {
            Err(bad(
                gate_up,
                format!(
                    "{} {}, but layer {first_layer}'s is {dtype} [{experts}, {}, {hidden}]",
                    gu.dtype,
                    dims(&gu.shape),
                    2 * inter
                ),
            ))
        }
        _ => Ok((e, i, h, d)),
    }
}

/// The layout of a checkpoint whose experts are fused per layer, or `None`
/// when it has no fused expert tensor (see the module docs).
pub(super) fn fused_layout(
    ckpt: &Checkpoint,
    model_type: &str,
) -> Result<Option<ExpertLayout>, PackError> {
    let Some((prefix, layers)) = scan_fused(ckpt)? else {
        return Ok(None);
    };
    let family = match model_type {
        t if t.starts_with("mixtral") => ExpertFamily::Mixtral,
        t if t.starts_with("deepseek") => ExpertFamily::DeepSeek,
        _ => ExpertFamily::QwenMoe,
    };
    // Shapes and dtype from the first layer; every layer must agree.
    let mut first: Option<(u32, FusedDims)> = None;
    for (&layer, &(_, gate_up, down)) in &layers {
        let shape = layer_shape(ckpt, prefix, layer, (gate_up, down), first)?;
        first = first.or(Some((layer, shape)));
    }
    let Some((first_layer, (experts, inter, hidden, dtype))) = first else {
        return Ok(None);
    };
    let names: [&str; 3] = match family {
        ExpertFamily::Mixtral => ["w1.weight", "w3.weight", "w2.weight"],
        _ => ["gate_proj.weight", "up_proj.weight", "down_proj.weight"],
    };
    let shapes = [
        vec![inter, hidden],
        vec![inter, hidden],
        vec![hidden, inter],
    ];
    let len_bytes = inter * hidden * dtype.size_bytes();
    let tensors = names
        .into_iter()
        .zip(shapes)
        .map(|(name, shape)| TensorLayout {
            name: name.to_string(),
            dtype,
            shape,
            offset: 0,
            len_bytes,
        })
        .collect();
    let e = u32::try_from(experts).map_err(|_| PackError::Inconsistent {
        tensor: fused_name(prefix, first_layer, "gate_up_proj"),
        why: format!("{experts} experts"),
    })?;
    let keys = layers
        .keys()
        .flat_map(|&l| (0..e).map(move |x| RecordKey::new(l, x)))
        .collect();
    Ok(Some(ExpertLayout::placed(
        family,
        keys,
        tensors,
        ExpertTensors::Fused { prefix },
    )))
}
