// y[m, n] (+)= sum_k w[n, k] * x[m, k]  [+ s * sum_j t[m, j] * B[n, j]]   (2 to 8 tokens)
//
// nn.Linear for a few rows of x (a short prompt): the matvec layout with every weight read once for
// all the tokens. A workgroup of 64 invocations is 64 / LANES row groups of LANES invocations; each
// invocation owns TR = 4 consecutive rows, loads one vec4<u32> of weights per row and step (8
// bf16/f16 weights, two vec4 for f32), widens them once and multiplies them with the same 8
// elements of each of the TOK token rows of x. Partial sums are reduced through workgroup memory
// after one barrier; the storing invocations add the LoRA expand of their (row, token).
//
// Host contract: K a multiple of 8, x rows 16-byte aligned (x_offset and x_stride multiples of 4),
// m <= TOK (token rows past m are skipped: not loaded, computed or stored). Parameters, bindings and the
// helpers: linear.wgsl.

override LANES: u32 = 16u;       // invocations along K per row group: 8, 16, 32 or 64
override TOK: u32 = 4u;          // token rows per dispatch: 2, 4 or 8

const WG: u32 = 64u;
const TR: u32 = 4u;
const MAX_TOK: u32 = 8u;

var<workgroup> red: array<f32, 2048>; // [rows of the workgroup][TOK][LANES] = TR * WG * TOK floats

// The t values linear.wgsl's lora_row reads: straight from t's buffer (no split shrink here).
fn t_vec(i: u32) -> vec4<f32> {
    return t[i];
}

fn t_one(e: u32) -> f32 {
    return t_elem(e);
}

// lora_row multiplies in the scale table itself.
fn t_scaled() -> bool {
    return false;
}

struct Slot {
    row0: u32,  // first row of the workgroup
    group: u32, // row group of this invocation
    lane: u32,  // position along K within the row group
}

fn slot(wg: vec3<u32>, nwg: vec3<u32>, li: u32) -> Slot {
    return Slot((wg.y * nwg.x + wg.x) * TR * (WG / LANES), li / LANES, li % LANES);
}

// The 8 weights of row vector `rv`, step j, as (even, odd) elements for 16-bit weights or the two
// halves for f32, matching how x is split below.
fn weights8(rv: u32, j: u32) -> array<vec4<f32>, 2> {
    if (W_DTYPE == 0u) {
        return array<vec4<f32>, 2>(bitcast<vec4<f32>>(w[rv + 2u * j]), bitcast<vec4<f32>>(w[rv + 2u * j + 1u]));
    }
    return even_odd(w[rv + j]);
}

// Partial sums of this invocation's 4 rows for each token: acc[token] = rows 0-3.
fn partials(s: Slot) -> array<vec4<f32>, MAX_TOK> {
    var acc: array<vec4<f32>, MAX_TOK>;
    let first = s.row0 + s.group * TR;
    let last = p.n - 1u;
    let groups = p.k / 8u;
    let row_vecs = select(groups, 2u * groups, W_DTYPE == 0u);
    let r0 = (p.w_row0 + min(first, last)) * row_vecs;
    let r1 = (p.w_row0 + min(first + 1u, last)) * row_vecs;
    let r2 = (p.w_row0 + min(first + 2u, last)) * row_vecs;
    let r3 = (p.w_row0 + min(first + 3u, last)) * row_vecs;
    for (var j = s.lane; j < groups; j += LANES) {
        let w0 = weights8(r0, j);
        let w1 = weights8(r1, j);
        let w2 = weights8(r2, j);
        let w3 = weights8(r3, j);
        for (var tk = 0u; tk < TOK; tk++) {
            if (tk >= p.m) {
                break;
            }
            let x4 = (p.x_offset + tk * p.x_stride) >> 2u;
            let xa = x[x4 + 2u * j];
            let xb = x[x4 + 2u * j + 1u];
            var xe = xa;
            var xo = xb;
            if (W_DTYPE != 0u) {
                xe = vec4<f32>(xa.x, xa.z, xb.x, xb.z);
                xo = vec4<f32>(xa.y, xa.w, xb.y, xb.w);
            }
            acc[tk] += vec4<f32>(dot(w0[0], xe) + dot(w0[1], xo), dot(w1[0], xe) + dot(w1[1], xo),
                dot(w2[0], xe) + dot(w2[1], xo), dot(w3[0], xe) + dot(w3[1], xo));
        }
    }
    return acc;
}

// Write the partials to workgroup memory, then one barrier.
fn stage(s: Slot, acc: array<vec4<f32>, MAX_TOK>) {
    for (var tk = 0u; tk < TOK; tk++) {
        let base = ((s.group * TR) * TOK + tk) * LANES + s.lane;
        red[base] = acc[tk].x;
        red[base + TOK * LANES] = acc[tk].y;
        red[base + 2u * TOK * LANES] = acc[tk].z;
        red[base + 3u * TOK * LANES] = acc[tk].w;
    }
    workgroupBarrier();
}

// Outputs of a workgroup: output o is row o / TOK, token o % TOK; invocation li stores
// o = li, li + 64, ...
fn outputs() -> u32 {
    return TR * (WG / LANES) * TOK;
}

fn inside(s: Slot, o: u32) -> bool {
    return s.row0 + o / TOK < p.n && o % TOK < p.m;
}

fn lane_sum(o: u32) -> f32 {
    var sum = 0.0;
    for (var l = 0u; l < LANES; l++) {
        sum += red[o * LANES + l];
    }
    return sum;
}

fn store(s: Slot, o: u32, v: f32) {
    let idx = p.y_offset + (o % TOK) * p.y_stride + s.row0 + o / TOK;
    if (ACCUMULATE) {
        y[idx] = y[idx] + v;
    } else {
        y[idx] = v;
    }
}

@compute @workgroup_size(64)
fn matvec_batch(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let s = slot(wg, nwg, li);
    stage(s, partials(s));
    for (var o = li; o < outputs(); o += WG) {
        if (inside(s, o)) {
            store(s, o, lane_sum(o));
        }
    }
}

@compute @workgroup_size(64)
fn matvec_batch_lora(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let s = slot(wg, nwg, li);
    stage(s, partials(s));
    for (var o = li; o < outputs(); o += WG) {
        if (inside(s, o)) {
            store(s, o, lane_sum(o) + lora_row(s.row0 + o / TOK, o % TOK));
        }
    }
}
