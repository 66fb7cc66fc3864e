//! User-facing messages of the tiers carry no Rust debug text: user input
//! is shown as typed (not quoted with escapes), enums by their names, lists
//! and shapes as plain text.

use flashtier::experts::policy::PolicyKind;
use flashtier::experts::pool::Backing;
use flashtier::experts::trace::RoutingTrace;
use flashtier::experts::tracegen::TraceFamily;
use flashtier::experts::{ExpertsError, Precision};
use flashtier::rows::fp8::dequant_row_f32;
use flashtier::rows::{EngramHashConfig, EngramHasher, ScaleFormat};

#[test]
fn parse_errors_show_the_input_as_typed() {
    let e = "lfu".parse::<PolicyKind>().expect_err("policy");
    assert!(e.starts_with("unknown policy lfu ("), "{e}");
    let e = "ram".parse::<Backing>().expect_err("backing");
    assert_eq!(e, "unknown backing ram (mapped | slots)");
    let e = "zipf9".parse::<TraceFamily>().expect_err("family");
    assert!(e.starts_with("unknown trace family zipf9 ("), "{e}");
    let header = r#"{"format":"other-trace","version":1,"layers":1,"experts":2}"#;
    let e = RoutingTrace::parse_str(header)
        .expect_err("format")
        .to_string();
    assert!(
        e.contains("format other-trace, expected flashtier-trace"),
        "{e}"
    );
}

#[test]
fn enums_and_lists_are_named_in_words() {
    let e = ExpertsError::NoStore(Precision::Q2).to_string();
    assert_eq!(e, "expert pool: no 2-bit store attached");
    let mut out = [0f32; 4];
    let e = dequant_row_f32(&[0; 4], &[0; 3], ScaleFormat::F32Blocks, &mut out)
        .expect_err("bad scales")
        .to_string();
    assert!(e.contains("(f32 block scales)"), "{e}");
    let mut config = EngramHashConfig::with_primes(1, 100, 7);
    config.orders = vec![3, 2];
    let e = EngramHasher::new(config).expect_err("orders").to_string();
    assert!(e.contains("n-gram orders 3, 2: need"), "{e}");
}
