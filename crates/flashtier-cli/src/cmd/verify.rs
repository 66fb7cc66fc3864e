//! `flashtier verify`.

/// Options of `flashtier verify`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `flashtier verify`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("flashtier verify is not built yet")
}
