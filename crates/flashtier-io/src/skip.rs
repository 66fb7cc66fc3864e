//! Telling CI that a hardware-gated test skipped, and why.
//!
//! The test harness captures `eprintln!` (and writes to `std::io::stderr()`)
//! of passing tests, so a skip reason printed that way never reaches CI's
//! log: the run just says "passed". [`notice`] writes through a new handle
//! on the process's stderr file instead, which the harness does not
//! capture, so `SKIPPED test: reason` shows in every test run's output.

use std::io::Write;

/// Say that `test` skipped because of `reason` (no GPU, no io_uring, a file
/// system without O_DIRECT...), visibly in the test run's output.
pub fn notice(test: &str, reason: &str) {
    let line = format!("SKIPPED {test}: {reason}");
    let direct = std::fs::OpenOptions::new()
        .append(true)
        .open("/dev/stderr")
        .and_then(|mut f| writeln!(f, "{line}"));
    if direct.is_err() {
        eprintln!("{line}");
    }
}
