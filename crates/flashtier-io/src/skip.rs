//! Telling CI that a hardware-gated test skipped, and why.
//!
//! The test harness captures `eprintln!` (and writes to `std::io::stderr()`)
//! of passing tests, so a skip reason printed that way never reaches CI's
//! log: the run just says "passed". [`notice`] writes through a duplicate
//! of the process's stderr descriptor instead, which the harness does not
//! capture, so `SKIPPED test: reason` shows in every test run's output. A
//! duplicate shares the file offset with the harness's own writes, so into
//! a log file nothing overwrites the line (reopening `/dev/stderr` did:
//! the reopened file appends while fd 2 writes at its own offset).

use std::io::Write;

/// Say that `test` skipped because of `reason` (no GPU, no io_uring, a file
/// system without O_DIRECT...), visibly in the test run's output.
pub fn notice(test: &str, reason: &str) {
    use std::os::fd::AsFd;
    let line = format!("SKIPPED {test}: {reason}");
    let direct = std::io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .map(std::fs::File::from)
        .and_then(|mut f| writeln!(f, "{line}"));
    if direct.is_err() {
        eprintln!("{line}");
    }
}
