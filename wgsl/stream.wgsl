// Streaming read: every invocation grid-strides over the buffer with 16-byte loads and keeps a
// running sum, one result per invocation, so the bytes read are the whole buffer and the bytes
// written are negligible. The device's read bandwidth is the yardstick for the decode step (which
// must read every weight once per token).

struct Params {
    n: u32,          // vec4<f32> elements
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<f32>>;

@compute @workgroup_size(256)
fn stream_read(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    var acc = vec4<f32>(0.0);
    for (var i = gid.x; i < p.n; i += stride) {
        acc += src[i];
    }
    dst[gid.x] = acc;
}
