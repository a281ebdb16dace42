//! Kernel launches, with programmatic dependent launch where the GPU has it (compute 9.0+).
//!
//! A decoded token runs some 600 kernels, most a few microseconds long, each after the one
//! before it in one stream; between two of them the GPU lets the first drain and flushes its
//! writes, and only then starts launching the second. Launched with programmatic stream
//! serialization allowed, a kernel may be scheduled while the one before it still runs: every
//! kernel in kernels.cu begins with `PDL_START` — it waits (`griddepcontrol.wait`) until the
//! kernel before it has finished and its writes are visible, then lets the next one be
//! scheduled (`griddepcontrol.launch_dependents`) — so results are the same, bit for bit, and
//! only the launch latency moves under the previous kernel's tail.

use cudarc::driver::{sys, CudaFunction, CudaStream, DeviceRepr, DriverError, LaunchConfig};
use std::ffi::c_void;
use std::marker::PhantomData;

/// Parameters of the kernel that takes the most (attention: 21).
const MAX_ARGS: usize = 24;

/// One launch's kernel and arguments, as the driver takes them: a pointer to each value, which
/// the borrow keeps alive until the launch. On the stack: a decoded token makes some 600
/// launches, and a heap list each was an allocation per kernel.
pub(crate) struct Launch<'a> {
    func: &'a CudaFunction,
    args: [*mut c_void; MAX_ARGS],
    len: usize,
    _values: PhantomData<&'a ()>,
}

impl<'a> Launch<'a> {
    pub fn new(func: &'a CudaFunction) -> Launch<'a> {
        Launch { func, args: [std::ptr::null_mut(); MAX_ARGS], len: 0, _values: PhantomData }
    }

    /// The next argument, by reference.
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        assert!(self.len < MAX_ARGS, "a kernel with more than {MAX_ARGS} parameters: raise MAX_ARGS");
        self.args[self.len] = value as *const T as *mut c_void;
        self.len += 1;
        self
    }

    /// Queues the kernel on `stream`; `overlap`: with programmatic stream serialization
    /// allowed (see the module documentation).
    ///
    /// # Safety
    /// The arguments must match the kernel's parameter list in type and order, the device
    /// memory they point to must hold what the kernel touches, and, with `overlap`, the kernel
    /// must begin with `PDL_START`.
    pub unsafe fn launch(&mut self, stream: &CudaStream, cfg: LaunchConfig, overlap: bool) -> Result<(), DriverError> {
        stream.context().bind_to_thread()?;
        // SAFETY: CUlaunchAttribute is plain C data (an id, padding and a union of plain
        // values), for which all zeroes is a valid value; its id and the one union field the
        // driver reads for that id are set next.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
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
            attrs: &mut attr,
            numAttrs: overlap as u32,
        };
        // SAFETY: `config` and `attr` outlive the call; the argument pointers are valid
        // (borrowed for 'a) and match the kernel (the caller's promise).
        unsafe { sys::cuLaunchKernelEx(&config, self.func.cu_function(), self.args.as_mut_ptr(), std::ptr::null_mut()) }.result()
    }
}
