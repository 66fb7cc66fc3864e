//! The summary every benchmark reports over its repetitions: one median,
//! below every crate that measures (the drive probes and load generator
//! here, the device copies of `flashtier-cuda`, the demo of
//! `flashtier-engine`, the `flashtier bench` commands).

/// Median of `values`: the middle value of an odd count, the mean of the
/// middle two of an even count, 0 when empty. NaN sorts last
/// ([`f64::total_cmp`]).
///
/// The even-count rule is the textbook one, chosen over taking the upper of
/// the middle two (which two copies of this function used before): with two
/// repetitions that rule reported the faster, not their centre.
#[must_use]
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn odd_even_and_empty() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[7.0]), 7.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[10.0, 20.0]), 15.0);
    }

    #[test]
    fn order_and_nan() {
        assert_eq!(median(&[5.0, -1.0, 5.0, 0.0, 9.0]), 5.0);
        // NaN sorts after every number, so one NaN of three leaves the
        // smaller two in the middle and first.
        assert_eq!(median(&[f64::NAN, 2.0, 1.0]), 2.0);
    }
}
