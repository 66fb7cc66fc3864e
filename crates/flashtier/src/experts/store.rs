//! The store files behind a pool: the exact store and, optionally, its 3-bit
//! and 2-bit companions, each opened for direct reads (slots backing),
//! buffered reads and a map (mapped backing).
//!
//! A mapped store must not be modified in place while it is mapped (replacing
//! it by rename is safe); see [`flashtier_io::mapped`] for what is checked and
//! what window remains.

use std::path::Path;
use std::sync::Arc;

use flashtier_format::{RecordKey, Store, StoreKind};
use flashtier_io::{DirectMode, MappedFile, StoreFile};

use super::{ExpertsError, Precision};

/// One opened store file.
#[derive(Debug)]
pub struct OpenStore {
    /// The validated header, manifest and checksums.
    pub store: Store,
    /// Opened for direct reads (buffered with a warning where refused).
    pub direct: Arc<StoreFile>,
    /// Opened for buffered reads (page cache).
    pub buffered: Arc<StoreFile>,
    /// Map of the whole file (mapped backing only).
    pub map: Option<MappedFile>,
}

impl OpenStore {
    fn open(path: &Path, mapped: bool) -> Result<Self, ExpertsError> {
        // Through flashtier-io first: it refuses a FIFO or device node
        // before anything blocks reading it.
        let buffered = StoreFile::open_read(path, DirectMode::Off)?;
        let store = Store::read_from(path, buffered.as_ref())?;
        store.expect_kind(StoreKind::Experts)?;
        Ok(Self {
            direct: StoreFile::open_read(path, DirectMode::Prefer)?,
            buffered,
            map: if mapped {
                Some(MappedFile::open(path)?)
            } else {
                None
            },
            store,
        })
    }

    /// File offset of record `index`.
    pub fn offset(&self, index: usize) -> Result<u64, ExpertsError> {
        Ok(self.store.record_offset(index as u64)?)
    }

    /// Payload bytes per record.
    #[must_use]
    pub fn payload_bytes(&self) -> usize {
        self.store.payload_bytes() as usize
    }

    /// Bytes a direct read of one record covers (the stride, a 4096 multiple).
    #[must_use]
    pub fn read_bytes(&self) -> usize {
        self.store.stride_bytes() as usize
    }

    /// Check `payload` against record `index`'s checksum: a mismatch is
    /// [`ExpertsError::Checksum`] naming the file, index, key, offset and
    /// length. Both backings verify through here.
    pub fn verify(&self, index: usize, payload: &[u8]) -> Result<(), ExpertsError> {
        self.store
            .verify_record(index as u64, payload)
            .map_err(|source| ExpertsError::Checksum {
                record: index,
                offset: self.store.record_offset(index as u64).unwrap_or(0),
                len: payload.len(),
                source,
            })
    }
}

/// The exact store and its low-bit companions.
#[derive(Debug)]
pub struct StoreSet {
    full: OpenStore,
    q3: Option<OpenStore>,
    q2: Option<OpenStore>,
}

impl StoreSet {
    /// Open the exact store at `path`; `mapped` also maps it.
    pub fn open(path: &Path, mapped: bool) -> Result<Self, ExpertsError> {
        Ok(Self {
            full: OpenStore::open(path, mapped)?,
            q3: None,
            q2: None,
        })
    }

    /// Attach a low-bit companion (`Q3` or `Q2`) at `path`; it must hold the
    /// same keys in the same order.
    pub fn attach(&mut self, precision: Precision, path: &Path) -> Result<(), ExpertsError> {
        let mapped = self.full.map.is_some();
        let low = OpenStore::open(path, mapped)?;
        if low.store.manifest().keys != self.full.store.manifest().keys {
            return Err(ExpertsError::StoreMismatch {
                path: path.to_path_buf(),
                what: "its record keys differ from the exact store's".into(),
            });
        }
        if low.read_bytes() > self.full.read_bytes() {
            return Err(ExpertsError::StoreMismatch {
                path: path.to_path_buf(),
                what: format!(
                    "records of {} bytes exceed the exact stride {}",
                    low.read_bytes(),
                    self.full.read_bytes()
                ),
            });
        }
        match precision {
            Precision::Full => {
                return Err(ExpertsError::StoreMismatch {
                    path: path.to_path_buf(),
                    what: "a companion must be 3-bit or 2-bit".into(),
                });
            }
            Precision::Q3 => self.q3 = Some(low),
            Precision::Q2 => self.q2 = Some(low),
        }
        Ok(())
    }

    /// Check every map for changes since the last check (one fstat each) and
    /// advance its epoch where it may have changed (see
    /// [`MappedFile::check_epoch`]). A no-op for unmapped stores.
    pub fn check_epochs(&mut self) -> Result<(), ExpertsError> {
        for s in [Some(&mut self.full), self.q3.as_mut(), self.q2.as_mut()]
            .into_iter()
            .flatten()
        {
            if let Some(map) = &mut s.map {
                map.check_epoch()?;
            }
        }
        Ok(())
    }

    /// The store holding `precision`, if attached.
    #[must_use]
    pub fn get(&self, precision: Precision) -> Option<&OpenStore> {
        match precision {
            Precision::Full => Some(&self.full),
            Precision::Q3 => self.q3.as_ref(),
            Precision::Q2 => self.q2.as_ref(),
        }
    }

    /// The exact store.
    #[must_use]
    pub fn full(&self) -> &OpenStore {
        &self.full
    }

    /// Records per store.
    #[must_use]
    pub fn records(&self) -> usize {
        self.full.store.record_count() as usize
    }

    /// Record index of `(layer, expert)`.
    pub fn index_of(&self, layer: u32, expert: u32) -> Result<usize, ExpertsError> {
        Ok(self.full.store.index_of(RecordKey::new(layer, expert))? as usize)
    }

    /// Key of record `index` as `layer=L expert=E` (for error messages).
    #[must_use]
    pub fn key_name(&self, index: usize) -> String {
        let m = self.full.store.manifest();
        self.full
            .store
            .key_of(index as u64)
            .map_or_else(|_| format!("index {index}"), |k| m.key_name(k))
    }

    /// Layer of record `index` (0 when out of range).
    #[must_use]
    pub fn layer_of(&self, index: usize) -> u32 {
        self.full.store.key_of(index as u64).map_or(0, |k| k.layer)
    }
}
