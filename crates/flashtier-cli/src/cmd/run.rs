//! `flashtier run`.

/// Options of `flashtier run`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `flashtier run`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("flashtier run is not built yet")
}
