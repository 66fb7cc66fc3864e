//! Limits on sizes a flag sets, checked before anything of that size is
//! allocated: a flag past its limit is a [`Limit`] error stating the limit,
//! never an allocation failure. Each command states its limits in its docs.

/// A size a flag (or a product of flags) sets, over its limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    /// What would be allocated, and which flags set it.
    pub what: String,
    /// The size asked for (`None`: more than 2^64).
    pub value: Option<u64>,
    /// The limit.
    pub limit: u64,
    /// Unit of both (`bytes`, `layers`, `tokens`).
    pub unit: &'static str,
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let unit = self.unit;
        match self.value {
            Some(v) => write!(f, "{}: {v} {unit}", self.what)?,
            None => write!(f, "{}: more than 2^64 {unit}", self.what)?,
        }
        write!(f, " is over the limit of {} {unit}", self.limit)
    }
}

impl std::error::Error for Limit {}

/// `Ok(value)` when the product of `factors` is at most `limit` `unit`s.
pub fn at_most(what: &str, factors: &[u64], limit: u64, unit: &'static str) -> Result<u64, Limit> {
    let value = factors.iter().try_fold(1u64, |n, &f| n.checked_mul(f));
    match value {
        Some(v) if v <= limit => Ok(v),
        value => Err(Limit {
            what: what.to_string(),
            value,
            limit,
            unit,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_past_the_limit_or_u64_are_refused() {
        assert_eq!(at_most("x", &[4, 8], 32, "bytes"), Ok(32));
        let e = at_most("--layers", &[33], 32, "layers").unwrap_err();
        assert_eq!(
            e.to_string(),
            "--layers: 33 layers is over the limit of 32 layers"
        );
        let e = at_most("ring", &[u64::MAX, 2], 1 << 30, "bytes").unwrap_err();
        assert!(e.to_string().contains("more than 2^64 bytes"), "{e}");
    }
}
