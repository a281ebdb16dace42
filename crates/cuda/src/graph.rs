//! Decoded tokens replayed as CUDA graphs.
//!
//! A decoded token is some 500 kernel launches, each a few microseconds of host time in the
//! driver (2.7–3.0 µs on the H200's host), most of them about as long on the GPU. Here the
//! launches of a one-token step are recorded (stream capture) instead of sent, and the
//! step goes to the GPU as one graph. A step's graph differs from the last one's only in
//! parameters (the position, the attention splits), so the executable graph is updated in place
//! (`cuGraphExecUpdate`) rather than built again; only a step of another shape (another kernel
//! sequence) is instantiated anew.
//!
//! Capture stops (and what was recorded is launched) before anything that cannot be recorded
//! or must not be: a download, a synchronization, an allocation, a copy from pageable memory,
//! the copy stream's expert traffic. The backend calls [`StepGraph::end`] there (`settle`), so a
//! step that needs one of them runs its first part as a graph and the rest as before.
//!
//! Measured on the H200 (48-layer 30B shape, all in VRAM): recording cost 0.6–0.8 µs a kernel,
//! but the graphs ran slower on the GPU than the same kernels launched one by one with
//! programmatic dependent launch (249.9 against 297.1 tok/s), so they are off unless asked for
//! (`CudaOptions::graphs`, `SMOE_CUDA_GRAPHS=on`).

use cudarc::driver::{sys, CudaStream, DriverError};

/// The capture state and the executable graph of the latest step.
pub(crate) struct StepGraph {
    exec: sys::CUgraphExec,
    capturing: bool,
    /// Steps launched as graphs, and how many of them needed a new instantiation.
    pub launched: u64,
    pub instantiated: u64,
}

// SAFETY: `exec` is a driver handle owned by this value alone, used only through `&mut self`
// (the backend keeps the value behind a mutex), so moving it between threads is sound; the
// driver's graph calls may come from any thread bound to the context.
unsafe impl Send for StepGraph {}

impl StepGraph {
    pub(crate) fn new() -> StepGraph {
        StepGraph { exec: std::ptr::null_mut(), capturing: false, launched: 0, instantiated: 0 }
    }

    /// Whether launches on the stream are being recorded.
    pub(crate) fn capturing(&self) -> bool {
        self.capturing
    }

    /// Starts recording `stream`'s work. Relaxed mode: other threads' unrelated driver calls
    /// (the store's host-side work, another model's stream) stay legal meanwhile.
    pub(crate) fn begin(&mut self, stream: &CudaStream) -> Result<(), DriverError> {
        if self.capturing {
            return Ok(());
        }
        stream.context().bind_to_thread()?;
        // SAFETY: a stream of this context, not capturing (checked above); the mode is a
        // valid enum value.
        unsafe { sys::cuStreamBeginCapture_v2(stream.cu_stream(), sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) }.result()?;
        self.capturing = true;
        Ok(())
    }

    /// Stops recording and launches what was recorded on `stream`, through the executable
    /// graph updated in place where the recorded steps have its shape. Nothing happens when
    /// not capturing.
    pub(crate) fn end(&mut self, stream: &CudaStream) -> Result<(), DriverError> {
        if !self.capturing {
            return Ok(());
        }
        self.capturing = false;
        stream.context().bind_to_thread()?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is capturing (begun above); `graph` receives the recorded graph,
        // owned here and destroyed below.
        unsafe { sys::cuStreamEndCapture(stream.cu_stream(), &mut graph) }.result()?;
        if graph.is_null() {
            return Ok(());
        }
        let r = self.launch(stream, graph);
        // SAFETY: the graph is ours; the executable graph made from it does not need it.
        unsafe { sys::cuGraphDestroy(graph) };
        r
    }

    fn launch(&mut self, stream: &CudaStream, graph: sys::CUgraph) -> Result<(), DriverError> {
        if !self.exec.is_null() {
            // SAFETY: zeroes are a valid CUgraphExecUpdateResultInfo (plain C data: an enum
            // whose 0 is SUCCESS and two null node handles), which the call overwrites.
            let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
            // SAFETY: both handles are live: `exec` is owned here, `graph` by the caller.
            if unsafe { sys::cuGraphExecUpdate_v2(self.exec, graph, &mut info) }.result().is_err() {
                self.destroy();
            }
        }
        if self.exec.is_null() {
            let mut exec: sys::CUgraphExec = std::ptr::null_mut();
            // SAFETY: `graph` is live; `exec` receives a new executable graph owned here.
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result()?;
            self.exec = exec;
            self.instantiated += 1;
        }
        // SAFETY: `exec` is live and was made in this stream's context.
        unsafe { sys::cuGraphLaunch(self.exec, stream.cu_stream()) }.result()?;
        self.launched += 1;
        Ok(())
    }

    fn destroy(&mut self) {
        if !self.exec.is_null() {
            // SAFETY: owned here; launches of it are stream-ordered, and the driver defers the
            // release until they finish.
            unsafe { sys::cuGraphExecDestroy(self.exec) };
            self.exec = std::ptr::null_mut();
        }
    }
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        self.destroy();
    }
}
