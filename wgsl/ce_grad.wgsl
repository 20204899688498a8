// Cross-entropy and its gradient with respect to the logits, one workgroup per row, in place:
//   loss[r]   = logsumexp(z[r]) - z[r, target[r]]
//   z[r, j]  <- coef[r] * (softmax(z[r])[j] - [j == target[r]])
// coef carries the event's weight (1 / response length, times the reward advantage for scored
// events). f32 throughout; the max is subtracted before exp.

struct Params {
    v: u32,      // vocabulary (row length)
    rows: u32,
    _pad0: u32,
    _pad1: u32,
}

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> z: array<f32>;  // [rows, v]
@group(0) @binding(2) var<storage, read> rowinfo: array<u32>;   // [rows, 2]: target id, bitcast coef
@group(0) @binding(3) var<storage, read_write> loss: array<f32>; // [rows]

@compute @workgroup_size(256)
fn ce_grad(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = wg.y * nwg.x + wg.x;
    let live = row < p.rows;
    let base = row * p.v;
    var m = -3.0e38;
    if (live) {
        for (var j = li; j < p.v; j += WG) {
            m = max(m, z[base + j]);
        }
    }
    m = reduce_max(m, li);
    var s = 0.0;
    if (live) {
        for (var j = li; j < p.v; j += WG) {
            s += exp(z[base + j] - m);
        }
    }
    s = reduce_sum(s, li);
    if (!live) {
        return;
    }
    let tgt = rowinfo[2u * row];
    let coef = bitcast<f32>(rowinfo[2u * row + 1u]);
    if (li == 0u) {
        loss[row] = log(s) + m - z[base + tgt];
    }
    workgroupBarrier();
    let inv = 1.0 / s;
    for (var j = li; j < p.v; j += WG) {
        var g = exp(z[base + j] - m) * inv;
        if (j == tgt) {
            g -= 1.0;
        }
        z[base + j] = coef * g;
    }
}
