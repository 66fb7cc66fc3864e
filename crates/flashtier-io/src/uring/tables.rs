//! The io_uring registration tables: registered files keyed by
//! [`StoreFile::id`] and fixed buffers keyed by [`LandingRegion::id`]
//! (see [`crate::uring`]). Bounds: [`FILE_SLOTS`] files, [`BUFFER_SLOTS`]
//! regions of at most 1 GiB each.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Weak};

use io_uring::Submitter;

use super::{BUFFER_SLOTS, FILE_SLOTS};
use crate::file::StoreFile;
use crate::region::LandingRegion;

/// Largest fixed buffer the kernel accepts.
const MAX_FIXED_BYTES: usize = 1 << 30;

/// Registered-file slots.
///
/// The kernel's table holds its own reference to every registered file, so
/// a file whose owners have all dropped it stays open (and, when unlinked,
/// keeps its blocks allocated) until its slot is cleared. Clearing a slot
/// whose reference is the last one runs the file's final close inside
/// `io_uring_register`, which for a large deleted file (inode eviction,
/// freeing its extents) took 0.45 s on ext4 here. So each entry keeps a
/// duplicate descriptor: clearing the slot then never closes the file, and
/// the duplicate is closed on a short-lived background thread. Dropped files
/// are released by [`FileTable::sweep`], which runs before a new file is
/// registered, when a region is registered, and whenever the ring goes idle.
pub(crate) struct FileTable {
    enabled: bool,
    slots: Vec<Option<FileEntry>>,
    by_id: HashMap<u64, u32>,
}

struct FileEntry {
    id: u64,
    file: Weak<StoreFile>,
    /// Keeps the open file alive past its owners until the slot is cleared.
    dup: OwnedFd,
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
        self.sweep(sub);
        // A free slot: every slot that held a dropped file was cleared by
        // `sweep`, so no request can be in flight on it.
        let s = self.slots.iter().position(Option::is_none)?;
        let s32 = u32::try_from(s).ok()?;
        let dup = file.file().as_fd().try_clone_to_owned().ok()?;
        if sub.register_files_update(s32, &[dup.as_raw_fd()]).is_err() {
            return None;
        }
        if let Some(e) = self.slots.get_mut(s) {
            *e = Some(FileEntry {
                id: file.id(),
                file: Arc::downgrade(file),
                dup,
            });
        }
        self.by_id.insert(file.id(), s32);
        Some(s32)
    }

    /// Clear the slots of files every owner has dropped (no request of
    /// theirs can be in flight: requests hold their file) and close them on
    /// a background thread. A slot the kernel refuses to clear stays taken.
    pub(crate) fn sweep(&mut self, sub: &Submitter<'_>) {
        let mut closing = Vec::new();
        for (s, slot) in self.slots.iter_mut().enumerate() {
            let dropped = slot.as_ref().is_some_and(|e| e.file.strong_count() == 0);
            let Ok(s32) = u32::try_from(s) else { continue };
            if dropped && sub.register_files_update(s32, &[-1]).is_ok() {
                if let Some(e) = slot.take() {
                    self.by_id.remove(&e.id);
                    closing.push(e.dup);
                }
            }
        }
        close_in_background(closing);
    }
}

/// Close `fds` off the calling thread: the last close of a large unlinked
/// file frees its extents, which must not stall the ring.
fn close_in_background(fds: Vec<OwnedFd>) {
    if fds.is_empty() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("flashtier-close".into())
        .spawn(move || drop(fds));
    if let Err(e) = spawned {
        // No thread: the descriptors were moved into the failed closure and
        // are closed here, on the caller's thread.
        tracing::warn!("closing released files inline: {e}");
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
