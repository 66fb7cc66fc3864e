//! The environment variables, as `flashtier --help` lists them: the CLI's
//! own (each also a flag, read by clap) and the libraries' (each crate's
//! `settings` table, the one place that crate reads them). The reference
//! table is docs/configuration.md; a test keeps the two in step.

use flashtier_io::settings::Setting;

/// The CLI's own variables (clap reads them as the flags' defaults).
pub const CLI_SETTINGS: &[Setting] = &[
    Setting {
        name: "FLASHTIER_LOG",
        default: "warn",
        doc: "--log: which logs go to stderr (a tracing filter)",
    },
    Setting {
        name: "FLASHTIER_API_KEY",
        default: "unset",
        doc: "serve --api-key: the key requests must send (unset or empty: none)",
    },
];

/// Every table, with the crate it belongs to.
pub fn tables() -> [(&'static str, &'static [Setting]); 5] {
    [
        ("flashtier (CLI)", CLI_SETTINGS),
        ("flashtier-engine", flashtier_engine::settings::SETTINGS),
        ("flashtier-cuda", flashtier_cuda::settings::SETTINGS),
        ("flashtier (tiers)", flashtier::settings::SETTINGS),
        ("flashtier-io", flashtier_io::settings::SETTINGS),
    ]
}

/// The `--help` text after the commands: every variable, its default and
/// what it does.
pub fn environment_help() -> String {
    let mut out = String::from(
        "Environment (docs/configuration.md has the table; a bad value is an error naming the variable):\n",
    );
    for (krate, table) in tables() {
        out.push_str(&format!("  {krate}:\n"));
        for s in table {
            out.push_str(&format!(
                "    {} [default: {}]\n        {}\n",
                s.name, s.default, s.doc
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc() -> String {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/configuration.md");
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// `FLASHTIER_*` names in `text` (an upper-case identifier after the
    /// prefix).
    fn names(text: &str) -> Vec<String> {
        let mut out: Vec<String> = text
            .match_indices("FLASHTIER_")
            .map(|(at, _)| {
                text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect::<String>()
            })
            .filter(|n| n.len() > "FLASHTIER_".len())
            .collect();
        out.sort();
        out.dedup();
        out
    }

    fn all() -> Vec<&'static str> {
        let mut v: Vec<&str> = tables()
            .iter()
            .flat_map(|(_, t)| t.iter().map(|s| s.name))
            .collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn every_variable_is_named_once() {
        let v = all();
        let mut d = v.clone();
        d.dedup();
        assert_eq!(v, d, "a variable is in two tables");
    }

    #[test]
    fn the_reference_table_lists_exactly_the_variables() {
        let doc = doc();
        // Past "## Removed" the page names switches that are gone.
        let current = doc.split("## Removed").next().unwrap_or_default();
        let listed = names(current);
        for v in all() {
            assert!(
                current.contains(&format!("| `{v}` |")),
                "docs/configuration.md has no row for {v}"
            );
        }
        let known = all();
        for n in &listed {
            assert!(
                known.contains(&n.as_str()),
                "docs/configuration.md names {n}, which nothing reads"
            );
        }
    }

    #[test]
    fn the_readme_names_only_variables_that_exist() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
        let readme = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let known = all();
        for n in names(&readme) {
            assert!(
                known.contains(&n.as_str()),
                "README.md names {n}, which nothing reads"
            );
        }
    }

    #[test]
    fn the_help_lists_every_variable() {
        let help = environment_help();
        for v in all() {
            assert!(help.contains(v), "{v} is not in --help");
        }
    }
}
