//! Compiles the index gRPC API with protox (pure Rust), so no `protoc` is needed on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/kvroute/index/v1/index.proto",
        "proto/kvroute/index/v1/agent.proto",
    ];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
