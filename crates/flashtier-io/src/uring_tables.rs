//! The io_uring registration tables: registered files keyed by
//! [`StoreFile::id`] and fixed buffers keyed by [`LandingRegion::id`]
//! (see [`crate::uring`]). Bounds: [`FILE_SLOTS`] files, [`BUFFER_SLOTS`]
//! regions of at most 1 GiB each.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Weak};

use io_uring::Submitter;

use crate::file::StoreFile;
use crate::region::LandingRegion;
use crate::uring::{BUFFER_SLOTS, FILE_SLOTS};

/// Largest fixed buffer the kernel accepts.
const MAX_FIXED_BYTES: usize = 1 << 30;

/// Registered-file slots.
pub(crate) struct FileTable {
    enabled: bool,
    slots: Vec<Option<(u64, Weak<StoreFile>)>>,
    by_id: HashMap<u64, u32>,
}

/// Fixed-buffer slots, one landing region each.
pub(crate) struct BufTable {
    enabled: bool,
    regions: Vec<Arc<LandingRegion>>,
    by_id: HashMap<u64, u16>,
}

impl FileTable {
    /// A table over the kernel's sparse file table (`enabled` when the
    /// kernel accepted it).
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            slots: (0..FILE_SLOTS).map(|_| None).collect(),
            by_id: HashMap::new(),
        }
    }

    /// The registered-file slot of `file`, registering it on first use.
    pub(crate) fn slot_for(&mut self, sub: &Submitter<'_>, file: &Arc<StoreFile>) -> Option<u32> {
        if !self.enabled {
            return None;
        }
        if let Some(&s) = self.by_id.get(&file.id()) {
            return Some(s);
        }
        // A free slot, or one whose file has been dropped (no request of it
        // can be in flight: requests hold their file).
        let s = self
            .slots
            .iter()
            .position(|e| e.as_ref().is_none_or(|(_, w)| w.strong_count() == 0))?;
        let s32 = u32::try_from(s).ok()?;
        let fd = file.file().as_raw_fd();
        if sub.register_files_update(s32, &[fd]).is_err() {
            return None;
        }
        if let Some(Some((old, _))) = self.slots.get(s) {
            self.by_id.remove(old);
        }
        if let Some(e) = self.slots.get_mut(s) {
            *e = Some((file.id(), Arc::downgrade(file)));
        }
        self.by_id.insert(file.id(), s32);
        Some(s32)
    }
}

impl BufTable {
    /// A table over the kernel's sparse buffer table (`enabled` when the
    /// kernel accepted it).
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            regions: Vec::new(),
            by_id: HashMap::new(),
        }
    }

    /// The fixed-buffer index of the region with id `region_id`.
    pub(crate) fn index_of(&self, region_id: u64) -> Option<u16> {
        self.by_id.get(&region_id).copied()
    }

    /// Register `region` as a fixed buffer (kept for the ring's lifetime).
    pub(crate) fn register(
        &mut self,
        sub: &Submitter<'_>,
        region: &Arc<LandingRegion>,
    ) -> Result<(), String> {
        if self.by_id.contains_key(&region.id()) {
            return Ok(());
        }
        if !self.enabled {
            return Err("the kernel refused a fixed-buffer table".into());
        }
        if region.len_bytes() > MAX_FIXED_BYTES {
            return Err(format!(
                "region of {} bytes exceeds the {MAX_FIXED_BYTES}-byte fixed-buffer limit",
                region.len_bytes()
            ));
        }
        // A fresh slot, else one whose region nobody else holds any more: no
        // landing (and so no read in flight) can point into it.
        let idx = if self.regions.len() < BUFFER_SLOTS as usize {
            self.regions.len()
        } else {
            self.regions
                .iter()
                .position(|r| Arc::strong_count(r) == 1)
                .ok_or_else(|| format!("all {BUFFER_SLOTS} fixed-buffer slots are in use"))?
        };
        let idx16 = u16::try_from(idx).map_err(|_| "fixed-buffer index overflow".to_string())?;
        let iov = libc::iovec {
            iov_base: region.base_ptr().cast(),
            iov_len: region.len_bytes(),
        };
        // SAFETY: the region's memory is valid for `len_bytes()` and never
        // moves while the `Arc` lives (RegionMemory contract); the table keeps
        // the `Arc` until the slot is re-registered (when no landing holds the
        // region) or the reaper drops, after the ring is closed. Replacing a
        // slot makes the kernel drop its pages of the old region.
        unsafe { sub.register_buffers_update(u32::from(idx16), &[iov], None) }
            .map_err(|e| format!("register buffer: {e}"))?;
        if let Some(old) = self.regions.get_mut(idx) {
            let old_id = old.id();
            *old = region.clone();
            self.by_id.remove(&old_id);
        } else {
            self.regions.push(region.clone());
        }
        self.by_id.insert(region.id(), idx16);
        Ok(())
    }
}
