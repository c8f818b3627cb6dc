//! The `kvroute-index` process: how `kvroute_runtime::main` runs it (config file, ready file
//! `grpc=ADDR` / `admin=ADDR`, reloads of the file, shutdown).

use std::net::SocketAddr;

use kvroute_runtime::process::{BoxError, Component, ConfigFile, Running, ServerArgs, StartError};

use crate::config::Config;
use crate::server::IndexServer;

/// The index service as a process: `kvroute-index --config index.yaml`.
#[derive(Debug)]
pub struct Process;

impl ConfigFile for Config {
    fn from_yaml(text: &str) -> Result<Self, kvroute_config::ConfigError> {
        Config::from_yaml(text)
    }

    fn log_format(&self) -> kvroute_config::LogFormat {
        self.log_format
    }
}

impl Component for Process {
    const NAME: &'static str = "kvroute-index";
    const ABOUT: &'static str =
        "kvroute KV block index: ingests vLLM KV events, answers prefix matches";
    type Args = ServerArgs;
    type Config = Config;
    type Running = IndexServer;

    async fn start(config: Config, args: ServerArgs) -> Result<IndexServer, StartError> {
        let reload_interval = config.reload_interval;
        let server = IndexServer::start(config)
            .await
            .map_err(StartError::failed)?;
        // `--config` is required for the index (clap refuses a command line without it).
        if let Some(path) = args.config {
            server.watch_config(path, reload_interval);
        }
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
