//! A BF16 prompt step's dense products through cuBLASLt, with the operands
//! of [`super::mma`]: the f32 input split once into BF16 hi and lo parts
//! (`split_bf16_rows`), BF16 weights, f32 outputs. Each product is two
//! cuBLASLt matmuls on the compute stream, `out = w·hi` then `out += w·lo`
//! (beta 1, in place), f32 accumulation on the tensor cores: the same
//! terms as the tiles', each off by at most 2^-17 relative, summed in
//! cuBLAS's order instead of one chain over k.
//!
//! **Rows stand alone.** A prompt step's rows must get the bits they get in
//! any other step (a budget run cuts the prompt into 256-row steps, a
//! resident one into 1024-row steps, and their outputs are compared bit
//! for bit). cuBLAS picks its kernel by shape, so the row count would
//! change a row's rounding; here the algorithm is chosen once per weight
//! shape `(n, k)` by cuBLASLt's heuristic for a fixed [`REFERENCE_ROWS`]
//! and then pinned for every row count, with split-K excluded (no
//! reduction across blocks: an output's sum over k runs inside one tile,
//! in an order the kernel fixes). `gpu_prompt_tiles` checks a row alone,
//! the first rows alone and the whole step give the same bits. A shape
//! the heuristic finds no such algorithm for keeps the tiles, always (the
//! choice is a function of the shape only).
//!
//! `libcublasLt` is loaded at run time; where it cannot be, the tiles run
//! ([`LtProducts::open`] returns `None` and says why at debug level).
//!
//! Bounds: one handle and one workspace of [`WORKSPACE_BYTES`] per
//! [`super::DecodeKernels`]; one plan per distinct weight shape (a model
//! has a handful) and per plan at most [`MAX_ROW_LAYOUTS`] row-count
//! layouts (cleared past that).

use core::ffi::c_void;
use std::cell::RefCell;
use std::collections::HashMap;

use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::CudaSlice;

use crate::context::Gpu;
use crate::error::CudaError;

/// The row count the algorithm of a shape is chosen for (a prompt step's
/// default rows on the GPU); the choice then holds for every row count.
pub const REFERENCE_ROWS: u64 = 1024;
/// The workspace cuBLASLt may use (NVIDIA's recommendation for Hopper).
pub const WORKSPACE_BYTES: usize = 32 << 20;
/// Row-count layouts a plan keeps before it clears them.
pub const MAX_ROW_LAYOUTS: usize = 16;
/// Algorithms asked of the heuristic, of which the first without split-K
/// is taken.
const CANDIDATES: usize = 8;

/// Whether `libcublasLt` can be loaded here.
#[must_use]
pub fn cublaslt_present() -> bool {
    // SAFETY: a dlopen probe by the candidate names; no function of the
    // library is called and the handle is dropped.
    unsafe { sys::is_culib_present() }
}

/// A cuBLASLt status as [`CudaError::BlasLt`].
fn lt(what: &'static str) -> impl FnOnce(CublasError) -> CudaError {
    move |source| CudaError::BlasLt { what, source }
}

/// A matrix layout, destroyed with its owner.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    fn new(ty: sys::cudaDataType, rows: u64, cols: u64, ld: i64) -> Result<Self, CudaError> {
        result::create_matrix_layout(ty, rows, cols, ld)
            .map(Self)
            .map_err(lt("create a matrix layout"))
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by `Layout::new`, destroyed once, here; no
        // queued matmul holds it (cuBLASLt reads layouts at the call).
        let _ = unsafe { result::destroy_matrix_layout(self.0) };
    }
}

/// One weight shape's pinned algorithm: `out[m, n] = x[m, k] · w[n, k]ᵀ`
/// as cuBLAS's column-major `outᵀ (n x m) = op(W) (n x k) · xᵀ (k x m)`
/// with W read as the `k x n` matrix it is in memory and transposed.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    w: Layout,
    algo: sys::cublasLtMatmulAlgo_t,
    /// The input's and the output's layouts per row count.
    rows: HashMap<u64, (Layout, Layout)>,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in `Plan::new`, destroyed once, here.
        let _ = unsafe { result::destroy_matmul_desc(self.desc) };
    }
}

impl Plan {
    /// The layouts of `rows` input rows: `xᵀ` (BF16, `k x rows`, ld k)
    /// and `outᵀ` (f32, `n x rows`, ld n).
    fn rows_layouts(n: u64, k: u64, rows: u64) -> Result<(Layout, Layout), CudaError> {
        Ok((
            Layout::new(sys::cudaDataType::CUDA_R_16BF, k, rows, k as i64)?,
            Layout::new(sys::cudaDataType::CUDA_R_32F, n, rows, n as i64)?,
        ))
    }

