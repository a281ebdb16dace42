/*!
NVIDIA GPUs for smoe, found and driven at run time.

The driver (`libcuda.so.1`) and NVRTC (`libnvrtc.so.13` or `.12`) are loaded dynamically when
first asked for, so one `smoe` binary runs on machines with and without them: [`probe`] says
in one line why no GPU is usable instead of failing at start or at link time. Kernels are CUDA
C compiled by NVRTC for the device's own architecture at first use; no CUDA toolkit is needed
where smoe runs.

This is the foundation of the CUDA backend (issue #18): device discovery, the compile-and-launch
path, and the first ops checked against the CPU. The `Backend` implementation builds on it.
*/
#![deny(missing_docs)]

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

/// The kernels, compiled by NVRTC for the device at hand.
const KERNELS: &str = r#"
// out[t, i] = x[t, i] / rms(x[t, :]) * w[i]: one block of 256 threads per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int dim, float eps) {
    __shared__ float partial[256];
    const float* row = x + (size_t)blockIdx.x * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += row[i] * row[i];
    partial[threadIdx.x] = s;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) partial[threadIdx.x] += partial[threadIdx.x + k];
        __syncthreads();
    }
    float scale = rsqrtf(partial[0] / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[(size_t)blockIdx.x * dim + i] = w[i] * (row[i] * scale);
}

// Decode mat-vec over Q8_0 rows as GGUF stores them (blocks of 34 bytes: f16 scale, 32 int8):
// out[r] = sum_b d_b * sum_i q_bi * x[32b + i]. One warp per row. Each half-warp takes one block,
// each of its 16 lanes one 16-bit pair of quants, so a warp's loads are consecutive 16-bit words
// (blocks are only 2-byte aligned); eight blocks per lane are in flight per iteration.
extern "C" __global__ void matvec_q8_0(const unsigned char* w, const float* x, float* out, int rows, int cols) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int blocks = cols / 32;
    const unsigned char* r = w + (size_t)row * blocks * 34;
    int half = lane / 16, pair = lane % 16;
    float acc = 0.0f;
    for (int b0 = 0; b0 < blocks; b0 += 16) {
        #pragma unroll
        for (int k = 0; k < 8; k++) {
            int b = b0 + 2 * k + half;
            if (b < blocks) {
                const unsigned short* p = (const unsigned short*)(r + (size_t)b * 34);
                float d;
                asm("cvt.f32.f16 %0, %1;" : "=f"(d) : "h"(p[0]));
                unsigned short two = p[1 + pair];
                float2 xv = *(const float2*)(x + b * 32 + 2 * pair);
                acc += d * ((float)(signed char)(two & 0xff) * xv.x + (float)(signed char)(two >> 8) * xv.y);
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffff, acc, o);
    if (lane == 0) out[row] = acc;
}

// g[i] = silu(g[i]) * u[i].
extern "C" __global__ void silu_mul(float* g, const float* u, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float a = g[i]; g[i] = a / (1.0f + expf(-a)) * u[i]; }
}
"#;

/// One GPU with its stream and compiled kernels.
pub struct Gpu {
    /// What the driver says of it.
    pub info: DeviceInfo,
    stream: Arc<CudaStream>,
    rms_norm: CudaFunction,
    silu_mul: CudaFunction,
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
        let (major, minor) = info.compute_capability;
        // NVRTC wants a 'static architecture name; one per process and device is leaked.
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch), ..Default::default() };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts).map_err(|e| format!("compiling the kernels for {arch}: {e}"))?;
        let module = ctx.load_module(ptx).map_err(|e| format!("loading the kernels: {e}"))?;
        let load = |name: &str| module.load_function(name).map_err(|e| format!("kernel {name}: {e}"));
        Ok(Gpu {
            stream: ctx.default_stream(),
            rms_norm: load("rms_norm")?,
            silu_mul: load("silu_mul")?,
            matvec_q8_0: load("matvec_q8_0")?,
            info,
        })
    }

    /// `n` rows of `dim` normalised by their RMS and scaled by `w`, computed on the GPU.
    pub fn rms_norm(&self, x: &[f32], w: &[f32], n: usize, dim: usize, eps: f32) -> Result<Vec<f32>, String> {
        assert!(x.len() >= n * dim && w.len() >= dim, "rms_norm: {} floats for {n} rows of {dim}, {} weights", x.len(), w.len());
        let err = |e: cudarc::driver::DriverError| format!("rms_norm: {e}");
        let xd = self.stream.clone_htod(&x[..n * dim]).map_err(err)?;
        let wd = self.stream.clone_htod(&w[..dim]).map_err(err)?;
        let mut out = self.stream.alloc_zeros::<f32>(n * dim).map_err(err)?;
        let dim_i = dim as i32;
        let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut launch = self.stream.launch_builder(&self.rms_norm);
        launch.arg(&xd).arg(&wd).arg(&mut out).arg(&dim_i).arg(&eps);
        // SAFETY: the arguments match the kernel's signature (two float inputs of n*dim and
        // dim, one float output of n*dim, int, float) and every index it touches is below
        // n*dim (one block per row, threads striding within the row).
        unsafe { launch.launch(cfg) }.map_err(err)?;
        self.stream.clone_dtoh(&out).map_err(err)
    }

    /// `silu(g) * u` element-wise, computed on the GPU.
    pub fn silu_mul(&self, g: &[f32], u: &[f32]) -> Result<Vec<f32>, String> {
        assert_eq!(g.len(), u.len(), "silu_mul: operands differ in length");
        let err = |e: cudarc::driver::DriverError| format!("silu_mul: {e}");
        let mut gd = self.stream.clone_htod(g).map_err(err)?;
        let ud = self.stream.clone_htod(u).map_err(err)?;
        let n = g.len() as i32;
        let mut launch = self.stream.launch_builder(&self.silu_mul);
        launch.arg(&mut gd).arg(&ud).arg(&n);
        // SAFETY: arguments match the kernel (float*, const float*, int); the kernel guards
        // i < n and both buffers hold n floats.
        unsafe { launch.launch(LaunchConfig::for_num_elems(g.len() as u32)) }.map_err(err)?;
        self.stream.clone_dtoh(&gd).map_err(err)
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
