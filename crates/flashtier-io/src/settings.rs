//! Settings taken from the environment: the one reader of `FLASHTIER_*`
//! variables in the workspace's libraries, and the one way they are parsed.
//!
//! A library reads a variable only where it must be steered from outside
//! (a measuring run, a replay, a test harness); everything a user sets for
//! a run is a flag or a field of a config struct. Each crate a variable
//! steers keeps one `settings` module that names its variables, documents
//! each ([`Setting`], listed by `flashtier --help` and
//! `docs/configuration.md`) and reads them through an [`Env`], in these
//! shapes only:
//!
//! - a flag: `0` or `1` ([`Env::flag`]);
//! - an integer in an inclusive range ([`Env::int`]);
//! - a value with its own grammar, such as a tile shape `4x4`
//!   ([`Env::parsed`]);
//! - a path, any non-empty value ([`Env::path`]).
//!
//! An unset or empty variable takes its default. Any other value the
//! reader cannot take is a [`SettingError`] naming the variable, the value
//! and what it accepts, which the caller returns: a bad value never panics
//! and never falls back to the default unannounced.
//!
//! ```
//! use flashtier_io::settings::Env;
//! let env = Env::from_pairs(&[("FLASHTIER_EXAMPLE", "7")]);
//! assert_eq!(env.int("FLASHTIER_EXAMPLE", 1..=16, 4)?, 7);
//! assert_eq!(env.flag("FLASHTIER_UNSET_EXAMPLE", true)?, true);
//! let bad = Env::from_pairs(&[("FLASHTIER_EXAMPLE", "99")]);
//! let e = bad.int("FLASHTIER_EXAMPLE", 1..=16, 4).unwrap_err();
//! assert!(e.to_string().contains("FLASHTIER_EXAMPLE"));
//! # Ok::<(), flashtier_io::settings::SettingError>(())
//! ```
//!
//! This crate's own variable is [`SIM_SEED`].

use std::ffi::OsString;
use std::fmt::Display;
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::str::FromStr;

/// A variable held a value its reader cannot take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?}: expected {expected}")]
#[non_exhaustive]
pub struct SettingError {
    /// The variable.
    pub var: &'static str,
    /// The value it held (lossily decoded when it was not UTF-8).
    pub value: String,
    /// What it accepts.
    pub expected: String,
}

/// One variable as the reference table lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The variable's name.
    pub name: &'static str,
    /// Its default, as written in the table.
    pub default: &'static str,
    /// What it does, one line.
    pub doc: &'static str,
}

/// `FLASHTIER_SIM_SEED`: the seed of every [`crate::SimBackend`] made
/// while it is set, overriding the plan's own (replaying a run whose
/// printed seed it is); a `u64`.
pub const SIM_SEED: &str = "FLASHTIER_SIM_SEED";

/// This crate's variables.
pub const SETTINGS: &[Setting] = &[Setting {
    name: SIM_SEED,
    default: "unset",
    doc: "the simulated backend's seed (a u64), overriding its plan's; it prints the seed it used",
}];

/// Where variables are looked up: the process environment, or a fixed
/// list (tests, and embedders that configure a library by hand).
#[derive(Clone, Copy, Debug)]
pub struct Env<'a> {
    pairs: Option<&'a [(&'a str, &'a str)]>,
}

impl Env<'static> {
    /// The process environment.
    #[must_use]
    pub fn process() -> Self {
        Self { pairs: None }
    }
}

impl<'a> Env<'a> {
    /// Only the variables of `pairs` (name, value) are set.
    #[must_use]
    pub fn from_pairs(pairs: &'a [(&'a str, &'a str)]) -> Self {
        Self { pairs: Some(pairs) }
    }

    fn raw(&self, var: &str) -> Option<OsString> {
        let v = match self.pairs {
            None => std::env::var_os(var),
            Some(p) => p.iter().find(|(k, _)| *k == var).map(|(_, v)| v.into()),
        };
        v.filter(|v| !v.is_empty())
    }

    /// The variable's text, `None` when unset or empty.
    pub fn text(&self, var: &'static str) -> Result<Option<String>, SettingError> {
        self.raw(var)
            .map(|v| {
                v.into_string().map_err(|v| SettingError {
                    var,
                    value: v.to_string_lossy().into_owned(),
                    expected: "UTF-8 text".into(),
                })
            })
            .transpose()
    }

    /// A flag: `0` (off) or `1` (on); `default` when unset.
    pub fn flag(&self, var: &'static str, default: bool) -> Result<bool, SettingError> {
        self.parsed(var, "0 or 1", default, |v| match v {
            "0" => Some(false),
            "1" => Some(true),
            _ => None,
        })
    }

