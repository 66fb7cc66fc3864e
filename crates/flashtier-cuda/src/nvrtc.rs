//! Run-time compilation of the kernel sources with NVRTC, straight to machine
//! code (CUBIN) for the device's own architecture: `sm_90` on Hopper. No PTX
//! of an older target is left for the driver to JIT, so Hopper code paths
//! (and their register allocation) are what runs.

use std::ffi::{CStr, CString};
use std::sync::Arc;

use cudarc::driver::CudaModule;
use cudarc::nvrtc::sys::{self as nv, nvrtcProgram};

use crate::context::{Gpu, nvrtc_present};
use crate::error::CudaError;

/// Source of the dequant and fill kernels (after the shared definitions).
pub const UTIL_SRC: &str = concat!(
    include_str!("kernels/common.cuh"),
    "\n",
    include_str!("kernels/util.cu")
);

/// A compiled module: its machine code and the compiler's log (register and
/// spill report from ptxas).
#[derive(Clone, Debug)]
pub struct Cubin {
    /// The CUBIN image.
    pub image: Vec<u8>,
    /// NVRTC's log, including `ptxas -v` output.
    pub log: String,
}

/// Compile `src` for `arch` (`sm_90`) with `-D` `defines`. Needs only NVRTC,
/// not a driver or a GPU.
pub fn compile_cubin(
    module: &str,
    src: &str,
    arch: &str,
    defines: &[(&str, String)],
) -> Result<Cubin, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let compile_err = |log: String| CudaError::Compile {
        module: module.to_string(),
        arch: arch.to_string(),
        log,
    };
    let c_src = CString::new(src).map_err(|_| compile_err("source holds a NUL byte".into()))?;
    let c_name =
        CString::new(format!("{module}.cu")).map_err(|_| compile_err("bad module name".into()))?;
    let prog = cudarc::nvrtc::result::create_program(&c_src, Some(&c_name))
        .map_err(|e| compile_err(format!("create program: {e:?}")))?;
    let prog = ProgramGuard(prog);
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--ptxas-options=-v".to_string(),
        "--fmad=true".to_string(),
    ];
    opts.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    // SAFETY: `prog` is a live program created above; options are C strings.
    let compiled = unsafe { cudarc::nvrtc::result::compile_program(prog.0, &opts) };
    let log = program_log(prog.0);
    if let Err(e) = compiled {
        return Err(compile_err(format!("{e:?}\n{log}")));
    }
    let mut size = 0usize;
    // SAFETY: a successfully compiled program; `size` is a valid out-pointer.
    unsafe { nv::nvrtcGetCUBINSize(prog.0, &raw mut size) }
        .result()
        .map_err(|e| compile_err(format!("CUBIN size: {e:?}")))?;
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds exactly the `size` bytes NVRTC reported.
    unsafe { nv::nvrtcGetCUBIN(prog.0, image.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| compile_err(format!("CUBIN: {e:?}")))?;
    Ok(Cubin { image, log })
}

/// Images compiled in this process, by (module, architecture, defines):
/// opening a second device context of the same kind loads, not compiles.
static COMPILED: std::sync::Mutex<Vec<(String, Cubin)>> = std::sync::Mutex::new(Vec::new());

fn compile_cached(
    module: &str,
    src: &str,
    arch: &str,
    defines: &[(&str, String)],
) -> Result<Cubin, CudaError> {
    let key = format!("{module}|{arch}|{defines:?}|{}", src.len());
    let cached = COMPILED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, c)| c.clone());
    if let Some(c) = cached {
        return Ok(c);
    }
    let c = compile_cubin(module, src, arch, defines)?;
    COMPILED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((key, c.clone()));
    Ok(c)
}

