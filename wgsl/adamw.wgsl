// The optimiser of a trainable adapter, on the GPU.
//
// sum_squares (one workgroup): norms[slot] = sum_i grad[i]^2, one slot per parameter tensor.
// adamw (elementwise): clip = min(1, max_norm / (sqrt(sum(norms)) + 1e-6)) (max_norm = 0: none);
//   g = clip * grad + anchor_l2 * (param - anchor)      (L2 pull towards the starting weights)
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   param -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * param)
// bc1 = 1 - b1^t and bc2 = 1 - b2^t come from the host. f32 throughout.

struct Params {
    n: u32,
    slot: u32,
    slots: u32,
    offset: u32,     // adamw: first element of the tensor in param (B matrices share a buffer)
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    anchor_l2: f32,
    bc1: f32,
    bc2: f32,
    max_norm: f32,
    _pad1: f32,
    _pad2: f32,
    _pad3: f32,
}

const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> grad: array<f32>;
@group(0) @binding(2) var<storage, read_write> norms: array<f32>;
@group(0) @binding(3) var<storage, read_write> param: array<f32>;   // adamw only
@group(0) @binding(4) var<storage, read_write> m1: array<f32>;      // adamw only
@group(0) @binding(5) var<storage, read_write> m2: array<f32>;      // adamw only
@group(0) @binding(6) var<storage, read> anchor: array<f32>;        // adamw only

@compute @workgroup_size(256)
fn sum_squares(@builtin(local_invocation_index) li: u32) {
    var s = 0.0;
    for (var i = li; i < p.n; i += WG) {
        s = fma(grad[i], grad[i], s);
    }
    let total = reduce_sum(s, li);
    if (li == 0u) {
        norms[p.slot] = total;
    }
}

@compute @workgroup_size(256)
fn adamw(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * WG + gid.x;
    if (i >= p.n) {
        return;
    }
    var total = 0.0;
    for (var s = 0u; s < p.slots; s++) {
        total += norms[s];
    }
    // A gradient with an infinite or NaN element (its squares' sum is then not finite) updates
    // nothing: weights and moments stay as they were (the host reports the step as failed). The
    // exponent bits, not a comparison: fast-math compilers may fold a NaN test away.
    if ((bitcast<u32>(total) & 0x7f800000u) == 0x7f800000u) {
        return;
    }
    var clip = 1.0;
    if (p.max_norm > 0.0) {
        clip = min(1.0, p.max_norm / (sqrt(total) + 1e-6));
    }
    let w = param[p.offset + i];
    let g = clip * grad[i] + p.anchor_l2 * (w - anchor[i]);
    let m = p.beta1 * m1[i] + (1.0 - p.beta1) * g;
    let v = p.beta2 * m2[i] + (1.0 - p.beta2) * g * g;
    m1[i] = m;
    m2[i] = v;
    param[p.offset + i] = w - p.lr * ((m / p.bc1) / (sqrt(v / p.bc2) + p.eps) + p.weight_decay * w);
}
