//! The checks a step's inputs pass before any launch: a begun step, the
//! tile's sequence count, the lengths of q, the pools and the output, and
//! strides the kernel's 16-byte loads can use. Every address the kernels
//! form lies inside its buffer once these pass, which is what the launches'
//! `SAFETY` comments rest on.

use cudarc::driver::CudaSlice;
use flashtier_format::kv::KvStrides;

use super::{DecodeAttention, TileTable};
use crate::error::CudaError;

impl DecodeAttention {
    pub(super) fn check_out(&self, out: &CudaSlice<u16>) -> Result<usize, CudaError> {
        let d = &self.dims;
        let num_seqs = self.step_seqs.ok_or_else(|| {
            CudaError::invalid("finalize", "no begin_step since the last finalize")
        })?;
        let need = num_seqs * d.num_q_heads * d.head_dim;
        if out.len() < need {
            return Err(CudaError::invalid(
                "finalize",
                format!("output holds {} elements, needs {need}", out.len()),
            ));
        }
        Ok(num_seqs)
    }

    pub(super) fn check_step(
        &self,
        q: &CudaSlice<u16>,
        k_pool: &CudaSlice<u16>,
        v_pool: &CudaSlice<u16>,
        layout: KvStrides,
        tile: &TileTable,
    ) -> Result<usize, CudaError> {
        let d = &self.dims;
        let bad = |why: String| Err(CudaError::invalid("step_tile", why));
        let Some(num_seqs) = self.step_seqs else {
            return bad("step_tile before begin_step".into());
        };
        if tile.num_seqs != num_seqs {
            return bad(format!(
                "tile has {} sequences, the step {num_seqs}",
                tile.num_seqs
            ));
        }
        let q_need = num_seqs * d.num_q_heads * d.head_dim;
        if q.len() < q_need {
            return bad(format!("q holds {} elements, needs {q_need}", q.len()));
        }
        let strides = [layout.block, layout.token, layout.kv_head];
        if strides.iter().any(|s| s % 8 != 0 || *s > i64::MAX as usize) {
            return bad(format!(
                "strides {strides:?} are not multiples of 8 elements"
            ));
        }
        if tile.max_tokens > 0 {
            let need = layout.block_end(d, tile.max_block).unwrap_or(usize::MAX);
            for (name, pool) in [("k_pool", k_pool), ("v_pool", v_pool)] {
                if pool.len() < need {
                    return bad(format!(
                        "{name} holds {} elements; block {} needs {need}",
                        pool.len(),
                        tile.max_block
                    ));
                }
            }
        }
        Ok(num_seqs)
    }
}
