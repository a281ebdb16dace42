/*!
NVIDIA GPUs for smoe, found and driven at run time.

The driver (`libcuda.so.1`) and NVRTC (`libnvrtc.so.13` or `.12`) are loaded dynamically when
first asked for, so one `smoe` binary runs on machines with and without them: [`probe`] says
in one line why no GPU is usable instead of failing at start or at link time. Kernels are CUDA
C compiled by NVRTC for the device's own architecture at first use; no CUDA toolkit is needed
where smoe runs.

[`CudaBackend`] is the engine's backend on one GPU; [`Gpu`] is the bare device with the Q8_0
bandwidth probe kernel (`examples/matvec_bandwidth.rs`).
*/
#![deny(missing_docs)]

pub mod backend;
mod buf;
mod copies;
mod experts;
mod graph;
mod kept;
mod launch;
mod misses;
mod pinned;
mod staging;

pub use backend::{CudaBackend, CudaOptions};
pub use experts::ExpertStats;
pub use misses::MissMode;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// A GPU the driver reports.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// Its index (`cuda:N`).
    pub ordinal: usize,
    /// Marketing name.
    pub name: String,
    /// Compute capability (major, minor): 9.0 for Hopper.
    pub compute_capability: (i32, i32),
    /// Memory in bytes.
    pub total_bytes: usize,
    /// Memory free now, in bytes.
    pub free_bytes: usize,
}

impl DeviceInfo {
    /// `cuda:N`.
    pub fn short(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "cuda:{} {} (compute {}.{}, {:.1} GiB, {:.1} GiB free)",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            gib(self.total_bytes),
            gib(self.free_bytes)
        )
    }
}

/// Whether the NVIDIA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its candidate names (dlopen); nothing from it
    // is called here.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC (the run-time CUDA compiler) can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: as for `driver_present`: a dlopen by name, no call into the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The library's own GPU tests' context on GPU 0, or `None` (said on stderr) where no GPU is
/// usable: they pass without running there, as CI has none.
#[cfg(test)]
pub(crate) fn test_context() -> Option<Arc<CudaContext>> {
    match probe().and_then(|_| CudaContext::new(0).map_err(|e| e.to_string())) {
        Ok(ctx) => Some(ctx),
        Err(why) => {
            eprintln!("skipped: no usable GPU ({why})");
            None
        }
    }
}

/// The usable GPUs, or one line saying why there are none (no driver library, the driver
/// failing to start, no device). Never panics: the driver is not touched unless it loads.
pub fn probe() -> Result<Vec<DeviceInfo>, String> {
    if !driver_present() {
        return Err("no NVIDIA driver (libcuda.so.1 not found)".into());
    }
    let count = CudaContext::device_count().map_err(|e| format!("the NVIDIA driver did not start: {e}"))?;
    if count <= 0 {
        return Err("the NVIDIA driver reports no GPU".into());
    }
    (0..count as usize)
        .map(|ordinal| {
            let ctx = CudaContext::new(ordinal).map_err(|e| format!("cuda:{ordinal}: {e}"))?;
            let err = |e: cudarc::driver::DriverError| format!("cuda:{ordinal}: {e}");
            let (free_bytes, total_bytes) = ctx.mem_get_info().map_err(err)?;
            Ok(DeviceInfo {
                ordinal,
                name: ctx.name().map_err(err)?,
                compute_capability: ctx.compute_capability().map_err(err)?,
                total_bytes,
                free_bytes,
            })
        })
        .collect()
}

/// The kernels' CUDA C source.
const KERNELS: &str = concat!(
    include_str!("kernels.cu"),
    include_str!("fused.cu"),
    include_str!("attention.cu"),
    include_str!("mmq.cu"),
    include_str!("mvqm.cu"),
    include_str!("kept.cu"),
    include_str!("kept_tiles.cu"),
    include_str!("sparse.cu"),
    include_str!("delta.cu"),
    include_str!("compressed.cu")
);

