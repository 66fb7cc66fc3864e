//! Device memory of the decode engine: f32 activations drawn from a
//! recycling pool ([`ActPool`], [`DevAct`]), resident weight matrices in
//! their stored form ([`DevMatrix`]), f32 vectors, and RoPE's cos/sin
//! table ([`RopeTable`]).
//!
//! Every buffer is zeroed when first allocated; a recycled activation holds
//! the values of its last use (never uninitialised memory) until the
//! kernel it is handed to overwrites it. Work runs in issue order on the
//! compute stream, so a buffer recycled on the host is only reused by work
//! queued after everything that used it.
//!
//! Bound: the pool keeps at most [`POOL_PER_SIZE`] free buffers per size;
//! one more is retired ([`Gpu::retire`]: dropped once the launches queued
//! when it came back are issued).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use cudarc::driver::{CudaSlice, CudaStream};

use crate::context::Gpu;
use crate::error::CudaError;

/// Free buffers kept per element count.
pub const POOL_PER_SIZE: usize = 16;

/// Recycled f32 buffers, by element count.
#[derive(Default)]
pub struct ActPool {
    free: RefCell<HashMap<usize, Vec<CudaSlice<f32>>>>,
    /// The device of the buffers (known from the first `take`).
    gpu: RefCell<Option<Gpu>>,
}

impl std::fmt::Debug for ActPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let free = self.free.borrow();
        f.debug_struct("ActPool")
            .field("sizes", &free.len())
            .finish()
    }
}

impl ActPool {
    /// An empty pool.
    #[must_use]
    pub fn new() -> Rc<Self> {
        Rc::new(Self::default())
    }

    /// A `rows x cols` activation: a recycled buffer of that size, or a new
    /// zeroed one.
    pub fn take(self: &Rc<Self>, gpu: &Gpu, rows: usize, cols: usize) -> Result<DevAct, CudaError> {
        let len = act_len(rows, cols)?;
        if self.gpu.borrow().is_none() {
            *self.gpu.borrow_mut() = Some(gpu.clone());
        }
        let reused = self.free.borrow_mut().get_mut(&len).and_then(Vec::pop);
        let buf = match reused {
            Some(b) => b,
            None => alloc_zeroed(gpu, len)?,
        };
        Ok(DevAct {
            rows,
            cols,
            buf: Some(buf),
            pool: Some(self.clone()),
        })
    }

    fn give_back(&self, buf: CudaSlice<f32>) {
        let mut free = self.free.borrow_mut();
        let list = free.entry(buf.len()).or_default();
        if list.len() < POOL_PER_SIZE {
            list.push(buf);
        } else if let Some(gpu) = self.gpu.borrow().as_ref() {
            gpu.retire(buf);
        }
    }
}

/// Elements of a `rows x cols` activation (neither 0, no overflow).
fn act_len(rows: usize, cols: usize) -> Result<usize, CudaError> {
    rows.checked_mul(cols)
        .filter(|n| *n > 0)
        .ok_or_else(|| CudaError::invalid("activation", format!("{rows}x{cols}")))
}

/// `len` zeroed f32 on the compute stream (fresh memory no queued launch
/// uses: the queue need not be issued first).
fn alloc_zeroed(gpu: &Gpu, len: usize) -> Result<CudaSlice<f32>, CudaError> {
    gpu.raw_stream()
        .alloc_zeros::<f32>(len)
        .map_err(CudaError::driver(format!("allocate {len} f32 activations")))
}

/// A `rows x cols` row-major f32 activation on the device.
pub struct DevAct {
    rows: usize,
    cols: usize,
    buf: Option<CudaSlice<f32>>,
    pool: Option<Rc<ActPool>>,
}

impl std::fmt::Debug for DevAct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevAct({}x{})", self.rows, self.cols)
    }
}

impl Drop for DevAct {
    fn drop(&mut self) {
        if let (Some(buf), Some(pool)) = (self.buf.take(), self.pool.take()) {
            pool.give_back(buf);
        }
    }
}

