//! The `kvroute-index` process: its command line and how `kvroute_runtime::main` runs it
//! (config file, ready file `grpc=ADDR` / `admin=ADDR`, reloads of the file, shutdown).

use std::net::SocketAddr;

use clap::Parser;
use kvroute_runtime::process::{BoxError, Component, Running, ServerArgs, StartError, read_config};

use crate::config::Config;
use crate::server::IndexServer;

/// `kvroute-index --config index.yaml`.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "kvroute KV block index: ingests vLLM KV events, answers prefix matches"
)]
pub struct Args {
    /// `--config`, `--ready-file`.
    #[command(flatten)]
    pub server: ServerArgs,
}

/// The index service as a process.
#[derive(Debug)]
pub struct Process;

impl Component for Process {
    const NAME: &'static str = "kvroute-index";
    type Args = Args;
    type Config = Config;
    type Running = IndexServer;

    fn server_args(args: &Args) -> &ServerArgs {
        &args.server
    }

    fn load(args: &Args) -> Result<Config, BoxError> {
        let text = read_config(&args.server.config)?;
        Ok(Config::from_yaml(&text)?)
    }

    async fn start(config: Config, args: Args) -> Result<IndexServer, StartError> {
        let reload_interval = config.reload_interval;
        let server = IndexServer::start(config)
            .await
            .map_err(StartError::failed)?;
        server.watch_config(args.server.config, reload_interval);
        Ok(server)
    }
}

impl Running for IndexServer {
    fn ready_lines(&self) -> Vec<(&'static str, SocketAddr)> {
        vec![("grpc", self.grpc_addr()), ("admin", self.admin_addr())]
    }

    async fn failed(&mut self) -> String {
        IndexServer::failed(self).await
    }

    async fn shutdown(self) -> Result<(), BoxError> {
        IndexServer::shutdown(self).await;
        Ok(())
    }
}