/// The kernels compiled for compute capability `cc`, from this process's earlier compiles, the
/// per-user kernel cache (`$XDG_CACHE_HOME/smoe` or `~/.cache/smoe`, one PTX file per source and
/// architecture) or NVRTC, which then fills both. Needs NVRTC only on a miss and no GPU at all,
/// so it also checks that the kernels compile where there is none.
///
/// One compile at a time per process: backends opened together with an empty cache (a
/// server's models, the GPU tests) each compiled the whole source at once, every one on a core
/// of its own for about a minute (a fresh H100 host's test suite ran past 60 s, and past 120 s
/// beside a vault synthesis, where it takes 12 s with the cache filled). Now the first
/// compiles and the others wait for its PTX.
pub fn compile_kernels(cc: (i32, i32)) -> Result<cudarc::nvrtc::Ptx, String> {
    let mut compiled = COMPILED.lock().unwrap_or_else(|e| e.into_inner());
    let arch = format!("sm_{}{}", cc.0, cc.1);
    if let Some((_, text)) = compiled.iter().find(|(a, _)| *a == arch) {
        return Ok(cudarc::nvrtc::Ptx::from_src(text.clone()));
    }
    let cached = cache_dir().map(|d| d.join(format!("kernels-{:016x}-{arch}.ptx", fnv1a(KERNELS.as_bytes()))));
    let text = match cached.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        Some(text) => text,
        None => {
            let text = compile_ptx(cc)?.to_src();
            if let Some(p) = cached {
                // A cache that cannot be written only costs the next start a compile.
                let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                if p.parent().is_some_and(|d| std::fs::create_dir_all(d).is_ok()) && std::fs::write(&tmp, &text).is_ok() {
                    let _ = std::fs::rename(&tmp, &p);
                }
            }
            text
        }
    };
    compiled.push((arch, text.clone()));
    Ok(cudarc::nvrtc::Ptx::from_src(text))
}

/// [`compile_kernels`]'s PTX by architecture (`sm_90`), one entry each time it read the disk
/// cache or ran NVRTC.
static COMPILED: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// How many times [`compile_kernels`] loaded the kernels for `cc` (read the disk cache or ran
/// NVRTC) in this process: at most once, however many backends open at once.
pub fn kernel_loads(cc: (i32, i32)) -> usize {
    let arch = format!("sm_{}{}", cc.0, cc.1);
    COMPILED.lock().unwrap_or_else(|e| e.into_inner()).iter().filter(|(a, _)| *a == arch).count()
}

/// The kernels compiled by NVRTC for compute capability `cc`, without the cache. Needs no GPU.
pub fn compile_ptx(cc: (i32, i32)) -> Result<cudarc::nvrtc::Ptx, String> {
    if !nvrtc_present() {
        return Err("NVRTC not found (libnvrtc.so.13 or .12; it ships with the CUDA runtime)".into());
    }
    let arch = format!("sm_{}{}", cc.0, cc.1);
    // NVRTC wants a 'static architecture name; one per architecture compiled is leaked.
    let arch_static: &'static str = Box::leak(arch.clone().into_boxed_str());
    let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch_static), ..Default::default() };
    cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts).map_err(|e| format!("compiling the kernels for {arch}: {e}"))
}

fn cache_dir() -> Option<std::path::PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
    base.or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache"))).map(|d| d.join("smoe"))
}

/// FNV-1a: names the cached PTX after the source it was compiled from.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// Host → device copy bandwidth in bytes per second of `bytes` from pageable memory and from
/// page-locked memory (best of five copies each), on GPU `ordinal`.
pub fn copy_bandwidth(ordinal: usize, bytes: usize) -> Result<(f64, f64), String> {
    let err = |e: cudarc::driver::DriverError| e.to_string();
    let ctx = CudaContext::new(ordinal).map_err(err)?;
    let stream = ctx.new_stream().map_err(err)?;
    let mut dev = stream.alloc_zeros::<u8>(bytes).map_err(err)?;
    let host = vec![1u8; bytes];
    // SAFETY: a page-locked buffer of `bytes` bytes, filled before it is read.
    let mut pinned = unsafe { ctx.alloc_pinned::<u8>(bytes) }.map_err(err)?;
    pinned.as_mut_slice().map_err(err)?.fill(1);
    let mut best = |src: &dyn Fn(&mut cudarc::driver::CudaSlice<u8>) -> Result<(), cudarc::driver::DriverError>| {
        let mut top = 0f64;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            src(&mut dev).map_err(err)?;
            stream.synchronize().map_err(err)?;
            top = top.max(bytes as f64 / t.elapsed().as_secs_f64());
        }
        Ok::<f64, String>(top)
    };
    let pageable = best(&|d| stream.memcpy_htod(&host, d))?;
    let locked = best(&|d| stream.memcpy_htod(&pinned, d))?;
    Ok((pageable, locked))
}