impl DevAct {
    /// A zeroed `rows x cols` activation of its own (no pool): the caller
    /// keeps it across steps and hands its buffer to [`Gpu::retire`] when
    /// done ([`Self::into_buf`]).
    pub(crate) fn detached(gpu: &Gpu, rows: usize, cols: usize) -> Result<Self, CudaError> {
        let buf = alloc_zeroed(gpu, act_len(rows, cols)?)?;
        Ok(Self {
            rows,
            cols,
            buf: Some(buf),
            pool: None,
        })
    }

    /// The buffer, out of the activation (and out of any pool).
    pub(crate) fn into_buf(mut self) -> CudaSlice<f32> {
        self.pool = None;
        self.buf
            .take()
            .unwrap_or_else(|| unreachable!("DevAct without a buffer"))
    }

    /// Rows.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The device buffer (`rows * cols` elements).
    pub(crate) fn buf(&self) -> &CudaSlice<f32> {
        // A DevAct always holds its buffer until it is dropped.
        self.buf
            .as_ref()
            .unwrap_or_else(|| unreachable!("DevAct without a buffer"))
    }

    pub(crate) fn buf_mut(&mut self) -> &mut CudaSlice<f32> {
        self.buf
            .as_mut()
            .unwrap_or_else(|| unreachable!("DevAct without a buffer"))
    }

    /// Copy to the host (synchronises the stream; issue queued launches
    /// first, [`Gpu::flush`], or `stream` must come from [`Gpu::stream`]).
    pub fn to_host(&self, stream: &std::sync::Arc<CudaStream>) -> Result<Vec<f32>, CudaError> {
        stream
            .clone_dtoh(self.buf())
            .map_err(CudaError::driver("copy activations to the host"))
    }

    /// Overwrite from host values (`rows * cols` of them).
    pub fn upload(
        &mut self,
        stream: &std::sync::Arc<CudaStream>,
        values: &[f32],
    ) -> Result<(), CudaError> {
        if values.len() != self.rows * self.cols {
            return Err(CudaError::invalid(
                "activation upload",
                format!("{} values for {}x{}", values.len(), self.rows, self.cols),
            ));
        }
        stream
            .memcpy_htod(values, self.buf_mut())
            .map_err(CudaError::driver("copy activations to the device"))
    }
}

/// How a weight matrix's elements are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightType {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
    /// FP8 E4M3 codes with F32 scales per `block` (rows, columns).
    Fp8 {
        /// Block rows and columns.
        block: [usize; 2],
    },
}

impl WeightType {
    /// Bytes per element.
    #[must_use]
    pub fn elem_bytes(self) -> usize {
        match self {
            Self::Bf16 | Self::F16 => 2,
            Self::F32 => 4,
            Self::Fp8 { .. } => 1,
        }
    }

    /// The kernel suffix.
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::F32 => "f32",
            Self::Fp8 { .. } => "fp8",
        }
    }

    /// The scale grid of a `rows x cols` matrix (`[0, 0]` without scales).
    #[must_use]
    pub fn scale_grid(self, rows: usize, cols: usize) -> [usize; 2] {
        match self {
            Self::Fp8 { block: [br, bc] } => [rows.div_ceil(br.max(1)), cols.div_ceil(bc.max(1))],
            _ => [0, 0],
        }
    }
}

/// A resident weight matrix `[rows, cols]` in its stored form.
pub struct DevMatrix {
    rows: usize,
    cols: usize,
    ty: WeightType,
    data: CudaSlice<u8>,
    /// FP8 scale grid, row-major; one zero element otherwise.
    scales: CudaSlice<f32>,
}

impl std::fmt::Debug for DevMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevMatrix({}x{} {:?})", self.rows, self.cols, self.ty)
    }
}

