// Gated full attention (Qwen3_5Attention): per-head q/k RMSNorm1p, partial NeoX RoPE, KV cache
// write, causal GQA softmax attention, sigmoid output gate. f32 throughout. The parameters come
// from attention_common.wgsl, the cache and the online softmax from attention_cached.wgsl.
//
// qg:    [T, Hq, 2*hd]   q_proj output: per head [query | gate]
// kraw:  [T, Hkv*hd], vraw: [T, Hkv*hd]
// q:     [T, Hq, hd]     normed + rotated queries
// kc/vc: [Hkv, S_max, hd] cache (keys normed + rotated)
// rope:  [S_max, R/2] pairs (cos, sin) for every cache position
// out:   [T, Hq*hd]      attention output times sigmoid(gate)

@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> qg: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

// One workgroup per (token, query head), over the cache up to and including the token (the
// prep kernels wrote it).
@compute @workgroup_size(64)
fn attend(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.x;
    let h = wg.y;
    let kvh = h / (p.hq / p.hkv);
    let qb = (t * p.hq + h) * p.hd;
    for (var d = li; d < p.hd; d += WG) {
        qs[d] = q[qb + d];
    }
    workgroupBarrier();
    let o = attend_cached(kvh, 0u, p.pos0 + t + 1u, li);
    let ob = (t * p.hq + h) * p.hd;
    let gb = (t * p.hq + h) * 2u * p.hd + p.hd;
    for (var i = 0u; i < MAX_DIMS; i++) {
        let d = li + i * WG;
        if (d < p.hd) {
            let gate = qg[gb + d];
            out[ob + d] = o.acc[i] / o.l * sigmoid(gate);
        }
    }
}
