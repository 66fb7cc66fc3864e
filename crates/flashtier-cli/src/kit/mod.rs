//! What every command shares: one byte-size parser, medians, one
//! progress-bar builder, the synth / pack / verify steps with their bars
//! ([`steps`]), limits on sizes a flag sets ([`limit`]), fio as the
//! drive's own limit ([`fio`]) and the layout every bench follows
//! ([`bench`]). Commands import from here, never from a sibling command.

pub mod bench;
pub mod fio;
pub mod limit;
pub mod model;
pub mod settings;
mod steps;

pub use steps::{
    pack_json, pack_line, pack_with_bar, synth_with_bar, verify_with_bar, with_verify_bar,
};

use indicatif::{ProgressBar, ProgressStyle};

/// A byte count with an optional binary suffix: `4096`, `64K`, `512M`,
/// `2G`, `1T` (also `Ki`/`KiB`, `KB`..., any case): powers of 1024. Overflow
/// of u64 is an error, never a wrapped value; fractions are refused.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, suffix) = s.split_at(digits);
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "ki" | "kib" => 10,
        "m" | "mb" | "mi" | "mib" => 20,
        "g" | "gb" | "gi" | "gib" => 30,
        "t" | "tb" | "ti" | "tib" => 40,
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

pub use flashtier_io::measure::median;

/// Median of `f` over `samples`.
pub fn median_of<T>(samples: &[T], f: impl Fn(&T) -> f64) -> f64 {
    median(&samples.iter().map(f).collect::<Vec<_>>())
}

/// What a progress bar counts.
#[derive(Clone, Copy, Debug)]
pub enum Units {
    /// Bytes (with a rate and an ETA).
    Bytes,
    /// Items: tokens, rows, runs (with a rate and an ETA).
    Items,
    /// Steps of a measurement (elapsed time, the current step as message).
    Steps,
}

/// The one progress-bar builder: a bar of `total` `units` on stderr,
/// labelled `message`; hidden when `show` is false (and by indicatif when
/// stderr is not a terminal).
pub fn progress(units: Units, total: u64, message: &str, show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let template = match units {
        Units::Bytes => {
            "{msg:>12} [{bar:40.cyan/blue}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}"
        }
        Units::Items => "{msg:>12} [{bar:40.cyan/blue}] {pos}/{len} {per_sec} eta {eta}",
        Units::Steps => "{elapsed_precise} [{bar:30.cyan/blue}] {pos}/{len} {msg}",
    };
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(message.to_string());
    bar
}

/// A byte-count progress bar ([`progress`] in bytes).
pub fn bytes_bar(total: u64, message: &str, show: bool) -> ProgressBar {
    progress(Units::Bytes, total, message, show)
}

/// A progress bar of `total` items (tokens, runs, blocks).
pub fn count_bar(total: u64, message: &str, show: bool) -> ProgressBar {
    progress(Units::Items, total, message, show)
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
        assert_eq!(parse_bytes("2Mi"), Ok(2 << 20));
        assert_eq!(parse_bytes("4kb"), Ok(4 << 10));
        assert_eq!(parse_bytes(" 10MiB "), Ok(10 << 20));
        assert!(parse_bytes("x").is_err());
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("12X").is_err());
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
    fn median_of_a_field() {
        // The median's own rule is tested with it, in flashtier-io.
        assert_eq!(median_of(&[(1, 4.0), (2, 2.0)], |s| s.1), 3.0);
    }
}
