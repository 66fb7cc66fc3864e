//! Kernel launches, issued at once or queued for a decode step and issued
//! as CUDA graphs.
//!
//! A batch-1 decode step is a fixed sequence of a few hundred small
//! kernels, so launching them one by one costs about as much host time as
//! they take on the device. While a step records ([`crate::Gpu::begin_step`]),
//! launches go into a queue instead; every [`SEGMENT_LAUNCHES`] launches, and
//! when the step ends ([`crate::Gpu::flush`]), the queued segment is issued:
//!
//! - a segment whose shape (kernels, grids, blocks, argument layout, its
//!   index in the step) was issued before as a graph replays that graph,
//!   after the arguments that changed (the position, the token, a pointer)
//!   are written into its nodes;
//! - a shape seen once before is built into a graph (one node per launch,
//!   each depending on the one before, so the order is issue order); the
//!   edge into a kernel that waits on its predecessor itself
//!   (`griddepcontrol.wait`, see [`crate::ops`]) is programmatic, so its
//!   blocks start (and prefetch their weights) while the kernel before it
//!   ends (programmatic dependent launch; `FLASHTIER_PDL=0` turns it off);
//! - a shape never seen is launched kernel by kernel.
//!
//! Either way the kernels run in issue order on the compute stream with the
//! arguments they were queued with, so a graph replay computes exactly what
//! the launches would have.
//!
//! Invariants: anything else that touches the compute stream goes through
//! [`crate::Gpu::stream`], which issues the queue first, so copies, events
//! and allocations stay ordered after the kernels queued before them; a
//! buffer dropped while queued launches may use it is handed to
//! [`crate::Gpu::retire`], which keeps it until they are issued.
//!
//! Bounds: at most the segment length ([`SEGMENT_LAUNCHES`] unless set,
//! never more than [`MAX_SEGMENT_LAUNCHES`]) launches queued, [`MAX_GRAPHS`]
//! executable graphs kept (least recently used first out), [`SEEN_SHAPES`]
//! shapes remembered.

mod args;
mod graph;

use std::any::Any;
use std::sync::{Mutex, PoisonError};

use cudarc::driver::sys::{CUfunction, CUstream};
use cudarc::driver::{CudaFunction, LaunchConfig};

pub use args::{Args, KernelArg, MAX_ARGS, OnStream};

use crate::error::CudaError;
use crate::settings::LaunchSettings;
pub use crate::settings::{MAX_SEGMENT_LAUNCHES, SEGMENT_LAUNCHES};

/// Executable graphs kept.
pub const MAX_GRAPHS: usize = 32;
/// Segment shapes remembered (to build a graph the second time one comes).
pub const SEEN_SHAPES: usize = 64;
/// Shortest segment issued as a graph.
pub const MIN_GRAPH_LAUNCHES: usize = 4;

/// What the launch path did, since the device was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GraphStats {
    /// Kernels launched one by one (outside a step, or in a segment of a
    /// new shape).
    pub direct_kernels: u64,
    /// Graphs built.
    pub builds: u64,
    /// Graph launches (builds included).
    pub graph_launches: u64,
    /// Kernels run inside graphs.
    pub graph_kernels: u64,
    /// Graph nodes whose arguments were rewritten before a replay.
    pub patched_nodes: u64,
}

/// A kernel handle (a driver handle, valid in the context on any thread).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Func(CUfunction);

// SAFETY: a CUfunction is a process-wide driver handle of a loaded module;
// the driver allows using it from any thread that has its context current,
// which every call here ensures first.
unsafe impl Send for Func {}

/// One queued kernel launch.
#[derive(Clone)]
pub(crate) struct Launch {
    name: &'static str,
    func: Func,
    grid: [u32; 3],
    block: [u32; 3],
    smem: u32,
    args: Args,
    /// The kernel waits for the kernel before it itself (it may start early).
    pdl: bool,
}

impl Launch {
    fn same_shape(&self, other: &Launch) -> bool {
        self.func == other.func
            && self.grid == other.grid
            && self.block == other.block
            && self.smem == other.smem
            && self.args.len() == other.args.len()
            && self.pdl == other.pdl
    }

