// Backward of attention_prep.wgsl's per-head RMSNorm1p + partial NeoX RoPE, in place: the
// gradient of the rotated head row is replaced by the gradient of the raw projection output.
// One workgroup per (row, head). f32 throughout.
//
// forward: n = x * r * (1 + w), r = rsqrt(mean(x^2) + eps); for d < R/2 (c, s at the position):
//   y_d = n_d c - n_{d+R/2} s,  y_{d+R/2} = n_{d+R/2} c + n_d s;  y_d = n_d for d >= R
// backward: dn_d = dy_d c + dy_{d+R/2} s,  dn_{d+R/2} = dy_{d+R/2} c - dy_d s;
//   dx = r (1 + w) dn - x r^3 / hd * sum_d x_d (1 + w_d) dn_d

struct Params {
    heads: u32,
    hd: u32,
    rot_half: u32,
    pos0: u32,        // position of row 0
    x_offset: u32,    // raw input: x_offset + row * x_row + head * x_head + d
    x_row: u32,
    x_head: u32,
    y_offset: u32,    // gradient: y_offset + row * y_row + head * y_head + d
    y_row: u32,
    y_head: u32,
    eps: f32,
    _pad: u32,
}

const WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> rope: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> norm_w: array<f32>;

var<workgroup> dn: array<f32, 512>;
@compute @workgroup_size(64)
fn norm_rope_bwd(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = wg.x;
    let h = wg.y;
    let pos = p.pos0 + row;
    let xb = p.x_offset + row * p.x_row + h * p.x_head;
    let yb = p.y_offset + row * p.y_row + h * p.y_head;
    let r = p.rot_half;
    for (var d = li; d < p.hd; d += WG) {
        var g = y[yb + d];
        if (d < r) {
            let cs = rope[pos * r + d];
            g = y[yb + d] * cs.x + y[yb + d + r] * cs.y;
        } else if (d < 2u * r) {
            let cs = rope[pos * r + d - r];
            g = y[yb + d] * cs.x - y[yb + d - r] * cs.y;
        }
        dn[d] = g;
    }
    workgroupBarrier();
    var ss = 0.0;
    var dot = 0.0;
    for (var d = li; d < p.hd; d += WG) {
        let v = x[xb + d];
        ss = fma(v, v, ss);
        dot = fma(v * (1.0 + norm_w[d]), dn[d], dot);
    }
    ss = reduce_sum(ss, li);
    dot = reduce_sum(dot, li);
    let rs = inverseSqrt(ss / f32(p.hd) + p.eps);
    let c = rs * rs * rs * dot / f32(p.hd);
    for (var d = li; d < p.hd; d += WG) {
        y[yb + d] = rs * (1.0 + norm_w[d]) * dn[d] - x[xb + d] * c;
    }
}
