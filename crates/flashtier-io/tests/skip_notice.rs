//! A skip notice reaches the test run's output even when that output is a
//! log file (CI's case) and the harness keeps writing after it: the line is
//! neither captured nor overwritten.
#![allow(clippy::unwrap_used, reason = "test")]

use std::process::{Command, Stdio};

/// Set in the child run below: that run only prints the notice.
const CHILD: &str = "FLASHTIER_SKIP_NOTICE_CHILD";

#[test]
fn notice_child() {
    if std::env::var_os(CHILD).is_some() {
        flashtier_io::skip::notice("notice_child", "a reason a log must keep");
    }
}

#[test]
fn a_notice_survives_in_a_log_file_after_the_harness_output() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("ci.log");
    // As `cmd > ci.log 2>&1`: one truncating open shared by stdout and
    // stderr; the harness writes its result lines after the notice.
    let file = std::fs::File::create(&log).unwrap();
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "notice_child", "--test-threads=1"])
        .env(CHILD, "1")
        .stdout(Stdio::from(file.try_clone().unwrap()))
        .stderr(Stdio::from(file))
        .status()
        .unwrap();
    assert!(status.success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("SKIPPED notice_child: a reason a log must keep"),
        "{text}"
    );
    assert!(text.contains("test result: ok"), "{text}");
}