/// Compile `src` for the device of `gpu` (once per process) and load it. With
/// [`crate::settings::DUMP_CUBIN`] set to a folder the machine code is also
/// written there (for `cuobjdump --dump-sass`).
pub fn load_module(
    gpu: &Gpu,
    module: &str,
    src: &str,
    defines: &[(&str, String)],
) -> Result<(Arc<CudaModule>, Cubin), CudaError> {
    let arch = gpu.info().arch();
    let cubin = compile_cached(module, src, &arch, defines)?;
    if let Some(dir) = crate::settings::dump_cubin(&flashtier_io::settings::Env::process()) {
        let path = dir.join(format!("{module}.{arch}.cubin"));
        if let Err(e) = std::fs::write(&path, &cubin.image) {
            tracing::warn!(path = %path.display(), "could not dump cubin: {e}");
        }
    }
    let loaded = gpu
        .context()
        .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.image.clone()))
        .map_err(CudaError::driver(format!("load module {module} ({arch})")))?;
    tracing::debug!(module, arch, log = %cubin.log, "compiled kernel module");
    Ok((loaded, cubin))
}

struct ProgramGuard(nvrtcProgram);

impl Drop for ProgramGuard {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed once.
        let _ = unsafe { cudarc::nvrtc::result::destroy_program(self.0) };
    }
}

fn program_log(prog: nvrtcProgram) -> String {
    // SAFETY: `prog` is a live program; the log is NUL-terminated by NVRTC.
    match unsafe { cudarc::nvrtc::result::get_program_log(prog) } {
        Ok(raw) => {
            let bytes: Vec<u8> = raw.iter().map(|&c| c.to_le_bytes()[0]).collect();
            CStr::from_bytes_until_nul(&bytes)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
        }
        Err(e) => format!("(no log: {e:?})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decode engine's kernels compile for Hopper without spills.
    #[test]
    fn decode_kernels_compile_for_sm90() {
        if !nvrtc_present() {
            flashtier_io::skip::notice(
                "decode_kernels_compile_for_sm90",
                "libnvrtc not found (no CUDA runtime compiler on this machine)",
            );
            return;
        }
        let c = compile_cubin("decode", crate::ops::DECODE_SRC, "sm_90", &[])
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!c.image.is_empty());
        eprintln!("decode:\n{}", c.log);
        // The util kernels share common.cuh with these.
        let u = compile_cubin("util", UTIL_SRC, "sm_90", &[]).unwrap_or_else(|e| panic!("{e}"));
        assert!(!u.image.is_empty());
        assert!(
            !c.log.contains("bytes spill stores") || c.log.contains(" 0 bytes spill stores"),
            "{}",
            c.log
        );
        // Every kernel the launch table names is in the machine code (the
        // table and the sources agree).
        for &(name, _) in crate::ops::KERNELS {
            let sym = format!("{name}\0");
            assert!(
                c.image.windows(sym.len()).any(|w| w == sym.as_bytes()),
                "kernel {name} is not in the decode module"
            );
        }
        // The tuning knobs' far ends compile too.
        let t = crate::ops::Tuning {
            stream_weights: false,
            gemv_loads: crate::ops::MAX_GEMV_LOADS,
            attn_ahead: crate::ops::MAX_ATTN_AHEAD,
            down_rows: crate::ops::MAX_DOWN_ROWS,
            prompt_attn_pipe: true,
            ..crate::ops::Tuning::default()
        };
        let defines = t.defines();
        let far = compile_cubin("decode", crate::ops::DECODE_SRC, "sm_90", &defines)
            .unwrap_or_else(|e| panic!("{t:?}: {e}"));
        // The pipelined attention's second set of fragments fits the
        // registers of heads of 128 without spilling.
        let entry = far
            .log
            .split("Compiling entry function")
            .find(|part| part.starts_with(" 'attn_prompt_tc_128'"))
            .unwrap_or_else(|| panic!("no attn_prompt_tc_128 in the log:\n{}", far.log));
        assert!(entry.contains(" 0 bytes spill stores"), "{entry}");
    }
}
