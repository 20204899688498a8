// Embedding gather from one row-chunk of the (possibly split) embedding table.

override W_DTYPE: u32 = 0u;  // 0 = f32, 1 = bf16, 2 = f16 (embedding rows)

struct Params {
    n: u32,          // hidden size
    rows: u32,       // tokens
    row_start: u32,  // first vocabulary row held by this chunk
    row_count: u32,  // rows held by this chunk
}

@group(0) @binding(0) var<uniform> p: Params;

// hidden[t, d] = E[ids[t], d] for the ids that fall into this chunk

@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> hidden: array<f32>;
@group(1) @binding(0) var<storage, read> table: array<u32>;

fn table_at(idx: u32) -> f32 {
    if (W_DTYPE == 1u) {
        let word = table[idx >> 1u];
        return bitcast<f32>(((word >> ((idx & 1u) * 16u)) & 0xffffu) << 16u);
    }
    if (W_DTYPE == 2u) {
        return unpack2x16float(table[idx >> 1u])[idx & 1u];
    }
    return bitcast<f32>(table[idx]);
}

@compute @workgroup_size(64)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>) {
    let d = gid.x;
    let t = gid.y;
    if (d >= p.n || t >= p.rows) {
        return;
    }
    let id = ids[t];
    if (id >= p.row_start && id < p.row_start + p.row_count) {
        hidden[t * p.n + d] = table_at((id - p.row_start) * p.n + d);
    }
}
