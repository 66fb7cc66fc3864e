//! Time per kernel class on the GPU, for the roofline report: when on,
//! every operation of the CUDA device records an event before and after it
//! and the bytes it must read (weights, KV, expert records); the report
//! sums the device time between the events per class.
//!
//! Off by default: events cost a little on every launch. Bound: two events
//! per operation while on (about 40 per layer per token); the caller turns
//! it on for a few steps and takes the report.

use std::cell::RefCell;

use flashtier_cuda::Gpu;
use flashtier_cuda::cudarc::driver::CudaEvent;
use flashtier_cuda::cudarc::driver::sys::CUevent_flags;

use crate::error::EngineError;

/// What an operation is, for the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpClass {
    /// Matrix-vector products of resident weights (attention projections,
    /// routers, dense and shared-expert MLPs).
    DenseGemv,
    /// The LM head.
    LmHead,
    /// Routed experts (gate/up, down, weighted sum).
    Experts,
    /// KV append and attention.
    Attention,
    /// Routing (softmax or grouped top-k).
    Routing,
    /// Norms, RoPE, elementwise, embeddings, copies.
    Other,
}

/// One class's share of the profiled steps.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ClassTime {
    /// The class.
    pub class: OpClass,
    /// Operations.
    pub ops: u64,
    /// Device seconds between their events.
    pub secs: f64,
    /// Bytes they must read.
    pub bytes: u64,
}

impl ClassTime {
    /// Achieved read bandwidth, bytes/s.
    pub fn bytes_per_sec(&self) -> f64 {
        if self.secs > 0.0 {
            self.bytes as f64 / self.secs
        } else {
            0.0
        }
    }
}

struct Mark {
    class: OpClass,
    start: CudaEvent,
    end: CudaEvent,
    bytes: u64,
}

/// The marks of the profiled operations.
#[derive(Default)]
pub(crate) struct Profiler {
    marks: RefCell<Option<Vec<Mark>>>,
}

impl Profiler {
    pub(crate) fn start(&self) {
        *self.marks.borrow_mut() = Some(Vec::new());
    }

    pub(crate) fn on(&self) -> bool {
        self.marks.borrow().is_some()
    }

    /// Run `op`, bracketed by events when profiling.
    pub(crate) fn time<T>(
        &self,
        gpu: &Gpu,
        class: OpClass,
        bytes: u64,
        op: impl FnOnce() -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        if !self.on() {
            return op();
        }
        let event = || {
            gpu.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(event_error)
        };
        let (start, end) = (event()?, event()?);
        let record = |e: &CudaEvent| e.record(gpu.stream()).map_err(event_error);
        record(&start)?;
        let out = op()?;
        record(&end)?;
        if let Some(m) = self.marks.borrow_mut().as_mut() {
            m.push(Mark {
                class,
                start,
                end,
                bytes,
            });
        }
        Ok(out)
    }

    /// Stop profiling; the per-class totals (waits for the device).
    pub(crate) fn take(&self) -> Result<Vec<ClassTime>, EngineError> {
        let marks = self.marks.borrow_mut().take().unwrap_or_default();
        let mut out: Vec<ClassTime> = Vec::new();
        for m in marks {
            m.end.synchronize().map_err(event_error)?;
            let ms = m.start.elapsed_ms(&m.end).map_err(event_error)?;
            let slot = match out.iter_mut().find(|c| c.class == m.class) {
                Some(c) => c,
                None => {
                    out.push(ClassTime {
                        class: m.class,
                        ops: 0,
                        secs: 0.0,
                        bytes: 0,
                    });
                    let last = out.len() - 1;
                    &mut out[last]
                }
            };
            slot.ops += 1;
            slot.secs += f64::from(ms) / 1e3;
            slot.bytes += m.bytes;
        }
        out.sort_by_key(|c| c.class);
        Ok(out)
    }
}

/// A failed profiling event, as the engine reports it.
fn event_error(e: flashtier_cuda::cudarc::driver::DriverError) -> EngineError {
    EngineError::Layout {
        what: "a profiling event".into(),
        reason: e.to_string(),
    }
}