/// One GPU with its stream and the bandwidth probe kernel.
pub struct Gpu {
    /// What the driver says of it.
    pub info: DeviceInfo,
    stream: Arc<CudaStream>,
    matvec_q8_0: CudaFunction,
}

/// A Q8_0 matrix in VRAM (GGUF's block layout, as the vault stores it).
pub struct GpuQ8Matrix {
    data: cudarc::driver::CudaSlice<u8>,
    /// Rows.
    pub rows: usize,
    /// Columns (a multiple of 32).
    pub cols: usize,
}

impl Gpu {
    /// Opens GPU `ordinal` and compiles the kernels for its architecture.
    pub fn open(ordinal: usize) -> Result<Gpu, String> {
        let info = probe()?.into_iter().nth(ordinal).ok_or_else(|| format!("no GPU cuda:{ordinal}"))?;
        if !nvrtc_present() {
            return Err("NVRTC not found (libnvrtc.so.13 or .12; it ships with the CUDA runtime)".into());
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("cuda:{ordinal}: {e}"))?;
        let ptx = compile_kernels(info.compute_capability)?;
        let module = ctx.load_module(ptx).map_err(|e| format!("loading the kernels: {e}"))?;
        let load = |name: &str| module.load_function(name).map_err(|e| format!("kernel {name}: {e}"));
        Ok(Gpu { stream: ctx.default_stream(), matvec_q8_0: load("matvec_q8_0")?, info })
    }

    /// Copies a Q8_0 matrix (`rows` rows of `cols`, 34 bytes per 32 values) to VRAM.
    pub fn upload_q8_0(&self, bytes: &[u8], rows: usize, cols: usize) -> Result<GpuQ8Matrix, String> {
        if !cols.is_multiple_of(32) || bytes.len() != rows * cols / 32 * 34 {
            return Err(format!("Q8_0 {rows}x{cols} needs {} bytes and whole blocks, got {}", rows * cols / 32 * 34, bytes.len()));
        }
        let data = self.stream.clone_htod(bytes).map_err(|e| format!("upload: {e}"))?;
        Ok(GpuQ8Matrix { data, rows, cols })
    }

    /// `w · x` for one token, `reps` times (the result of the last), with the seconds the
    /// launches took after the inputs were on the GPU: a decode mat-vec and its time.
    pub fn matvec_q8_0(&self, w: &GpuQ8Matrix, x: &[f32], reps: usize) -> Result<(Vec<f32>, f64), String> {
        assert_eq!(x.len(), w.cols, "matvec_q8_0: x has {} values for {} columns", x.len(), w.cols);
        let err = |e: cudarc::driver::DriverError| format!("matvec_q8_0: {e}");
        let xd = self.stream.clone_htod(x).map_err(err)?;
        let mut out = self.stream.alloc_zeros::<f32>(w.rows).map_err(err)?;
        let (rows, cols) = (w.rows as i32, w.cols as i32);
        // Eight warps (rows) per block.
        let cfg = LaunchConfig { grid_dim: (w.rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.stream.synchronize().map_err(err)?;
        let t = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            let mut launch = self.stream.launch_builder(&self.matvec_q8_0);
            launch.arg(&w.data).arg(&xd).arg(&mut out).arg(&rows).arg(&cols);
            // SAFETY: arguments match the kernel (bytes of rows*cols/32 blocks of 34, cols
            // floats, rows floats, int, int); a warp works only on its row when row < rows,
            // and reads blocks b < cols/32 of it.
            unsafe { launch.launch(cfg) }.map_err(err)?;
        }
        self.stream.synchronize().map_err(err)?;
        let secs = t.elapsed().as_secs_f64();
        Ok((self.stream.clone_dtoh(&out).map_err(err)?, secs))
    }
}
