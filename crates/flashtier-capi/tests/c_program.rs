//! Compiles `tests/c/rows_test.c` with the system C compiler against the
//! built cdylib and runs it on a synthetic table and packed shard. Skips,
//! saying why, when there is no C compiler.

use std::path::{Path, PathBuf};
use std::process::Command;

use flashtier::rows::RowGeometry;
use flashtier::rows::pack::{pack_shard, write_synthetic_table};

/// The folder holding the cdylib: `cargo build` uplifts it to
/// `target/<profile>/`, while `cargo test` on a clean tree leaves it in
/// `target/<profile>/deps/` (where this test binary also lives).
fn lib_dir() -> PathBuf {
    // target/<profile>/deps/c_program-<hash>
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent().expect("deps dir").to_path_buf();
    let profile = deps.parent().expect("target dir").to_path_buf();
    [deps, profile.clone()]
        .into_iter()
        .find(|d| d.join("libflashtier_capi.so").exists())
        .unwrap_or(profile)
}

#[test]
fn c_program_exercises_the_abi() {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    if Command::new(&cc).arg("--version").output().is_err() {
        println!("SKIP: no C compiler ({cc}) on this machine");
        return;
    }
    let libs = lib_dir();
    let so = libs.join("libflashtier_capi.so");
    assert!(
        so.exists(),
        "{} not built (cargo builds the cdylib with the tests)",
        so.display()
    );
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = dir.path().join("rows_test");
    let out = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-o"])
        .arg(&exe)
        .arg(crate_dir.join("tests/c/rows_test.c"))
        .arg(format!("-I{}", crate_dir.join("include").display()))
        .arg(format!("-L{}", libs.display()))
        .arg(format!("-Wl,-rpath,{}", libs.display()))
        .arg("-lflashtier_capi")
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "cc failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let rows = 2000u64;
    let (lo, hi, layer) = (300u64, 1700u64, 5u64);
    let table = write_synthetic_table(&dir.path().join("t.bin"), rows, RowGeometry::ENGRAM, 99)
        .expect("table");
    let shard = dir.path().join("t.rows");
    pack_shard(&table, layer, lo, hi, &shard, &mut |_| {}).expect("pack");
    let run = Command::new(&exe)
        .arg(&table.weights.path)
        .arg(rows.to_string())
        .arg(&shard)
        .args([layer.to_string(), lo.to_string(), hi.to_string()])
        .output()
        .expect("run rows_test");
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}");
    assert!(
        run.status.success(),
        "rows_test failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("rows_test: ok"));
}
