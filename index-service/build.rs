//! Compiles the index gRPC API with protox (pure Rust), so no `protoc` is needed on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/kvroute/index/v1/index.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
