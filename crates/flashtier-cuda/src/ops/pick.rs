//! Greedy picks on the device: the index of each row's largest value
//! (the lowest index of the largest number, as the host's argmax), so a
//! decode step copies one id to the host instead of a row of logits; and
//! the scratch the grid-wide kernels share.
//!
//! A one-row argmax spreads the row over up to [`MAX_ARGMAX_BLOCKS`]
//! blocks of at least [`ARGMAX_BLOCK_ELEMS`] values; the last block to
//! finish reduces their partial results (a counter in [`Scratch`], 0
//! between launches). Kernels run in issue order on the compute stream,
//! so one scratch serves every launch of a device's kernels.
//!
//! A greedy decode may also leave a pick on the device
//! ([`DecodeKernels::argmax_ahead`]): the next step embeds it there
//! ([`DecodeKernels::embed_picked`]) and is issued before the host reads
//! the id, so the device does not wait for the host between steps. The id
//! comes back through page-locked memory ([`Picks`]: two slots, so one
//! pick's copy can land while the host reads the one before).

use std::sync::{Mutex, PoisonError};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, LaunchConfig, PinnedHostSlice};

use super::buffers::DevAct;
use super::{DecodeKernels, addr, dim};
use crate::context::Gpu;
use crate::error::CudaError;
use crate::launch::Args;

/// Most blocks of a one-row argmax.
pub const MAX_ARGMAX_BLOCKS: usize = 1024;
/// Fewest values one argmax block scans (a 151,936-word vocabulary: 38
/// blocks).
pub const ARGMAX_BLOCK_ELEMS: usize = 4096;

/// Counter of the fused router (`router_softmax_*`).
pub(crate) const ROUTER_COUNTER: usize = 0;
/// Counter of `argmax_grid`.
const ARGMAX_COUNTER: usize = 1;

/// Device memory of the grid-wide kernels: their last-block counters and
/// the one-row argmax's partial results and answer.
pub(crate) struct Scratch {
    counters: CudaSlice<u32>,
    part_v: CudaSlice<f32>,
    part_i: CudaSlice<i32>,
    out: CudaSlice<i32>,
}

impl Scratch {
    /// Zeroed scratch on `gpu`.
    pub(crate) fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        let s = gpu.raw_stream();
        let err = CudaError::driver("allocate kernel scratch");
        Ok(Self {
            counters: s.alloc_zeros::<u32>(2).map_err(err)?,
            part_v: s
                .alloc_zeros::<f32>(MAX_ARGMAX_BLOCKS)
                .map_err(CudaError::driver("allocate kernel scratch"))?,
            part_i: s
                .alloc_zeros::<i32>(MAX_ARGMAX_BLOCKS)
                .map_err(CudaError::driver("allocate kernel scratch"))?,
            out: s
                .alloc_zeros::<i32>(1)
                .map_err(CudaError::driver("allocate kernel scratch"))?,
        })
    }

    /// Device address of counter `slot`.
    pub(crate) fn counter(&self, gpu: &Gpu, slot: usize) -> u64 {
        addr(gpu, &self.counters, slot)
    }

    /// Device address of the one-row argmax's answer.
    fn answer_addr(&self, gpu: &Gpu) -> u64 {
        addr(gpu, &self.out, 0)
    }
}

/// A greedy pick left on the device by [`DecodeKernels::argmax_ahead`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PickTicket {
    /// Picks started on this device before this one.
    seq: u64,
    /// Width of the row picked from (the id is below it).
    cols: usize,
}

impl PickTicket {
    /// Width of the row picked from.
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Picks started on this device before this one.
    #[must_use]
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// A ticket rebuilt from its parts (as a device-neutral caller carried
    /// it); [`DecodeKernels::picked`] refuses one this device did not start
    /// or no longer keeps, and an id outside `cols`.
    #[must_use]
    pub fn from_parts(seq: u64, cols: usize) -> Self {
        Self { seq, cols }
    }
}

/// Page-locked copies of the last two picks and how many were started.
pub(crate) struct Picks(Mutex<PickSlots>);

struct PickSlots {
    host: [PinnedHostSlice<i32>; 2],
    /// Recorded after each slot's copy: the context does not track
    /// events (`Gpu::open`), so the slices' own never are.
    landed: [CudaEvent; 2],
    started: u64,
    /// The scratch's answer is the latest pick's (no plain argmax since).
    answer_is_pick: bool,
}

