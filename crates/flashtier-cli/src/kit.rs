//! What every command shares: one byte-size parser, medians, progress bars.
//! Commands import from here, never from a sibling command.

use indicatif::{ProgressBar, ProgressStyle};

/// A byte count with an optional binary suffix: `4096`, `64K`, `512M`,
/// `2G`, `1T` (also `KiB`/`MiB`/`GiB`/`TiB`, `KB`.., lowercase): powers of
/// 1024. Overflow of u64 is an error, never a wrapped value.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, suffix) = s.split_at(digits);
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "`{text}`: unknown size suffix `{other}` (K, M, G, T: powers of 1024)"
            ));
        }
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{text}` is not a byte count (e.g. 4096, 64K, 2G)"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("`{text}` is more than 2^64 bytes"))
}

/// Median of `values` (the mean of the middle two for an even count; 0
/// when empty).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A byte-count progress bar on stderr (hidden when `show` is false or
/// stderr is not a terminal).
pub fn bytes_bar(total: u64, message: &str, show: bool) -> ProgressBar {
    bar(
        total,
        message,
        show,
        "{msg:>12} [{bar:40.cyan/blue}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
    )
}

/// A progress bar of `total` items (tokens, runs, blocks).
pub fn count_bar(total: u64, message: &str, show: bool) -> ProgressBar {
    bar(
        total,
        message,
        show,
        "{msg:>12} [{bar:40.cyan/blue}] {pos}/{len} {per_sec} eta {eta}",
    )
}

fn bar(total: u64, message: &str, show: bool, template: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(message.to_string());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_are_binary_and_never_wrap() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("3m"), Ok(3 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("1T"), Ok(1 << 40));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes(" 10MiB "), Ok(10 << 20));
        assert!(parse_bytes("x").is_err());
        assert!(parse_bytes("1.5G").is_err());
        assert!(parse_bytes("-1").is_err());
        assert!(
            parse_bytes("17179869184G").is_err(),
            "2^34 GiB overflows u64"
        );
        assert!(parse_bytes("16777216T").is_err());
        assert_eq!(parse_bytes("16777215T"), Ok(16_777_215u64 << 40));
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
