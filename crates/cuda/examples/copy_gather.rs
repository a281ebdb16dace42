//! How fast a layer's expert misses can cross the bus: many matrices of an expert's size, from
//! scattered places in page-locked host memory into separate VRAM buffers, copied one
//! `cuMemcpyHtoDAsync` each (what the VRAM tier does), in one `cuMemcpyBatchAsync`, or read by a
//! gather kernel through the mapped host memory — against one large copy of the same bytes.
//! `cargo run --release -p smoe-cuda --example copy_gather`.

use cudarc::driver::{sys, CudaContext, DevicePtr, LaunchConfig, PushKernelArg};
use std::time::Instant;

const GATHER: &str = r#"
extern "C" __global__ void gather(const unsigned long long* srcs, const unsigned long long* dsts, unsigned long long n16) {
    const uint4* s = (const uint4*)srcs[blockIdx.y];
    uint4* d = (uint4*)dsts[blockIdx.y];
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], e = s[i + 3 * stride];
        d[i] = a; d[i + stride] = b; d[i + 2 * stride] = c; d[i + 3 * stride] = e;
    }
    for (; i < n16; i += stride) d[i] = s[i];
}
"#;

fn main() {
    let ctx = CudaContext::new(0).expect("a GPU");
    let stream = ctx.new_stream().unwrap();
    let chunk = 884_736usize; // a 768 x 2048 Q4_K matrix
    let host_bytes = 2usize << 30;
    let host = vec![7u8; host_bytes];
    // SAFETY: `host` outlives the registration (unregistered below before it drops).
    let r = unsafe {
        sys::cuMemHostRegister_v2(host.as_ptr() as *mut _, host_bytes, sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP)
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let mut mapped = 0u64;
    // SAFETY: `host` was registered with DEVICEMAP just above.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut mapped, host.as_ptr() as *mut _, 0) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let ptx = cudarc::nvrtc::compile_ptx(GATHER).expect("gather kernel");
    let gather = ctx.load_module(ptx).unwrap().load_function("gather").unwrap();
    let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    for count in [8usize, 24, 72] {
        let total = count * chunk;
        let big = stream.alloc_zeros::<u8>(total).unwrap();
        let bufs: Vec<_> = (0..count).map(|_| stream.alloc_zeros::<u8>(chunk).unwrap()).collect();
        let dsts: Vec<u64> = bufs.iter().map(|b| b.device_ptr(&stream).0).collect();
        // Scattered sources: every 11th chunk-sized place of the 2 GiB, as cache slots are.
        let offs: Vec<usize> = (0..count).map(|i| (i * 11 * chunk) % (host_bytes - chunk)).collect();
        let dev_srcs: Vec<u64> = offs.iter().map(|&o| mapped + o as u64).collect();
        let srcs_d = stream.clone_htod(&dev_srcs).unwrap();
        let dsts_d = stream.clone_htod(&dsts).unwrap();
        let time = |what: &str, f: &mut dyn FnMut()| {
            let mut best = f64::MAX;
            for _ in 0..7 {
                stream.synchronize().unwrap();
                let a = stream.record_event(timed).unwrap();
                f();
                let b = stream.record_event(timed).unwrap();
                stream.synchronize().unwrap();
                best = best.min(a.elapsed_ms(&b).unwrap() as f64 / 1e3);
            }
            println!("{count:>3} x {chunk} B, {what:<28} {:>7.1} us  {:>5.1} GB/s", best * 1e6, total as f64 / best / 1e9);
        };
        let bigp = big.device_ptr(&stream).0;
        time("one copy", &mut || {
            // SAFETY: `big` holds `total` bytes; `host` is registered and outlives the copy.
            unsafe { cudarc::driver::result::memcpy_htod_async(bigp, &host[..total], stream.cu_stream()) }.unwrap();
        });
        time("a copy each", &mut || {
            for (d, &o) in dsts.iter().zip(&offs) {
                // SAFETY: each buffer holds `chunk` bytes; `host` outlives the copy.
                unsafe { cudarc::driver::result::memcpy_htod_async(*d, &host[o..o + chunk], stream.cu_stream()) }.unwrap();
            }
        });
        for (name, flags) in [("cuMemcpyBatchAsync", 0u32), ("batch, overlap with compute", 1)] {
            time(name, &mut || {
                let mut d = dsts.clone();
                let mut s: Vec<u64> = offs.iter().map(|&o| host.as_ptr() as u64 + o as u64).collect();
                let mut sizes = vec![chunk; count];
                // SAFETY: plain C data; all zeroes is valid and the fields read are set.
                let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
                attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
                attr.srcLocHint.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
                attr.dstLocHint.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                attr.flags = flags;
                let mut idx = 0usize;
                // SAFETY: `count` valid (dst, src, size) triples as above; one attribute for all.
                let r = unsafe {
                    sys::cuMemcpyBatchAsync_v2(
                        d.as_mut_ptr(),
                        s.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        count,
                        &mut attr,
                        &mut idx,
                        1,
                        stream.cu_stream(),
                    )
                };
                assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{name}");
            });
        }
        for blocks in [4u32, 16] {
            time(&format!("gather kernel, {blocks} blocks"), &mut || {
                let cfg = LaunchConfig { grid_dim: (blocks, count as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                let n16 = (chunk / 16) as u64;
                let mut l = stream.launch_builder(&gather);
                l.arg(&srcs_d).arg(&dsts_d).arg(&n16);
                // SAFETY: the pointer tables hold `count` mapped sources and device buffers of
                // `chunk` bytes each, and n16 * 16 == chunk.
                unsafe { l.launch(cfg) }.unwrap();
            });
        }
        let check = stream.clone_dtoh(&bufs[count - 1]).unwrap();
        assert!(check.iter().all(|&b| b == 7));
    }
    let t = Instant::now();
    // SAFETY: registered above, still allocated.
    unsafe { sys::cuMemHostUnregister(host.as_ptr() as *mut _) };
    println!("unregistered in {:.2} s", t.elapsed().as_secs_f64());
}
