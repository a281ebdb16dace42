//! Gated DeltaNet (Qwen3-Next and Qwen3.5's linear attention) on the GPU, kernels in delta.cu:
//! the causal convolution with SiLU (a thread per channel), the q/k heads' L2 norms (a warp per
//! head), then the delta-rule recurrence with its gated RMSNorm (a block per value head, a
//! thread per state column), token by token for every call. The CPU runs long calls in the
//! chunked form instead; both give the same values up to rounding and continue each other's
//! states. The layer's small parameters (convolution weights, decay, biases, norm) are vectors
//! in VRAM, loaded with the model.

use super::{cfg_elems, CudaBackend, CudaBuf, CudaVector};
use crate::buf::dptr;
use crate::launch::Launch;
use cudarc::driver::LaunchConfig;
use smoe_engine::backend::{check, check_rows, DeltaNetParams};

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn delta_net(
        &self,
        p: DeltaNetParams<'_, CudaVector>,
        x: &CudaBuf,
        row0: usize,
        n: usize,
        state: &mut CudaBuf,
        fresh: bool,
        out: &mut CudaBuf,
    ) {
        if self.faulted() || n == 0 {
            return;
        }
        let (c, vh, vd, kh, kd) = (p.channels(), p.value_heads, p.value_dim, p.key_heads, p.key_dim);
        let (stride, vw) = (p.stride(), vh * vd);
        check_rows("gated_delta_net", x, row0, n, stride, 0, stride);
        check_rows("gated_delta_net output", out, row0, n, vw, 0, vw);
        check("gated_delta_net state", state, 1, p.state_floats());
        assert!(
            p.conv.len == c * p.taps && p.neg_a.len == vh && p.dt_bias.len == vh && p.norm.len == vd,
            "gated_delta_net: parameters of the wrong lengths"
        );
        assert!(p.taps >= 1 && vd <= 1024 && kh > 0 && vh % kh == 0, "gated_delta_net: {vd} value dims, {kh} key heads for {vh}");
        let [conv, neg_a, dt_bias, norm] = [p.conv, p.neg_a, p.dt_bias, p.norm].map(|v| dptr(&v.data, &self.stream));
        let Some(y) = self.float_scratch(&self.delta_part, n * c, "gated_delta_net rows") else { return };
        let xp = x.at(&self.stream) + (4 * row0 * stride) as u64;
        let op = out.at_mut(&self.stream) + (4 * row0 * vw) as u64;
        let sp = state.at_mut(&self.stream);
        let mats = sp + (4 * (p.taps - 1) * c) as u64;
        let (n_i, c_i, s_i, taps, fresh_i) = (n as i32, c as i32, stride as i32, p.taps as i32, fresh as i32);
        let mut a = Launch::new(&self.k.delta_conv);
        a.arg(&xp).arg(&s_i).arg(&n_i).arg(&conv).arg(&taps).arg(&c_i).arg(&sp).arg(&fresh_i).arg(&y);
        self.launch(a, cfg_elems(c), "delta_conv");
        let (kh_i, kd_i) = (kh as i32, kd as i32);
        let mut a = Launch::new(&self.k.delta_l2norm);
        a.arg(&y).arg(&n_i).arg(&c_i).arg(&kh_i).arg(&kd_i);
        self.launch(a, cfg_elems(32 * n * 2 * kh), "delta_l2norm");
        let (vh_i, vd_i, tiled) = (vh as i32, vd as i32, p.tiled as i32);
        let mut a = Launch::new(&self.k.delta_heads);
        a.arg(&y).arg(&xp).arg(&s_i).arg(&n_i).arg(&c_i).arg(&kh_i).arg(&vh_i).arg(&kd_i).arg(&vd_i).arg(&tiled);
        a.arg(&neg_a).arg(&dt_bias).arg(&norm).arg(&p.eps).arg(&mats).arg(&fresh_i).arg(&op);
        let cfg = LaunchConfig {
            grid_dim: (vh as u32, 1, 1),
            block_dim: (vd.next_multiple_of(32) as u32, 1, 1),
            shared_mem_bytes: (8 * kd) as u32,
        };
        self.launch(a, cfg, "delta_heads");
    }

    pub(super) fn gate_rows(&self, x: &mut CudaBuf, n: usize, width: usize, gate: &CudaBuf, gs: usize, go: usize) {
        if self.faulted() || n == 0 || width == 0 {
            return;
        }
        check("sigmoid_gate", x, n, width);
        check_rows("sigmoid_gate gates", gate, 0, n, gs, go, width);
        let (xp, gp) = (x.at_mut(&self.stream), gate.at(&self.stream));
        let (n_i, w_i, gs_i, go_i) = (n as i32, width as i32, gs as i32, go as i32);
        let mut a = Launch::new(&self.k.sigmoid_gate);
        a.arg(&xp).arg(&n_i).arg(&w_i).arg(&gp).arg(&gs_i).arg(&go_i);
        self.launch(a, cfg_elems(n * width), "sigmoid_gate");
    }
}
