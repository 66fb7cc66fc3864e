//! `flashtier pack rows`.

/// Options of `flashtier pack rows`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Run `flashtier pack rows`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("flashtier pack rows is not built yet")
}
