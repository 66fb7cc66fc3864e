//! The layout every `flashtier bench` follows: `Args` with `--reps` and
//! `--json`; `run`, which measures ours and the device's own limit (fio,
//! a copy) in the same run as `--reps` interleaved repetitions, who goes
//! first alternating ([`interleaved`], [`ours_first`]), so both sides see
//! the same cache and the same neighbours; a report struct holding every
//! repetition's samples, their medians ([`super::median_of`]) and the
//! ratios against the limit ([`ratio`], [`paired_ratio`]), printed as JSON
//! or text ([`emit`]).

use anyhow::{Result, bail};
use serde::Serialize;

/// `--reps` must be at least 1.
pub fn check_reps(reps: usize) -> Result<()> {
    if reps == 0 {
        bail!("--reps must be at least 1");
    }
    Ok(())
}

/// Whether ours runs before the limit in repetition `rep` (even
/// repetitions), so neither side always inherits the other's cache.
pub fn ours_first(rep: usize) -> bool {
    rep % 2 == 0
}

/// `reps` repetitions of `ours` and `limit`, who goes first alternating;
/// every sample of both, in repetition order.
pub fn interleaved<A, B>(
    reps: usize,
    mut ours: impl FnMut(usize) -> Result<A>,
    mut limit: impl FnMut(usize) -> Result<B>,
) -> Result<(Vec<A>, Vec<B>)> {
    let (mut a, mut b) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for rep in 0..reps {
        if ours_first(rep) {
            a.push(ours(rep)?);
            b.push(limit(rep)?);
        } else {
            b.push(limit(rep)?);
            a.push(ours(rep)?);
        }
    }
    Ok((a, b))
}

/// `ours / limit`, 0 when the limit is not positive.
pub fn ratio(ours: f64, limit: f64) -> f64 {
    if limit > 0.0 { ours / limit } else { 0.0 }
}

/// The median of the per-repetition ratios `ours[i] / limit[i]` (run back
/// to back, so robust when the device's speed drifts between repetitions);
/// repetitions without a positive limit are skipped, `None` when none is left.
pub fn paired_ratio(ours: &[f64], limit: &[f64]) -> Option<f64> {
    let v: Vec<f64> = ours
        .iter()
        .zip(limit)
        .filter(|(_, l)| **l > 0.0)
        .map(|(o, l)| o / l)
        .collect();
    (!v.is_empty()).then(|| super::median(&v))
}

/// Print `report` as one pretty JSON document (`--json`), else through `text`.
pub fn emit<R: Serialize>(report: &R, json: bool, text: impl FnOnce(&R)) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        text(report);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetitions_alternate_and_ratios_pair() -> Result<()> {
        let order = std::cell::RefCell::new(Vec::new());
        let (a, b) = interleaved(
            3,
            |r| {
                order.borrow_mut().push(('o', r));
                Ok(r)
            },
            |r| {
                order.borrow_mut().push(('l', r));
                Ok(r * 10)
            },
        )?;
        assert_eq!((a, b), (vec![0, 1, 2], vec![0, 10, 20]));
        assert_eq!(
            order.into_inner(),
            [('o', 0), ('l', 0), ('l', 1), ('o', 1), ('o', 2), ('l', 2)]
        );
        assert_eq!(paired_ratio(&[1.0, 3.0, 8.0], &[2.0, 0.0, 4.0]), Some(1.25));
        assert_eq!(paired_ratio(&[1.0], &[0.0]), None);
        assert_eq!(ratio(1.0, 0.0), 0.0);
        assert!(check_reps(0).is_err());
        Ok(())
    }
}
