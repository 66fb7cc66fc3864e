//! Kernel launches with programmatic dependent launch (PDL): the merge after
//! the split kernel, and the split kernel after the previous step's merge.

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, sys};

use super::DecodeAttention;
use crate::error::CudaError;

impl DecodeAttention {
    /// Launch `func` with `params` (pointers to live locals in the kernel's
    /// parameter order and types). With `pdl` the launch allows programmatic
    /// stream serialisation, so the grid's CTAs become resident before the
    /// previous kernel on the stream ends (no launch gap); every kernel
    /// launched this way starts with `griddepcontrol.wait`, so it touches no
    /// memory before that kernel has completed. Falls back to plain launches
    /// where the driver refuses the attribute.
    ///
    /// # Safety
    /// `params` must match `func`'s parameters, and every buffer the kernel
    /// addresses through them must be live and large enough.
    pub(super) unsafe fn launch_pdl(
        &mut self,
        stream: &CudaStream,
        func: &CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
        pdl: bool,
        what: &'static str,
    ) -> Result<(), CudaError> {
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        if pdl && self.pdl {
            // SAFETY: an all-zero launch attribute is a valid C value; the
            // id and the one union field PDL reads are set below.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: cfg.grid_dim.0,
                gridDimY: cfg.grid_dim.1,
                gridDimZ: cfg.grid_dim.2,
                blockDimX: cfg.block_dim.0,
                blockDimY: cfg.block_dim.1,
                blockDimZ: cfg.block_dim.2,
                sharedMemBytes: cfg.shared_mem_bytes,
                hStream: stream.cu_stream(),
                attrs: &raw mut attr,
                numAttrs: 1,
            };
            // SAFETY: the caller guarantees `params` match the kernel; the
            // driver copies the values before returning.
            let r = unsafe {
                sys::cuLaunchKernelEx(
                    &raw const config,
                    func.cu_function(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            if r == sys::CUresult::CUDA_SUCCESS {
                return Ok(());
            }
            tracing::warn!(
                ?r,
                "programmatic dependent launch refused; plain launches from now on"
            );
            self.pdl = false;
        }
        // SAFETY: as above, a plain launch with the same parameters.
        unsafe {
            cudarc::driver::result::launch_kernel(
                func.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                stream.cu_stream(),
                params,
            )
        }
        .map_err(CudaError::driver(what))
    }

    /// Launch `attn_merge` (PDL after the split grid).
    pub(super) fn launch_merge(
        &mut self,
        stream: &CudaStream,
        cfg: LaunchConfig,
        ptrs: [u64; 6],
        splits: i32,
        fresh: i32,
        out_ptr: u64,
    ) -> Result<(), CudaError> {
        let [mut m, mut l, mut o, mut pm, mut pl, mut po] = ptrs;
        let (mut splits, mut fresh, mut out_ptr) = (splits, fresh, out_ptr);
        let mut params: [*mut std::ffi::c_void; 9] = [
            (&raw mut m).cast(),
            (&raw mut l).cast(),
            (&raw mut o).cast(),
            (&raw mut pm).cast(),
            (&raw mut pl).cast(),
            (&raw mut po).cast(),
            (&raw mut splits).cast(),
            (&raw mut fresh).cast(),
            (&raw mut out_ptr).cast(),
        ];
        let f = self.f_merge.clone();
        // SAFETY: `params` point at live locals in `attn_merge`'s parameter
        // order and types (six device pointers, two ints, one pointer); the
        // buffers behind the pointers are this object's state and partials
        // and the caller's checked output.
        unsafe { self.launch_pdl(stream, &f, cfg, &mut params, true, "launch attn_merge") }
    }
}
