//! `flashtier pack experts`.

/// Options of `flashtier pack experts`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `flashtier pack experts`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("flashtier pack experts is not built yet")
}
