// y[m, n] (+)= sum_k w[n, k] * x[m, k]  [+ s * sum_j t[m, j] * B[n, j]]   (2 to 8 tokens)
//
// nn.Linear for a few rows of x (a short prompt, or one token of each of a batch's sessions): the
// matvec layout with every weight read once for all the tokens. A workgroup of 64 invocations is
// 64 / LANES row groups of LANES invocations; each invocation owns TR = 8 consecutive rows, loads
// one vec4<u32> of weights per row and step (8 bf16/f16 weights, two vec4 for f32), widens them
// once and multiplies them with the same 8 elements of each of the TOK token rows of x: every x
// value loaded serves 8 rows (TOK * 8 loads of x per 64 weights). Registers: 2 * TOK vec4
// accumulators and the 8 rows' words. Partial sums are reduced through workgroup memory in two
// halves of 4 rows (8 KB at TOK 8, as for 4 rows per invocation; a barrier after each half is
// staged and after it is summed); the storing invocations add the LoRA expand of their
// (row, token).
//
// Host contract: K a multiple of 8, x rows 16-byte aligned (x_offset and x_stride multiples of 4),
// m <= TOK (token rows past m are skipped: not loaded, computed or stored). Parameters, bindings and the
// helpers: linear.wgsl.

override LANES: u32 = 16u;       // invocations along K per row group: 8, 16, 32 or 64
override TOK: u32 = 4u;          // token rows per dispatch: 2, 4 or 8

const WG: u32 = 64u;
const TR: u32 = 8u;
const MAX_TOK: u32 = 8u;
const ACC: u32 = 16u; // vec4 accumulators: two per token
const_assert ACC == 2u * MAX_TOK && TR == 8u;

// One half of the partials: [4 rows of each row group][TOK][LANES] = 4 * WG * TOK floats.
var<workgroup> red: array<f32, 2048>;

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

// Partial sums of this invocation's 8 rows for each token: acc[2 * token] = rows 0-3,
// acc[2 * token + 1] = rows 4-7.
fn partials(s: Slot) -> array<vec4<f32>, ACC> {
    var acc: array<vec4<f32>, ACC>;
    let first = s.row0 + s.group * TR;
    let last = p.n - 1u;
    let groups = p.k / 8u;
    let row_vecs = select(groups, 2u * groups, W_DTYPE == 0u);
    var r: array<u32, TR>;
    for (var i = 0u; i < TR; i++) {
        r[i] = (p.w_row0 + min(first + i, last)) * row_vecs;
    }
    for (var j = s.lane; j < groups; j += LANES) {
        let w0 = weights8(r[0], j);
        let w1 = weights8(r[1], j);
        let w2 = weights8(r[2], j);
        let w3 = weights8(r[3], j);
        let w4 = weights8(r[4], j);
        let w5 = weights8(r[5], j);
        let w6 = weights8(r[6], j);
        let w7 = weights8(r[7], j);
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
            acc[2u * tk] += vec4<f32>(dot(w0[0], xe) + dot(w0[1], xo), dot(w1[0], xe) + dot(w1[1], xo),
                dot(w2[0], xe) + dot(w2[1], xo), dot(w3[0], xe) + dot(w3[1], xo));
            acc[2u * tk + 1u] += vec4<f32>(dot(w4[0], xe) + dot(w4[1], xo), dot(w5[0], xe) + dot(w5[1], xo),
                dot(w6[0], xe) + dot(w6[1], xo), dot(w7[0], xe) + dot(w7[1], xo));
        }
    }
    return acc;
}

// Half h (rows 4h to 4h + 3 of every row group) of the partials into workgroup memory, then one
// barrier.
fn stage(s: Slot, acc: array<vec4<f32>, ACC>, h: u32) {
    for (var tk = 0u; tk < TOK; tk++) {
        let base = ((s.group * 4u) * TOK + tk) * LANES + s.lane;
        let a = acc[2u * tk + h];
        red[base] = a.x;
        red[base + TOK * LANES] = a.y;
        red[base + 2u * TOK * LANES] = a.z;
        red[base + 3u * TOK * LANES] = a.w;
    }
    workgroupBarrier();
}

// Outputs of a half: output o is (row group (o / TOK) / 4, its row 4h + (o / TOK) % 4, token
// o % TOK); invocation li sums o = li, li + 64, ...
fn outputs() -> u32 {
    return 4u * (WG / LANES) * TOK;
}

// The output row of half h's output o, within the workgroup.
fn out_row(o: u32, h: u32) -> u32 {
    let r = o / TOK;
    return (r / 4u) * TR + 4u * h + r % 4u;
}

fn inside(s: Slot, row: u32, o: u32) -> bool {
    return s.row0 + row < p.n && o % TOK < p.m;
}

fn lane_sum(o: u32) -> f32 {
    var sum = 0.0;
    for (var l = 0u; l < LANES; l++) {
        sum += red[o * LANES + l];
    }
    return sum;
}

fn store(s: Slot, row: u32, o: u32, v: f32) {
    let idx = p.y_offset + (o % TOK) * p.y_stride + s.row0 + row;
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
    let acc = partials(s);
    for (var h = 0u; h < 2u; h++) {
        stage(s, acc, h);
        for (var o = li; o < outputs(); o += WG) {
            let row = out_row(o, h);
            if (inside(s, row, o)) {
                store(s, row, o, lane_sum(o));
            }
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(64)
fn matvec_batch_lora(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let s = slot(wg, nwg, li);
    let acc = partials(s);
    for (var h = 0u; h < 2u; h++) {
        stage(s, acc, h);
        for (var o = li; o < outputs(); o += WG) {
            let row = out_row(o, h);
            if (inside(s, row, o)) {
                store(s, row, o, lane_sum(o) + lora_row(s.row0 + row, o % TOK));
            }
        }
        workgroupBarrier();
    }
}
