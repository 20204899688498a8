// q/k RMSNorm1p over head_dim + partial NeoX RoPE; keys and values go into the KV cache.
// One workgroup per (token, head). See attention.wgsl for the layouts; the parameters and the
// RMS come from attention_common.wgsl.

@group(0) @binding(1) var<storage, read> src: array<f32>;   // prep_q: qg; prep_kv: kraw
@group(0) @binding(2) var<storage, read> rope: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;  // prep_q: q; prep_kv: k cache
@group(0) @binding(4) var<storage, read> vraw: array<f32>;        // prep_kv only
@group(0) @binding(5) var<storage, read_write> vc: array<f32>;    // prep_kv only: v cache
@group(1) @binding(0) var<storage, read> norm_w: array<f32>;     // q_norm or k_norm [hd]

// Normalise the head row starting at src[sb] and write it rotated to dst[db..db+hd].
fn norm_rope(sb: u32, db: u32, pos: u32, li: u32) {
    var ss = 0.0;
    for (var d = li; d < p.hd; d += WG) {
        let v = src[sb + d];
        ss = fma(v, v, ss);
    }
    let scale = inv_rms(ss, li);
    let r = p.rot_half;
    for (var d = li; d < p.hd; d += WG) {
        let v = src[sb + d] * scale * (1.0 + norm_w[d]);
        if (d < r) {
            let cs = rope[pos * r + d];
            let u = src[sb + d + r] * scale * (1.0 + norm_w[d + r]);
            dst[db + d] = v * cs.x - u * cs.y;
            dst[db + d + r] = u * cs.x + v * cs.y;
        } else if (d >= 2u * r) {
            dst[db + d] = v;
        }
    }
}

@compute @workgroup_size(64)
fn prep_q(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.x;
    let h = wg.y;
    norm_rope((t * p.hq + h) * 2u * p.hd, (t * p.hq + h) * p.hd, p.pos0 + t, li);
}

@compute @workgroup_size(64)
fn prep_kv(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.x;
    let h = wg.y;
    let pos = p.pos0 + t;
    let cb = (h * p.s_max + pos) * p.hd;
    let sb = (t * p.hkv + h) * p.hd;
    norm_rope(p.k_offset + sb, cb, pos, li);
    for (var d = li; d < p.hd; d += WG) {
        vc[cb + d] = vraw[p.v_offset + sb + d];
    }
}
