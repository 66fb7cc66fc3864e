//! Launch of the split-partial merge with programmatic dependent launch.

use cudarc::driver::{CudaStream, LaunchConfig, sys};

use super::DecodeAttention;
use crate::error::CudaError;

impl DecodeAttention {
    /// Launch `attn_merge` with programmatic dependent launch, so its CTAs are
    /// resident before the split grid ends (no launch gap); falls back to a
    /// plain launch where the driver refuses the attribute.
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
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("bind context"))?;
        if self.pdl {
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
            // SAFETY: `params` point at live locals in `attn_merge`'s parameter
            // order and types (six device pointers, two ints, one pointer); the
            // buffers behind the pointers are this object's state and partials
            // and the caller's checked output; the driver copies the values
            // before returning.
            let r = unsafe {
                sys::cuLaunchKernelEx(
                    &raw const config,
                    self.f_merge.cu_function(),
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
                self.f_merge.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(CudaError::driver("launch attn_merge"))
    }
}
