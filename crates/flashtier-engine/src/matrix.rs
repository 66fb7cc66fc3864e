//! Weight matrices in their stored form, on the host: BF16/F16/F32 bytes,
//! or FP8 E4M3 codes with F32 block scales (DeepSeek-V3's
//! `weight_scale_inv`). Nothing is widened to f32 at load: the resident
//! weights take the checkpoint's bytes (half of f32 for BF16, a quarter for
//! FP8), and each device computes from them ([`MatRef`] on the CPU; the CUDA
//! device copies the same bytes to HBM).
//!
//! Invariant: a [`Matrix`] or [`MatRef`] is only built through constructors
//! that check its byte length against `rows x cols` (and the scale grid), so
//! kernels never see a matrix shorter than its shape.

use flashtier_format::Dtype;
use flashtier_format::fp8::e4m3_to_f32;
use flashtier_format::widen::to_f32;
use flashtier_io::AlignedBuf;

use crate::error::EngineError;

/// Rows and columns of the scale grid of a `rows x cols` FP8 matrix in
/// `block` blocks (partial blocks at the edges count whole).
pub fn f8_scale_grid(rows: usize, cols: usize, [br, bc]: [usize; 2]) -> [usize; 2] {
    [rows.div_ceil(br.max(1)), cols.div_ceil(bc.max(1))]
}

/// Bytes of the float32 block scales of an expert's gate, up and down
/// (`[I, H]`, `[I, H]`, `[H, I]`) in `block` blocks.
pub fn fp8_scale_bytes(hidden: usize, inter: usize, block: [usize; 2]) -> [usize; 3] {
    let bytes = |[r, c]: [usize; 2]| r * c * 4;
    let gu = bytes(f8_scale_grid(inter, hidden, block));
    [gu, gu, bytes(f8_scale_grid(hidden, inter, block))]
}

/// The scale of block (`row_block`, `col_block`) in a little-endian f32
/// grid `per_row` blocks wide; NaN past its end (sizes are checked when a
/// matrix is built, so valid parts never reach it).
pub fn block_scale(scales: &[u8], row_block: usize, col_block: usize, per_row: usize) -> f32 {
    let at = (row_block * per_row + col_block) * 4;
    scales
        .get(at..at + 4)
        .map_or(f32::NAN, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// A row-major weight matrix, borrowed, in its stored element type.
#[derive(Clone, Copy, Debug)]
pub enum MatRef<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// Little-endian BF16, F16 or F32 bytes straight from a checkpoint or a
    /// store record.
    Raw(&'a [u8], Dtype),
    /// FP8 E4M3 codes with a float32 scale per `block[0] x block[1]` block,
    /// row-major over the blocks: element `(r, c)` is
    /// `e4m3(codes[r][c]) * scale[r / block[0]][c / block[1]]`.
    F8Block {
        /// One code per element, row-major.
        codes: &'a [u8],
        /// `ceil(rows / block[0]) x ceil(cols / block[1])` f32, little-endian.
        scales: &'a [u8],
        /// Block rows and columns.
        block: [usize; 2],
        /// Columns of the matrix.
        cols: usize,
    },
}

impl<'a> MatRef<'a> {
    /// A `rows x cols` matrix of `dtype` (BF16, F16 or F32) over `bytes`.
    pub fn raw(
        bytes: &'a [u8],
        dtype: Dtype,
        rows: usize,
        cols: usize,
    ) -> Result<Self, EngineError> {
        if !matches!(dtype, Dtype::Bf16 | Dtype::F16 | Dtype::F32) {
            return Err(EngineError::Layout {
                what: format!("a {rows}x{cols} matrix"),
                reason: format!("dtype {} is not BF16, F16 or F32", dtype.name()),
            });
        }
        let want = rows * cols * dtype.size_bytes() as usize;
        if bytes.len() != want {
            return Err(EngineError::Layout {
                what: format!("a {rows}x{cols} {} matrix", dtype.name()),
                reason: format!("needs {want} bytes, got {}", bytes.len()),
            });
        }
        Ok(MatRef::Raw(bytes, dtype))
    }

    /// A block-scaled FP8 matrix of `rows x cols`, or why the parts do not
    /// fit together.
    pub fn f8_block(
        codes: &'a [u8],
        scales: &'a [u8],
        rows: usize,
        cols: usize,
        block: [usize; 2],
    ) -> Result<Self, EngineError> {
        let [br, bc] = block;
        let what = || format!("an FP8 {rows}x{cols} matrix in {br}x{bc} blocks");
        if br == 0 || bc == 0 {
            return Err(EngineError::Layout {
                what: what(),
                reason: "a block side is zero".into(),
            });
        }
        let [sr, sc] = f8_scale_grid(rows, cols, block);
        let want = sr * sc * 4;
        if codes.len() != rows * cols || scales.len() != want {
            return Err(EngineError::Layout {
                what: what(),
                reason: format!(
                    "needs {} code bytes and {want} scale bytes, got {} and {}",
                    rows * cols,
                    codes.len(),
                    scales.len()
                ),
            });
        }
        Ok(MatRef::F8Block {
            codes,
            scales,
            block,
            cols,
        })
    }
}

impl MatRef<'_> {
    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            MatRef::F32(w) => w.len(),
            MatRef::Raw(b, dt) => b.len() / dt.size_bytes().max(1) as usize,
            MatRef::F8Block { codes, .. } => codes.len(),
        }
    }

    /// Does it hold no element?
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A weight matrix as the checkpoint stores it, owned.
#[derive(Debug)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: MatrixData,
}