impl Picks {
    pub(crate) fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        let one = || {
            // SAFETY: a slot is only read after a copy into it landed
            // (`DecodeKernels::picked` waits on the slot's `landed` event).
            unsafe { gpu.context().alloc_pinned::<i32>(1) }
                .map_err(CudaError::driver("allocate page-locked pick slots"))
        };
        let event = || {
            gpu.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(CudaError::driver("create a pick event"))
        };
        Ok(Self(Mutex::new(PickSlots {
            host: [one()?, one()?],
            landed: [event()?, event()?],
            started: 0,
            answer_is_pick: false,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PickSlots> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl DecodeKernels {
    /// The greedy pick of one-row `x` (as [`Self::argmax_rows`]), left on
    /// the device for the next step's [`Self::embed_picked`] and copied to
    /// page-locked memory without waiting: the host may issue more work
    /// before it reads the id with [`Self::picked`]. Ends a recording step.
    pub fn argmax_ahead(&self, x: &DevAct) -> Result<PickTicket, CudaError> {
        if x.rows() != 1 {
            return Err(CudaError::invalid(
                "argmax_ahead",
                format!("{} rows (one)", x.rows()),
            ));
        }
        self.launch_argmax_one(x)?;
        self.gpu.flush()?;
        let mut p = self.picks.lock();
        let seq = p.started;
        let stream = self.gpu.stream();
        let i = (seq % 2) as usize;
        stream
            .memcpy_dtoh(&self.scratch.out, &mut p.host[i])
            .map_err(CudaError::driver("copy a pick"))?;
        p.landed[i]
            .record(stream)
            .map_err(CudaError::driver("record a pick's copy"))?;
        p.started += 1;
        p.answer_is_pick = true;
        Ok(PickTicket {
            seq,
            cols: x.cols(),
        })
    }

    /// The id `t` picked, once its copy landed (waits for that copy only,
    /// not for work issued after it). Only the last two picks can be read.
    pub fn picked(&self, t: PickTicket) -> Result<u32, CudaError> {
        let p = self.picks.lock();
        if t.seq + 2 < p.started || t.seq >= p.started {
            return Err(CudaError::invalid(
                "picked",
                format!(
                    "pick {} of {} started (only the last two are kept)",
                    t.seq, p.started
                ),
            ));
        }
        let i = (t.seq % 2) as usize;
        p.landed[i]
            .synchronize()
            .map_err(CudaError::driver("wait for a pick"))?;
        let host = p.host[i]
            .as_slice()
            .map_err(CudaError::driver("wait for a pick"))?;
        let v = host.first().copied().unwrap_or(-1);
        u32::try_from(v)
            .ok()
            .filter(|&id| (id as usize) < t.cols)
            .ok_or_else(|| CudaError::invalid("picked", format!("id {v} of {} columns", t.cols)))
    }

    /// Device address of the latest pick's id, when `t` is that pick.
    pub(crate) fn latest_pick_addr(&self, t: PickTicket) -> Result<u64, CudaError> {
        let p = self.picks.lock();
        if t.seq + 1 != p.started || !p.answer_is_pick {
            return Err(CudaError::invalid(
                "embed_picked",
                format!(
                    "pick {} is not the device's latest answer ({} picks started; the device keeps one)",
                    t.seq, p.started
                ),
            ));
        }
        Ok(self.scratch.answer_addr(&self.gpu))
    }

    /// Index of each row's largest value (lowest index on ties; as the
    /// host's argmax, 0 for a row whose first value is NaN), on the host.
    /// The launch joins a recording step, which this issues.
    pub fn argmax_rows(&self, x: &DevAct) -> Result<Vec<u32>, CudaError> {
        if x.rows() == 1 {
            return Ok(vec![self.argmax_one(x)?]);
        }
        let gpu = &self.gpu;
        // Fresh memory no queued launch uses: no need to issue them.
        let out = gpu
            .raw_stream()
            .alloc_zeros::<i32>(x.rows())
            .map_err(CudaError::driver("allocate argmax output"))?;
        let cfg = LaunchConfig {
            grid_dim: (dim(x.rows(), "x")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = Args::new();
        a.buf(gpu, x.buf()).push(cols_i32(x)?).buf(gpu, &out);
        // SAFETY: matches `argmax_rows`; one block per row of x, one output each.
        unsafe { self.launch("argmax_rows", cfg, a) }?;
        gpu.flush()?;
        let host = gpu
            .stream()
            .clone_dtoh(&out)
            .map_err(CudaError::driver("copy argmax"))?;
        Ok(host.into_iter().map(|v| v as u32).collect())
    }

    /// The argmax of a one-row `x` over several blocks (`argmax_grid`).
    fn argmax_one(&self, x: &DevAct) -> Result<u32, CudaError> {
        self.picks.lock().answer_is_pick = false;
        self.launch_argmax_one(x)?;
        let gpu = &self.gpu;
        gpu.flush()?;
        let host = gpu
            .stream()
            .clone_dtoh(&self.scratch.out)
            .map_err(CudaError::driver("copy argmax"))?;
        host.first()
            .map(|&v| v as u32)
            .ok_or_else(|| CudaError::invalid("argmax", "no result".to_string()))
    }

    /// Launch `argmax_grid` over one-row `x` into the scratch's answer.
    fn launch_argmax_one(&self, x: &DevAct) -> Result<(), CudaError> {
        let gpu = &self.gpu;
        let n = x.cols();
        let per = ARGMAX_BLOCK_ELEMS.max(n.div_ceil(MAX_ARGMAX_BLOCKS));
        let blocks = n.div_ceil(per);
        let cfg = LaunchConfig {
            grid_dim: (dim(blocks, "x")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let s = &self.scratch;
        let mut a = Args::new();
        a.buf(gpu, x.buf())
            .push(cols_i32(x)?)
            .push(per as i32)
            .buf(gpu, &s.part_v)
            .buf(gpu, &s.part_i)
            .push(s.counter(gpu, ARGMAX_COUNTER))
            .buf(gpu, &s.out);
        // SAFETY: matches `argmax_grid`; block b reads x[b * per..][..per]
        // clipped to n = x's one row, and writes partial b < blocks <=
        // MAX_ARGMAX_BLOCKS (the partial arrays' length); the last block
        // writes out[0]; the counter is 0 between launches (kernels run in
        // stream order and the last block resets it).
        unsafe { self.launch("argmax_grid", cfg, a) }
    }
}

fn cols_i32(x: &DevAct) -> Result<i32, CudaError> {
    i32::try_from(x.cols())
        .map_err(|_| CudaError::invalid("argmax", format!("{} columns", x.cols())))
}
