//! flashtier's CUDA path (pinned arena, disk to pinned to HBM landing, NVRTC
//! kernels), loaded dynamically through cudarc so that the crate builds,
//! lints and tests on machines with no GPU.
