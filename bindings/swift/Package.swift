// swift-tools-version:5.9
// The C API as a Swift package: run `cargo xtask xcframework` on macOS first (it writes
// Qwen35Wgpu.xcframework next to this file), then add this directory as a package dependency
// and `import Qwen35WgpuC`. Not built in this repository's CI (no macOS there); everything it
// wraps is tested through C (bindings/c/tests/api_test.c).
import PackageDescription

let package = Package(
    name: "Qwen35Wgpu",
    platforms: [.macOS(.v13)],
    products: [.library(name: "Qwen35WgpuC", targets: ["Qwen35WgpuC"])],
    targets: [.binaryTarget(name: "Qwen35WgpuC", path: "Qwen35Wgpu.xcframework")]
)
