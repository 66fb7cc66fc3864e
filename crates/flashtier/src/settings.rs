//! The tiers' settings from the environment, read through
//! [`flashtier_io::settings`] (the workspace's one reader; a bad value is
//! an error naming the variable).

use flashtier_io::settings::{Env, Setting, SettingError};

/// Most threads in a pool (workers plus the caller).
pub const MAX_THREADS: usize = 256;
/// Default pool size: 32 reads in flight, the queue depth NVMe needs.
pub const DEFAULT_THREADS: usize = 32;

/// `FLASHTIER_ROW_THREADS`: threads of the process-wide row pool
/// ([`crate::rows::pool::RowPool::shared`]), the caller included; 1 to
/// [`MAX_THREADS`], [`DEFAULT_THREADS`] when unset. Read when the pool is
/// first used. (`bench rows --threads` sizes its own pool.)
pub const ROW_THREADS: &str = "FLASHTIER_ROW_THREADS";

/// This crate's variables.
pub const SETTINGS: &[Setting] = &[Setting {
    name: ROW_THREADS,
    default: "32",
    doc: "threads of the shared row pool (1 to 256), the caller included; read at its first use",
}];

/// [`ROW_THREADS`] from `env`.
pub fn row_threads(env: &Env<'_>) -> Result<usize, SettingError> {
    env.int(ROW_THREADS, 1..=MAX_THREADS, DEFAULT_THREADS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_threads_default_range_and_error() {
        assert_eq!(row_threads(&Env::from_pairs(&[])), Ok(DEFAULT_THREADS));
        assert_eq!(row_threads(&Env::from_pairs(&[(ROW_THREADS, "8")])), Ok(8));
        let e = row_threads(&Env::from_pairs(&[(ROW_THREADS, "0")])).unwrap_err();
        assert_eq!(e.var, ROW_THREADS);
        assert!(row_threads(&Env::from_pairs(&[(ROW_THREADS, "257")])).is_err());
        assert_eq!(SETTINGS[0].default, DEFAULT_THREADS.to_string());
    }
}