    /// An integer in `range`; `default` when unset.
    pub fn int<T>(
        &self,
        var: &'static str,
        range: RangeInclusive<T>,
        default: T,
    ) -> Result<T, SettingError>
    where
        T: FromStr + PartialOrd + Display + Copy,
    {
        let expected = format!("an integer from {} to {}", range.start(), range.end());
        self.parsed(var, &expected, default, |v| {
            v.parse::<T>().ok().filter(|n| range.contains(n))
        })
    }

    /// A value `parse` accepts (it returns `None` for one it does not;
    /// `expected` says what it takes); `default` when unset.
    pub fn parsed<T>(
        &self,
        var: &'static str,
        expected: &str,
        default: T,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Result<T, SettingError> {
        Ok(self.optional(var, expected, parse)?.unwrap_or(default))
    }

    /// As [`Self::parsed`], `None` when unset (a setting with no default
    /// value, such as a seed).
    pub fn optional<T>(
        &self,
        var: &'static str,
        expected: &str,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Result<Option<T>, SettingError> {
        let Some(text) = self.text(var)? else {
            return Ok(None);
        };
        match parse(text.trim()) {
            Some(v) => Ok(Some(v)),
            None => Err(SettingError {
                var,
                value: text,
                expected: expected.into(),
            }),
        }
    }

    /// A path: any non-empty value, `None` when unset.
    #[must_use]
    pub fn path(&self, var: &'static str) -> Option<PathBuf> {
        self.raw(var).map(PathBuf::from)
    }

    /// [`SIM_SEED`], if set.
    pub fn sim_seed(&self) -> Result<Option<u64>, SettingError> {
        self.optional(SIM_SEED, "a u64 seed", |v| v.parse().ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: &str = "FLASHTIER_TEST_VALUE";

    fn one(value: &'static str) -> Env<'static> {
        // Leaked so the pairs live as long as the Env (tests only).
        Env::from_pairs(Box::leak(Box::new([(V, value)])))
    }

    #[test]
    fn unset_and_empty_take_the_default() {
        let none = Env::from_pairs(&[]);
        assert_eq!(none.flag(V, true), Ok(true));
        assert_eq!(none.int(V, 1..=8, 4u32), Ok(4));
        assert_eq!(none.path(V), None);
        assert_eq!(none.sim_seed(), Ok(None));
        let empty = one("");
        assert_eq!(empty.flag(V, false), Ok(false));
        assert_eq!(empty.int(V, 1..=8, 4u32), Ok(4));
        assert_eq!(empty.path(V), None);
    }

    #[test]
    fn flags_are_zero_or_one() {
        assert_eq!(one("0").flag(V, true), Ok(false));
        assert_eq!(one("1").flag(V, false), Ok(true));
        assert_eq!(one(" 1 ").flag(V, false), Ok(true));
        for bad in ["on", "true", "2", "yes"] {
            let e = one(bad).flag(V, true).unwrap_err();
            assert_eq!(e.var, V);
            assert_eq!(e.value, bad);
            let msg = e.to_string();
            assert!(
                msg.contains(V) && msg.contains(bad) && msg.contains("0 or 1"),
                "{msg}"
            );
        }
    }

    #[test]
    fn integers_stay_in_their_range() {
        assert_eq!(one("1").int(V, 1..=16, 4u32), Ok(1));
        assert_eq!(one("16").int(V, 1..=16, 4u32), Ok(16));
        for bad in ["0", "17", "-1", "4.0", "four"] {
            let e = one(bad).int(V, 1..=16, 4u32).unwrap_err();
            assert_eq!(e.var, V);
            assert!(e.to_string().contains("from 1 to 16"), "{e}");
        }
        assert_eq!(one("4096").int(V, 1..=4096usize, 32), Ok(4096));
    }

    #[test]
    fn parsed_values_and_seeds() {
        let shape = |v: &str| {
            let (a, b) = v.split_once('x')?;
            Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?))
        };
        assert_eq!(one("2x8").parsed(V, "TMxTN", (4, 4), shape), Ok((2, 8)));
        let e = one("2by8").parsed(V, "TMxTN", (4, 4), shape).unwrap_err();
        assert!(e.to_string().contains("TMxTN"), "{e}");
        let seeded = Env::from_pairs(&[(SIM_SEED, "42")]);
        assert_eq!(seeded.sim_seed(), Ok(Some(42)));
        let e = Env::from_pairs(&[(SIM_SEED, "x42")])
            .sim_seed()
            .unwrap_err();
        assert_eq!(e.var, SIM_SEED);
    }

    #[test]
    fn paths_are_taken_as_they_are() {
        assert_eq!(one("/tmp/a b").path(V), Some(PathBuf::from("/tmp/a b")));
    }

    #[test]
    fn the_table_names_flashtier_variables_once() {
        let mut names: Vec<&str> = SETTINGS.iter().map(|s| s.name).collect();
        assert!(names.iter().all(|n| n.starts_with("FLASHTIER_")));
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SETTINGS.len());
    }
}