    /// The plan of shape `(n, k)`, or `None` where the heuristic offers
    /// no algorithm without split-K.
    fn new(handle: sys::cublasLtHandle_t, n: u64, k: u64) -> Result<Option<Self>, CudaError> {
        let desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt("create a matmul descriptor"))?;
        let mut plan = Plan {
            desc,
            w: Layout::new(sys::cudaDataType::CUDA_R_16BF, k, n, k as i64)?,
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            rows: HashMap::new(),
        };
        // CUBLAS_OP_T (cublasOperation_t, 1 = transposed; cudarc's
        // cuBLASLt bindings do not name the type).
        let trans: i32 = 1;
        // SAFETY: the descriptor is live; the attribute is a 32-bit
        // cublasOperation_t, passed by address with its size.
        unsafe {
            result::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&raw const trans).cast::<c_void>(),
                size_of_val(&trans),
            )
        }
        .map_err(lt("set the weights' transpose"))?;
        let (x, out) = Self::rows_layouts(n, k, REFERENCE_ROWS)?;
        let pref = Preference::new()?;
        let empty = sys::cublasLtMatmulHeuristicResult_t {
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            workspaceSize: 0,
            state: sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
            wavesCount: 0.0,
            reserved: [0; 4],
        };
        let mut found = [empty; CANDIDATES];
        let mut count: core::ffi::c_int = 0;
        // SAFETY: every descriptor is live; `found` holds CANDIDATES
        // results and cuBLASLt writes at most that many, and their count.
        let status = unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc,
                plan.w.0,
                x.0,
                out.0,
                out.0,
                pref.0,
                CANDIDATES as core::ffi::c_int,
                found.as_mut_ptr(),
                &raw mut count,
            )
        };
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            tracing::debug!(n, k, ?status, "cuBLASLt has no algorithm: tiles");
            return Ok(None);
        }
        let count = usize::try_from(count).unwrap_or(0).min(CANDIDATES);
        let pick = found[..count].iter().find(|h| {
            h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && split_k(&h.algo) <= 1
        });
        let Some(pick) = pick else {
            tracing::debug!(n, k, count, "cuBLASLt offers only split-K: tiles");
            return Ok(None);
        };
        plan.algo = pick.algo;
        plan.rows.insert(REFERENCE_ROWS, (x, out));
        Ok(Some(plan))
    }
}

/// The split-K count of an algorithm's configuration (1 when unreadable:
/// the preference already excludes split-K reductions).
fn split_k(algo: &sys::cublasLtMatmulAlgo_t) -> u32 {
    let mut v: u32 = 1;
    let mut written = 0usize;
    // SAFETY: `algo` is an initialised algorithm from the heuristic; the
    // attribute is a u32 written into `v`, whose size is passed.
    let _ = unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
            (&raw mut v).cast::<c_void>(),
            size_of_val(&v),
            &raw mut written,
        )
    };
    v
}

/// The heuristic's preference: the workspace's size, no split-K
/// reduction, and operands only 16-byte aligned (the lo part of an input
/// starts `rows * k` values after the hi part).
struct Preference(sys::cublasLtMatmulPreference_t);

impl Preference {
    fn new() -> Result<Self, CudaError> {
        let p = Self(result::create_matmul_pref().map_err(lt("create a preference"))?);
        let ws = WORKSPACE_BYTES as u64;
        let none = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
        let align: u32 = 16;
        use sys::cublasLtMatmulPreferenceAttributes_t as A;
        let set = |attr: A, v: *const c_void, len: usize| {
            // SAFETY: the preference is live; `v` points to `len` bytes of
            // the attribute's type (u64 for the workspace, u32 otherwise).
            unsafe { result::set_matmul_pref_attribute(p.0, attr, v, len) }
                .map_err(lt("set a preference"))
        };
        set(
            A::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&raw const ws).cast(),
            8,
        )?;
        set(
            A::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
            (&raw const none).cast(),
            4,
        )?;
        for attr in [
            A::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            A::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            A::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            A::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        ] {
            set(attr, (&raw const align).cast(), 4)?;
        }
        Ok(p)
    }
}

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created in `Preference::new`, destroyed once, here.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}

/// A cuBLASLt handle, its workspace and the plans of the shapes seen.
pub struct LtProducts {
    gpu: Gpu,
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: RefCell<HashMap<(u64, u64), Option<Plan>>>,
}

