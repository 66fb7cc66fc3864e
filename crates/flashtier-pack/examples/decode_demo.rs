//! The decode demo from the library, printing its JSON report:
//! `cargo run --release -p flashtier-pack --example decode_demo -- DIR [TOKENS]`.

use std::path::PathBuf;

use flashtier_pack::demo::{DemoOptions, run_decode_demo};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().ok_or("usage: decode_demo DIR [TOKENS]")?);
    let mut opts = DemoOptions::new(&dir);
    if let Some(t) = args.next() {
        opts.tokens = t.parse()?;
    }
    let last = std::sync::Mutex::new(None);
    let report = run_decode_demo(&opts, &|p| {
        if let Ok(mut l) = last.lock() {
            if *l != Some(p.phase) {
                eprintln!("{:?} ...", p.phase);
                *l = Some(p.phase);
            }
        }
    })?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
