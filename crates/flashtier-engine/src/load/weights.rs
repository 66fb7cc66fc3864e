//! Loading resident weights: tensors read from the checkpoint by name,
//! checked against the shape the config implies, and handed to a device.
//! Matrices stay in their stored form ([`Matrix`]: BF16/F16/F32 bytes, or
//! FP8 E4M3 codes with their `{name}_scale_inv` F32 block scales); vectors
//! (norms, biases) are widened to f32.

use flashtier_format::Dtype;

use crate::checkpoint::Checkpoint;
use crate::device::Device;
use crate::error::EngineError;
use crate::matrix::{Matrix, MatrixData, f8_scale_grid};

/// Reads tensors of one checkpoint onto one device.
pub struct Loader<'a, D: Device> {
    /// The checkpoint.
    pub ckpt: &'a Checkpoint,
    /// The device the weights land on.
    pub dev: &'a D,
    /// The FP8 block size of `quantization_config`, if any.
    pub fp8_block: Option<[usize; 2]>,
}

impl<D: Device> Loader<'_, D> {
    /// Matrix `name` of shape `[rows, cols]`, in its stored form, on the device.
    pub fn matrix(&self, name: &str, shape: [usize; 2]) -> Result<D::Mat, EngineError> {
        self.dev.matrix(self.host_matrix(name, shape)?)
    }

    /// Matrix `name` widened to f32 on the device (tiny matrices computed
    /// as f32 dot products, such as Qwen2-MoE's shared-expert gate).
    pub fn matrix_f32(&self, name: &str, shape: [usize; 2]) -> Result<D::Mat, EngineError> {
        let values = self.ckpt.load_f32(name, &shape)?;
        self.dev
            .matrix(Matrix::from_f32(shape[0], shape[1], &values)?)
    }

    /// Vector (or tiny tensor) `name` widened to f32 on the device.
    pub fn vector(&self, name: &str, shape: &[usize]) -> Result<D::Vector, EngineError> {
        self.dev.vector(self.ckpt.load_f32(name, shape)?)
    }

    /// Matrix `name` on the host, in its stored form.
    pub fn host_matrix(&self, name: &str, [rows, cols]: [usize; 2]) -> Result<Matrix, EngineError> {
        let dtype = self.ckpt.expect_shape(name, &[rows, cols])?;
        let data = match dtype {
            Dtype::F8E4M3 => self.f8_data(name, rows, cols)?,
            Dtype::Bf16 | Dtype::F16 | Dtype::F32 => MatrixData::Raw {
                bytes: self
                    .ckpt
                    .read_range(name, 0, rows * cols * dtype.size_bytes() as usize)?,
                dtype,
            },
            _ => {
                return Err(EngineError::TensorDtype {
                    name: name.to_string(),
                    dtype: dtype.name().to_string(),
                });
            }
        };
        Matrix::new(rows, cols, data)
    }

    fn f8_data(&self, name: &str, rows: usize, cols: usize) -> Result<MatrixData, EngineError> {
        let Some(block) = self.fp8_block else {
            return Err(EngineError::config(
                "quantization_config",
                format!(
                    "tensor `{name}` is F8_E4M3: FP8 needs quantization_config.weight_block_size"
                ),
            ));
        };
        let scale_name = format!("{name}_scale_inv");
        let grid = f8_scale_grid(rows, cols, block);
        let sdt = self.ckpt.expect_shape(&scale_name, &grid)?;
        if sdt != Dtype::F32 {
            return Err(EngineError::TensorDtype {
                name: scale_name,
                dtype: format!("{} (FP8 block scales must be F32)", sdt.name()),
            });
        }
        Ok(MatrixData::F8 {
            codes: self.ckpt.read_range(name, 0, rows * cols)?,
            scales: self
                .ckpt
                .read_range(&scale_name, 0, grid[0] * grid[1] * 4)?,
            block,
        })
    }
}