/// The bytes of a [`Matrix`].
#[derive(Debug)]
pub enum MatrixData {
    /// BF16, F16 or F32 elements, little-endian, row-major.
    Raw {
        /// `rows x cols x dtype width` bytes.
        bytes: AlignedBuf,
        /// Element type.
        dtype: Dtype,
    },
    /// FP8 E4M3 codes with F32 block scales.
    F8 {
        /// `rows x cols` codes.
        codes: AlignedBuf,
        /// The scale grid, little-endian f32.
        scales: AlignedBuf,
        /// Block rows and columns.
        block: [usize; 2],
    },
}

impl Matrix {
    /// A `rows x cols` matrix over `data`, checked as [`MatRef`] checks.
    pub fn new(rows: usize, cols: usize, data: MatrixData) -> Result<Self, EngineError> {
        let m = Self { rows, cols, data };
        m.checked_view()?;
        Ok(m)
    }

    /// An f32 matrix of `rows x cols` from row-major `values`.
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Result<Self, EngineError> {
        let mut bytes = AlignedBuf::zeroed(values.len() * 4);
        for (dst, v) in bytes.chunks_exact_mut(4).zip(values) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        Self::new(
            rows,
            cols,
            MatrixData::Raw {
                bytes,
                dtype: Dtype::F32,
            },
        )
    }

    fn checked_view(&self) -> Result<MatRef<'_>, EngineError> {
        match &self.data {
            MatrixData::Raw { bytes, dtype } => MatRef::raw(bytes, *dtype, self.rows, self.cols),
            MatrixData::F8 {
                codes,
                scales,
                block,
            } => MatRef::f8_block(codes, scales, self.rows, self.cols, *block),
        }
    }

    /// The borrowed view for kernels.
    pub fn mat(&self) -> MatRef<'_> {
        match &self.data {
            MatrixData::Raw { bytes, dtype } => MatRef::Raw(bytes, *dtype),
            MatrixData::F8 {
                codes,
                scales,
                block,
            } => MatRef::F8Block {
                codes,
                scales,
                block: *block,
                cols: self.cols,
            },
        }
    }

    /// The stored bytes.
    pub fn data(&self) -> &MatrixData {
        &self.data
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `r` widened to f32 (an embedding lookup); `None` past the end.
    pub fn row_f32(&self, r: usize) -> Option<Vec<f32>> {
        if r >= self.rows {
            return None;
        }
        let c = self.cols;
        match &self.data {
            MatrixData::Raw { bytes, dtype } => {
                let w = dtype.size_bytes() as usize;
                bytes
                    .get(r * c * w..(r + 1) * c * w)
                    .map(|b| to_f32(b, *dtype))
            }
            MatrixData::F8 {
                codes,
                scales,
                block: [br, bc],
            } => {
                let per_row = c.div_ceil(*bc);
                let row = codes.get(r * c..(r + 1) * c)?;
                Some(
                    row.iter()
                        .enumerate()
                        .map(|(j, &code)| {
                            e4m3_to_f32(code) * block_scale(scales, r / br, j / bc, per_row)
                        })
                        .collect(),
                )
            }
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match &self.data {
            MatrixData::Raw { bytes, .. } => bytes.len(),
            MatrixData::F8 { codes, scales, .. } => codes.len() + scales.len(),
        }
    }
}