impl std::fmt::Debug for LtProducts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LtProducts")
            .field("shapes", &self.plans.borrow().len())
            .finish()
    }
}

impl Drop for LtProducts {
    fn drop(&mut self) {
        // The plans' descriptors go before the handle.
        self.plans.borrow_mut().clear();
        // SAFETY: created in `open`, destroyed once, here; the stream's
        // queued matmuls keep what they need (cuBLASLt copies arguments at
        // the call).
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

impl LtProducts {
    /// A handle and workspace on `gpu`, or `None` where libcublasLt
    /// cannot be loaded or initialised (the tiles run instead).
    pub fn open(gpu: &Gpu) -> Option<Self> {
        if !cublaslt_present() {
            tracing::debug!("libcublasLt not found: a prompt's dense products run as tiles");
            return None;
        }
        // The workspace first: a failure after it drops it, while a handle
        // would need destroying by hand.
        let opened = gpu
            .raw_stream()
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(CudaError::driver("allocate the cuBLASLt workspace"))
            .and_then(|workspace| {
                let handle = result::create_handle().map_err(lt("create a handle"))?;
                Ok(Self {
                    gpu: gpu.clone(),
                    handle,
                    workspace,
                    plans: RefCell::new(HashMap::new()),
                })
            });
        opened
            .map_err(|e| tracing::debug!("cuBLASLt unavailable ({e}): tiles"))
            .ok()
    }

    /// Whether shape `(n, k)` has a pinned algorithm (chosen on first ask).
    pub fn covers(&self, n: usize, k: usize) -> Result<bool, CudaError> {
        let key = (n as u64, k as u64);
        let mut plans = self.plans.borrow_mut();
        if let Some(p) = plans.get(&key) {
            return Ok(p.is_some());
        }
        let plan = Plan::new(self.handle, key.0, key.1)?;
        let has = plan.is_some();
        plans.insert(key, plan);
        Ok(has)
    }

    /// `out[r] = w · (hi[r] + lo[r])` for `rows` rows: `w` at device
    /// address `w` (`n x k` BF16), the split input's parts at `hi` and
    /// `lo` (`rows x k` BF16 each), `out` (`rows x n` f32). The shape must
    /// be [`Self::covers`]'d.
    ///
    /// # Safety
    /// The addresses hold those elements, 16-byte aligned, and stay
    /// allocated until the compute stream ran the two matmuls; `out`
    /// overlaps none of the others.
    pub unsafe fn product(
        &self,
        [n, k, rows]: [usize; 3],
        w: u64,
        [hi, lo]: [u64; 2],
        out: u64,
    ) -> Result<(), CudaError> {
        let key = (n as u64, k as u64);
        let mut plans = self.plans.borrow_mut();
        let Some(Some(plan)) = plans.get_mut(&key) else {
            return Err(CudaError::invalid(
                "cuBLASLt product",
                format!("no pinned algorithm for {n}x{k}"),
            ));
        };
        let m = rows as u64;
        if !plan.rows.contains_key(&m) {
            if plan.rows.len() >= MAX_ROW_LAYOUTS {
                plan.rows.clear();
            }
            plan.rows.insert(m, Plan::rows_layouts(key.0, key.1, m)?);
        }
        let (x_l, out_l) = &plan.rows[&m];
        // Issue this crate's queued launches first (the split is one).
        let stream = self.gpu.stream().cu_stream() as sys::cudaStream_t;
        let ws = super::addr(&self.gpu, &self.workspace, 0);
        let (one, zero) = (1.0f32, 0.0f32);
        for (part, beta) in [(hi, &zero), (lo, &one)] {
            // SAFETY: the caller's promise for w, the parts and out, whose
            // sizes match the layouts (W k x n, x k x rows, out n x rows);
            // C and D are the same buffer with the same layout, which
            // cuBLASLt allows in place; the workspace holds WORKSPACE_BYTES,
            // the most the heuristic was allowed; alpha and beta are host
            // f32 (the default pointer mode), read at the call.
            unsafe {
                result::matmul(
                    self.handle,
                    plan.desc,
                    (&raw const one).cast(),
                    core::ptr::from_ref(beta).cast(),
                    w as *const c_void,
                    plan.w.0,
                    part as *const c_void,
                    x_l.0,
                    out as *const c_void,
                    out_l.0,
                    out as *mut c_void,
                    out_l.0,
                    &raw const plan.algo,
                    ws as *mut c_void,
                    WORKSPACE_BYTES,
                    stream,
                )
            }
            .map_err(lt("matmul"))?;
        }
        Ok(())
    }
}
