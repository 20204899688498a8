// Gated DeltaNet token mixer (Qwen3_5GatedDeltaNet): causal depthwise conv + SiLU over the qkv
// channels, then the gated delta-rule recurrence per value head. f32 throughout.
//
// mixed:      [T, C]            in_proj_qkv output, channels [q (Kd) | k (Kd) | v (Vd)]
// conv_state: [C, K-1]          the previous K-1 pre-conv inputs per channel (oldest first), read
//                               from one buffer and written to the other (a step that is
//                               discarded leaves the state it started from)
// A dispatch runs rows row0 .. row0 + t of the [T, ·] buffers: a step split at a row whose
// states are kept (a prompt cache's snapshot) runs as several, each reading the states the
// one before wrote.
// conv_w:     [C, K]            conv1d.weight[c, 0, j]; tap K-1 multiplies the current token
// y:          [T, C]            silu(conv) output
// b, a:       [T, Hv]           in_proj_b / in_proj_a outputs (beta and decay logits)
// gate_p:     [2, Hv]           row 0 = A_log, row 1 = dt_bias
// state:      [Hv, Dk, Dv]      recurrent state S_h (read from state_in, written to state)
// core:       [T, Hv*Dv]        per-head outputs (before the gated RMSNorm)

struct Params {       // the first fields of gdn_step.wgsl's (one GdnParams on the host)
    t: u32,
    c: u32,
    k: u32,          // conv kernel width
    hk: u32,
    hv: u32,
    dk: u32,
    dv: u32,
    eps: f32,        // gdn_step.wgsl's gated norm (unused here)
    lora_rank: u32,  // gdn_step.wgsl's LoRA shrink (unused here)
    mixed_at: u32,   // gdn_step.wgsl's row offsets (unused here)
    core_at: u32,
    row0: u32,       // the first row of mixed and y this dispatch runs (rows row0 .. row0 + t)
}

const MAX_K: u32 = 8u;

@group(0) @binding(0) var<uniform> p: Params;

// ---- conv: one invocation per channel walks the tokens in order ----

@group(0) @binding(1) var<storage, read> mixed: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> conv_in: array<f32>;
@group(0) @binding(4) var<storage, read_write> conv_out: array<f32>;
@group(1) @binding(0) var<storage, read> conv_w: array<f32>;

@compute @workgroup_size(64)
fn conv_silu(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    if (c >= p.c) {
        return;
    }
    let km1 = p.k - 1u;
    var win: array<f32, MAX_K>;
    for (var j = 0u; j < km1; j++) {
        win[j] = conv_in[c * km1 + j];
    }
    for (var t = 0u; t < p.t; t++) {
        win[km1] = mixed[(p.row0 + t) * p.c + c];
        var acc = 0.0;
        for (var j = 0u; j < p.k; j++) {
            acc = fma(conv_w[c * p.k + j], win[j], acc);
        }
        y[(p.row0 + t) * p.c + c] = silu(acc);
        for (var j = 0u; j < km1; j++) {
            win[j] = win[j + 1u];
        }
    }
    for (var j = 0u; j < km1; j++) {
        conv_out[c * km1 + j] = win[j];
    }
}