impl DevMatrix {
    /// Copy a `rows x cols` matrix of `ty` to the device: `bytes` row-major
    /// elements, `scales` the little-endian F32 scale grid (FP8 only).
    pub fn upload(
        gpu: &Gpu,
        rows: usize,
        cols: usize,
        ty: WeightType,
        bytes: &[u8],
        scales: Option<&[u8]>,
    ) -> Result<Self, CudaError> {
        let want = rows * cols * ty.elem_bytes();
        if rows == 0 || cols == 0 || bytes.len() != want {
            return Err(CudaError::invalid(
                "weight matrix",
                format!(
                    "{rows}x{cols} {ty:?} needs {want} bytes, got {}",
                    bytes.len()
                ),
            ));
        }
        if let WeightType::Fp8 { block: [br, bc] } = ty {
            if br == 0 || bc == 0 || bc % 8 != 0 {
                return Err(CudaError::invalid(
                    "weight matrix",
                    format!("FP8 block {br}x{bc} (column blocks must be multiples of 8)"),
                ));
            }
        }
        let [sr, sc] = ty.scale_grid(rows, cols);
        let scale_values: Vec<f32> = match (ty, scales) {
            (WeightType::Fp8 { .. }, Some(s)) if s.len() == sr * sc * 4 => s
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            (WeightType::Fp8 { .. }, _) => {
                return Err(CudaError::invalid(
                    "weight matrix",
                    format!("FP8 {rows}x{cols} needs {} scale bytes", sr * sc * 4),
                ));
            }
            _ => vec![0.0],
        };
        let stream = gpu.stream();
        let data = stream
            .clone_htod(bytes)
            .map_err(CudaError::driver(format!("upload {want} weight bytes")))?;
        let scales = stream
            .clone_htod(&scale_values)
            .map_err(CudaError::driver("upload weight scales"))?;
        Ok(Self {
            rows,
            cols,
            ty,
            data,
            scales,
        })
    }

    /// Rows.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Element type.
    #[must_use]
    pub fn ty(&self) -> WeightType {
        self.ty
    }

    /// Device bytes held.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.data.len() + 4 * self.scales.len()
    }

    pub(crate) fn data(&self) -> &CudaSlice<u8> {
        &self.data
    }

    pub(crate) fn scales(&self) -> &CudaSlice<f32> {
        &self.scales
    }
}

/// A resident f32 vector.
pub struct DevVector {
    len: usize,
    data: CudaSlice<f32>,
}

impl std::fmt::Debug for DevVector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevVector({})", self.len)
    }
}

impl DevVector {
    /// Copy `values` to the device.
    pub fn upload(gpu: &Gpu, values: &[f32]) -> Result<Self, CudaError> {
        if values.is_empty() {
            return Err(CudaError::invalid("vector", "empty".to_string()));
        }
        let data = gpu
            .stream()
            .clone_htod(values)
            .map_err(CudaError::driver("upload vector"))?;
        Ok(Self {
            len: values.len(),
            data,
        })
    }

    /// Elements.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Is it empty? (Never: uploads refuse empty vectors.)
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn data(&self) -> &CudaSlice<f32> {
        &self.data
    }
}

/// RoPE's cos and sin for positions `0..positions`, `half` frequencies each.
pub struct RopeTable {
    positions: usize,
    half: usize,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

impl std::fmt::Debug for RopeTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RopeTable({} x {})", self.positions, self.half)
    }
}

impl RopeTable {
    /// Upload host-computed tables (`positions * half` values each).
    pub fn upload(
        gpu: &Gpu,
        positions: usize,
        half: usize,
        cos: &[f32],
        sin: &[f32],
    ) -> Result<Self, CudaError> {
        if half == 0 || cos.len() != positions * half || sin.len() != cos.len() {
            return Err(CudaError::invalid(
                "rope table",
                format!(
                    "{} / {} values for {positions} x {half}",
                    cos.len(),
                    sin.len()
                ),
            ));
        }
        let stream = gpu.stream();
        Ok(Self {
            positions,
            half,
            cos: stream
                .clone_htod(cos)
                .map_err(CudaError::driver("upload rope cos"))?,
            sin: stream
                .clone_htod(sin)
                .map_err(CudaError::driver("upload rope sin"))?,
        })
    }

    /// Positions covered.
    #[must_use]
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// Frequencies per position.
    #[must_use]
    pub fn half(&self) -> usize {
        self.half
    }

    pub(crate) fn tables(&self) -> (&CudaSlice<f32>, &CudaSlice<f32>) {
        (&self.cos, &self.sin)
    }
}
