//! Messages of the I/O layer carry no Rust debug text: user input as typed,
//! slot states by name.

use flashtier_io::blocks::SlotPool;
use flashtier_io::loadgen::Pattern;
use flashtier_io::{BackendKind, DirectMode};

#[test]
fn parse_errors_show_the_input_as_typed() {
    let e = "spdk"
        .parse::<BackendKind>()
        .expect_err("backend")
        .to_string();
    assert!(
        e.ends_with("unknown backend spdk (uring | uring-local | posix | sim)"),
        "{e}"
    );
    let e = "always".parse::<DirectMode>().expect_err("direct");
    assert_eq!(e, "unknown direct mode always (prefer | require | off)");
    let e = "zigzag"
        .parse::<Pattern>()
        .expect_err("pattern")
        .to_string();
    assert!(e.ends_with("unknown pattern zigzag (rand | seq)"), "{e}");
}

#[test]
fn slot_states_are_named_in_words() {
    let pool = SlotPool::new(4096, 2).expect("pool");
    // A fresh slot holds no landed read.
    let e = pool.landed(1, 1).expect_err("empty").to_string();
    assert!(e.ends_with("slot 1 is not available (empty)"), "{e}");
}