    /// Issue on `stream`.
    fn issue(&self, stream: CUstream) -> Result<(), CudaError> {
        let mut params = self.args.pointers();
        let [gx, gy, gz] = self.grid;
        let [bx, by, bz] = self.block;
        // SAFETY: the caller of `Gpu::launch` promised that these arguments
        // match the kernel and that every buffer they name stays allocated
        // until the kernel ran (`Gpu::retire`); `params` points into
        // `self.args`, alive for the call (the driver copies the values).
        unsafe {
            cudarc::driver::sys::cuLaunchKernel(
                self.func.0,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                self.smem,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(CudaError::driver(format!("launch {}", self.name)))
    }
}

/// The queue of one device, behind the [`crate::Gpu`]'s mutex.
pub(crate) struct Queue {
    graphs_on: bool,
    /// Programmatic edges into kernels that wait themselves (until the
    /// driver refuses one).
    pdl_on: bool,
    segment_len: usize,
    recording: bool,
    segment: u32,
    pending: Vec<Launch>,
    held: Vec<Box<dyn Any + Send>>,
    cache: graph::Cache,
    stats: GraphStats,
    /// A failure of an issue no caller could be told of (from
    /// [`crate::Gpu::stream`]); the next launch or flush returns it.
    error: Option<CudaError>,
}

impl Queue {
    pub(crate) fn new(s: LaunchSettings) -> Self {
        Self {
            graphs_on: s.graphs,
            pdl_on: s.pdl,
            segment_len: s.segment_launches.clamp(1, MAX_SEGMENT_LAUNCHES),
            recording: false,
            segment: 0,
            pending: Vec::new(),
            held: Vec::new(),
            cache: graph::Cache::default(),
            stats: GraphStats::default(),
            error: None,
        }
    }

    fn take_error(&mut self) -> Result<(), CudaError> {
        self.error.take().map_or(Ok(()), Err)
    }

    /// Issue the queued segment (a graph where its shape allows); returns
    /// the buffers that waited for it, to be dropped after the lock.
    fn issue(&mut self, stream: CUstream) -> (Result<(), CudaError>, Vec<Box<dyn Any + Send>>) {
        let launches = std::mem::take(&mut self.pending);
        let held = std::mem::take(&mut self.held);
        if launches.is_empty() {
            return (Ok(()), held);
        }
        let segment = self.segment;
        self.segment += 1;
        let r = if launches.len() >= MIN_GRAPH_LAUNCHES {
            self.cache
                .run(segment, launches, stream, &mut self.stats, &mut self.pdl_on)
        } else {
            self.stats.direct_kernels += launches.len() as u64;
            launches.iter().try_for_each(|l| l.issue(stream))
        };
        (r, held)
    }
}

/// The shared queue with its lock.
pub(crate) struct Shared(Mutex<Queue>);

impl Shared {
    pub(crate) fn new(s: LaunchSettings) -> Self {
        Self(Mutex::new(Queue::new(s)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Launch now, or queue while a step records. `waits`: the kernel
    /// starts with `griddepcontrol.wait` (before which it writes nothing
    /// and reads nothing an earlier kernel writes), so a graph may start it
    /// early.
    ///
    /// # Safety
    /// As `cuLaunchKernel`: `args` match `func`'s parameters, and every
    /// buffer they point to stays allocated until the kernel ran; `waits`
    /// only for a kernel that waits as said.
    pub(crate) unsafe fn launch(
        &self,
        stream: CUstream,
        (name, waits): (&'static str, bool),
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: Args,
    ) -> Result<(), CudaError> {
        let mut q = self.lock();
        let launch = Launch {
            name,
            func: Func(func.cu_function()),
            grid: [cfg.grid_dim.0, cfg.grid_dim.1, cfg.grid_dim.2],
            block: [cfg.block_dim.0, cfg.block_dim.1, cfg.block_dim.2],
            smem: cfg.shared_mem_bytes,
            args,
            pdl: waits && q.pdl_on,
        };
        q.take_error()?;
        if !q.recording {
            q.stats.direct_kernels += 1;
            return launch.issue(stream);
        }
        q.pending.push(launch);
        if q.pending.len() < q.segment_len {
            return Ok(());
        }
        let (r, held) = q.issue(stream);
        drop(q);
        drop(held);
        r
    }

    /// Start queueing a step's launches (when graphs are on).
    pub(crate) fn begin_step(&self, stream: CUstream) -> Result<(), CudaError> {
        let mut q = self.lock();
        let (r, held) = q.issue(stream);
        q.recording = q.graphs_on;
        q.segment = 0;
        drop(q);
        drop(held);
        r
    }

    /// Issue everything queued and stop recording.
    pub(crate) fn flush(&self, stream: CUstream) -> Result<(), CudaError> {
        let mut q = self.lock();
        let (r, held) = q.issue(stream);
        q.recording = false;
        let stored = q.take_error();
        drop(q);
        drop(held);
        r.and(stored)
    }

    /// Whether a step records.
    pub(crate) fn recording(&self) -> bool {
        self.lock().recording
    }

    /// Whether launches are queued, buffers held, or a step records.
    pub(crate) fn busy(&self) -> bool {
        let q = self.lock();
        !q.pending.is_empty() || !q.held.is_empty() || q.recording
    }

    /// Keep `e` for the next launch or flush to return.
    pub(crate) fn fail(&self, e: CudaError) {
        self.lock().error.get_or_insert(e);
    }

    /// [`Self::flush`] where no error can be returned: it is kept for the
    /// next launch or flush.
    pub(crate) fn flush_quietly(&self, stream: CUstream) {
        let mut q = self.lock();
        let (r, held) = q.issue(stream);
        q.recording = false;
        if let Err(e) = r {
            q.error.get_or_insert(e);
        }
        drop(q);
        drop(held);
    }

    /// Keep `x` until the launches queued now are issued.
    pub(crate) fn retire(&self, x: Box<dyn Any + Send>) {
        let mut q = self.lock();
        if q.pending.is_empty() {
            drop(q);
            drop(x);
        } else {
            q.held.push(x);
        }
    }

    pub(crate) fn set_graphs(&self, on: bool) {
        self.lock().graphs_on = on;
    }

    pub(crate) fn set_pdl(&self, on: bool) {
        self.lock().pdl_on = on;
    }

    pub(crate) fn set_segment_len(&self, n: usize) {
        self.lock().segment_len = n.clamp(1, MAX_SEGMENT_LAUNCHES);
    }

    pub(crate) fn stats(&self) -> GraphStats {
        self.lock().stats
    }
}
